"""GPU host only (skipped without CUDA): `vllm-hidden serve` on the Qwen3.5/3.6 checkpoint at
Qwen3.6-27B widths (4 layers: 3 Gated DeltaNet + 1 full attention) with vLLM's defaults
(torch.compile + CUDA graphs, so decode steps replay full graphs): hidden states of prompt
and generated tokens against HF Transformers in float32, then a bounded concurrent load
(64 clients) without states, with states, and mixed: throughput and latency.
Run: `pytest -q -s tests/gpu/test_gpu_server.py` on the GPU host; results to $OUT."""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time

import pytest
import torch

from tests.integration.helpers import Server

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BOUND = 1e-2
LAYERS = [0, 1, 2, 3]
VOCAB = 4096
ENGINE = ["--gdn-prefill-backend", "triton", "--language-model-only", "--gpu-memory-utilization", "0.6",
          "--max-model-len", "4096", "--max-hidden-tokens", "4096"]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _load(server: Server, name: str, mode: str, clients: int = 64, per_client: int = 2, seed: int = 7):
    """`clients` threads x `per_client` completions (lognormal prompt lengths, 32 new tokens)."""
    c = server.client(timeout=600)
    lat: list[float] = []
    toks = [0]
    keep: list = []
    errors: list = []
    lock = threading.Lock()

    def run(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        try:
            for j in range(per_client):
                p = _ids(rng, int(min(2048, max(16, rng.lognormvariate(5.95, 0.8)))))
                want = mode == "states" or (mode == "mixed" and (i + j) % 2 == 0)
                extra = {"hidden_states": {"tokens": "all" if j % 2 else "prompt"}} if want else {}
                t0 = time.perf_counter()
                r = c.completions.create(model=name, prompt=p, max_tokens=32, temperature=0,
                                         extra_body={**extra, "return_token_ids": True} if want else {})
                dt = time.perf_counter() - t0
                obj = (r.model_extra or {}).get("hidden_states")
                assert (obj is not None) == want
                with lock:
                    lat.append(dt)
                    toks[0] += r.usage.prompt_tokens + r.usage.completion_tokens
                    if want and len(keep) < 6:
                        keep.append((p, list(r.choices[0].token_ids), obj))
        except Exception as e:  # noqa: BLE001 - reported by the caller
            errors.append(f"{e!r} <- {e.__cause__!r} <- {getattr(e.__cause__, '__cause__', None)!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert errors == [], errors[:3]
    return {"mode": mode, "clients": clients, "requests": len(lat), "seconds": round(wall, 2),
            "tokens_per_s": round(toks[0] / wall, 1), "latency_p50_s": round(statistics.median(lat), 3),
            "latency_p99_s": round(_pct(lat, 0.99), 3)}, keep


def test_gpu_server_states_match_hf_and_load(tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration

    from vllm_hidden.demo import make_qwen35_model
    from vllm_hidden.server import decode

    model = make_qwen35_model(tmp_path / "qwen3_5-4", num_layers=len(LAYERS), vocab_size=VOCAB)
    rng = random.Random(0)
    t0 = time.perf_counter()
    server = Server(model, tmp_path / "server.log", ",".join(map(str, LAYERS)), *ENGINE, timeout=900)
    start_s = time.perf_counter() - t0
    checks: list = []  # (token ids the states cover, decoded tensors, what)
    try:
        c = server.client(timeout=600)
        name = c.models.list().data[0].id
        for n in (1, 17, 600, 2000):
            p = _ids(rng, n)
            r = c.completions.create(model=name, prompt=p, max_tokens=4, temperature=0,
                                     extra_body={"hidden_states": True})
            d = decode(r.model_extra["hidden_states"])
            assert d["token_ids"].tolist() == p
            checks.append((p, d, f"prompt {n}"))
        for n in (5, 300, 1500):
            p = _ids(rng, n)
            r = c.completions.create(model=name, prompt=p, max_tokens=32, temperature=0,
                                     extra_body={"hidden_states": {"tokens": "all"}, "return_token_ids": True})
            gen = list(r.choices[0].token_ids)
            d = decode(r.model_extra["hidden_states"])
            assert d["token_ids"].tolist() == p + gen[:-1]
            checks.append((p + gen[:-1], d, f"all {n}+{len(gen)}"))
        results = []
        for mode in ("plain", "states", "mixed"):
            res, keep = _load(server, name, mode)
            results.append(res)
            print(f"load {res}")
            for p, gen, obj in keep:
                d = decode(obj)
                checks.append((d["token_ids"].tolist(), d, f"load {mode} {len(p)}"))
        rss = server.rss_bytes()
    finally:
        server.stop()
        if os.environ.get("OUT"):  # the server's own log, for whatever failed
            import shutil

            shutil.copy(tmp_path / "server.log", os.path.join(os.environ["OUT"], "gpu-server.log"))

    hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
    decoder = hf.model.language_model.layers
    last = {}
    decoder[-1].register_forward_hook(lambda m, i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    worst = [0.0] * len(LAYERS)
    for ids, d, what in checks:
        assert d["token_ids"].tolist() == ids
        with torch.no_grad():
            r = hf(torch.tensor([ids], device="cuda"), output_hidden_states=True, use_cache=False)
        states = [h[0] for h in r.hidden_states[: len(LAYERS)]] + [last["h"][0]]
        got = d["hidden_states"].cuda().float()
        for k, layer in enumerate(LAYERS):
            ref = states[layer + 1]
            err = ((got[:, k] - ref).norm() / ref.norm()).item()
            worst[k] = max(worst[k], err)
            assert err <= BOUND, (what, layer, err)
    print(f"server: start {start_s:.1f}s, worst rel L2 per layer {LAYERS}: {worst} over {len(checks)} responses; "
          f"server RSS {rss / 1e9:.2f} GB")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu-server-qwen3_5.json"), "w") as f:
            json.dump({"arch": "qwen3_5", "layers": LAYERS, "engine_args": ENGINE, "worst_rel_l2": worst,
                       "responses_checked": len(checks), "server_start_seconds": round(start_s, 1),
                       "server_rss_bytes_after_load": rss, "load": results}, f, indent=1)
