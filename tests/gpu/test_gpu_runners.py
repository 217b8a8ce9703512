"""GPU host only (skipped without CUDA): `vllm-hidden serve` on the model runner vLLM picks for
a dense model (V2 on vLLM 0.26), with vLLM's defaults (torch.compile + CUDA graphs; in
V2's FULL graphs, which its default mode uses for uniform decode steps, the aux outputs are
static buffers padded past the step's tokens). Prompt and generated tokens' states, inline and fetched, from
concurrent requests (so steps mix decodes, sorted first by V2, with prefill chunks), against HF Transformers in
float32. Run: `pytest -q -s tests/gpu/test_gpu_runners.py` on the GPU host; results to $OUT."""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.gpu.test_gpu_capture import expected_runner
from tests.integration.helpers import HFReference, Server, check_states, rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYERS = [0, 3, 7]
BOUND = 1e-2


def test_gpu_serve_dense_on_vllms_runner_matches_hf(tiny_models, tmp_path):
    from vllm_hidden.server import fetch

    model = tiny_models("qwen3")
    server = Server(model, tmp_path / "server.log", ",".join(map(str, LAYERS)), "--dtype", "bfloat16",
                    "--max-model-len", "2048", "--gpu-memory-utilization", "0.3", "--max-num-batched-tokens", "512")
    log = ""
    try:
        name = server.model_name()
        rng = random.Random(0)
        jobs = [([rng.randrange(10, 1000) for _ in range(n)], "all" if i % 2 else "prompt",
                 "fetch" if i % 3 == 0 else "inline")
                for i, n in enumerate([1, 7, 300, 1200, 64, 900, 33, 512, 2, 700, 128, 1500, 17, 256, 1000, 90])]

        def one(job):
            ids, tokens, transfer = job
            body = {"model": name, "prompt": ids, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
                    "hidden_states": {"layers": LAYERS, "tokens": tokens, "transfer": transfer}}
            status, d = server.post("/v1/completions", body, timeout=300)
            assert status == 200, d
            got = fetch(server.url, d["hidden_states"]) if transfer == "fetch" else None
            return d, got

        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, jobs))
        load_s = time.perf_counter() - t0
    finally:
        server.stop()
        log = (tmp_path / "server.log").read_text(errors="replace")
    runner = "v2" if "(model runner V2)" in log else "v1" if "(model runner V1)" in log else None
    assert runner is not None, log[-3000:]
    assert runner == (expected_runner("qwen3") or runner), runner
    ref = HFReference(model)
    worst = [0.0] * len(LAYERS)
    for (ids, tokens, _transfer), (d, got) in zip(jobs, answers):
        out_ids = d["choices"][0]["token_ids"]
        want = ids + out_ids[:-1] if tokens == "all" else ids  # the last sampled token never ran
        dec = check_states(ref, d["hidden_states"], LAYERS, ids=want, tol=BOUND, fetched=got)
        states = ref.states(want)
        for k, layer in enumerate(LAYERS):
            worst[k] = max(worst[k], rel_l2(dec["hidden_states"][:, k], states[layer]))
    print(f"serve qwen3 on model runner {runner}: {len(jobs)} requests in {load_s:.1f} s, worst rel L2 per layer "
          f"{LAYERS}: {worst}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu-serve-runner-qwen3.json"), "w") as f:
            json.dump({"arch": "qwen3", "model_runner": runner, "requests": len(jobs), "worst_rel_l2": worst,
                       "layers": LAYERS, "seconds": round(load_s, 2)}, f)
