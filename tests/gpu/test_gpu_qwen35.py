"""GPU host only (skipped without CUDA): the capture hook on a Qwen3.5/3.6 checkpoint
(`Qwen3_5ForConditionalGeneration`, served with --language-model-only) at Qwen3.6-27B's widths
with 4 layers (3 Gated DeltaNet, then 1 gated full attention), with torch.compile + CUDA graphs
(vLLM defaults) and with enforce_eager, checked against HF Transformers in float32 on the same
weights. The CUDA-graph run also captures the final normed state (--final-state post-norm),
checked against HF's output_hidden_states[-1]. Run: `pytest -q -s tests/gpu` on the GPU host."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

from tests.gpu.reference import Qwen35Reference
from tests.gpu.test_gpu_capture import expected_runner, manifest_runner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BOUND = 1e-2
NEIGHBOUR = 5e-2  # captured layer k must differ from HF's layers k-1 and k+1 by more than this
LAYERS = [0, 1, 2, 3]  # every layer; 3 is the last, compared before the final norm
VOCAB = 4096
MAX_LEN = 2048
BATCHED = 512  # below the long prompts' lengths, so they prefill in chunks
ENGINE = ["--gdn-prefill-backend", "triton", "--language-model-only", "--gpu-memory-utilization", "0.5",
          "--max-num-seqs", "64"]


def _prompts(path, vocab=VOCAB, seed=0):
    rng = random.Random(seed)
    lengths = [1, 2000] + [int(min(2000, max(1, rng.lognormvariate(5.5, 1.2)))) for _ in range(22)]
    good = {f"s{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate(lengths)}
    good["exact"] = [rng.randrange(vocab) for _ in range(MAX_LEN)]
    with open(path, "w") as f:
        for sid, ids in good.items():
            f.write(json.dumps({"id": sid, "token_ids": ids}) + "\n")
    return good


def _rel(got, ref):
    return ((got - ref).norm() / ref.norm()).item()


def test_gpu_qwen35_capture_matches_hf_graphs_and_eager(tmp_path):
    from vllm_hidden.config import ExtractConfig
    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.demo import make_qwen35_model
    from vllm_hidden.extract import run_extract

    t0 = time.perf_counter()
    model = make_qwen35_model(tmp_path / "qwen3_5-4", num_layers=len(LAYERS), vocab_size=VOCAB)
    build_s = time.perf_counter() - t0
    good = _prompts(tmp_path / "in.jsonl")
    outs, summaries, runners = {}, {}, {}
    for mode, extra in (("graphs", []), ("eager", ["--enforce-eager"])):
        outs[mode] = tmp_path / mode
        s = run_extract(ExtractConfig(model=str(model), input_path=str(tmp_path / "in.jsonl"),
                                      output_dir=str(outs[mode]), layers=",".join(map(str, LAYERS)),
                                      max_model_len=MAX_LEN, max_num_batched_tokens=BATCHED, dtype="bfloat16",
                                      progress=False, engine_args=ENGINE + extra,
                                      final_state="post-norm" if mode == "graphs" else "none"))
        assert s.samples == len(good) and s.errors == 0
        summaries[mode] = s.to_dict()
        runners[mode] = manifest_runner(outs[mode])
        assert runners[mode] == (expected_runner("qwen3_5") or runners[mode]), runners
        print(f"qwen3_5 {mode} (model runner {runners[mode]}): {summaries[mode]}")

    # vLLM's engines are shut down; the float32 reference (~6 GB of weights) has the GPU to itself
    t1 = time.perf_counter()
    hf = Qwen35Reference(model)
    assert len(hf.decoder) == len(LAYERS)
    ds = {m: HiddenStatesDataset(p) for m, p in outs.items()}
    by_id = {m: {d[i]["id"]: d[i] for i in range(len(d))} for m, d in ds.items()}
    worst = {m: [0.0] * len(LAYERS) for m in outs}
    worst_modes = [0.0] * len(LAYERS)
    min_neighbour = [float("inf")] * len(LAYERS)
    worst_final, min_final_vs_last = 0.0, float("inf")
    for sid, ids in good.items():
        # states[0] = embeddings, states[k + 1] = output of layer k (the last one before the final norm)
        r, states = hf.run(ids)
        post_norm = r.hidden_states[-1][0]  # HF applies the final norm to its last entry
        del r
        got = {}
        for m in outs:
            smp = by_id[m][sid]
            assert smp["token_ids"].tolist() == ids
            got[m] = smp["hidden_states"].cuda().float()
            for k, layer in enumerate(LAYERS):
                err = _rel(got[m][:, k], states[layer + 1])
                worst[m][k] = max(worst[m][k], err)
                assert err <= BOUND, (m, sid, layer, err)
        final = by_id["graphs"][sid]["final_hidden_states"].cuda().float()
        assert "final_hidden_states" not in by_id["eager"][sid]
        err = _rel(final, post_norm)
        worst_final = max(worst_final, err)
        assert err <= BOUND, ("final state", sid, err)
        if len(ids) >= 1000:  # the check can fail: the state before the norm is far from it
            min_final_vs_last = min(min_final_vs_last, _rel(final, states[-1]))
            assert min_final_vs_last > NEIGHBOUR, ("final state vs last layer", sid, min_final_vs_last)
        for k in range(len(LAYERS)):
            diff = _rel(got["eager"][:, k], got["graphs"][:, k])
            worst_modes[k] = max(worst_modes[k], diff)
            assert diff <= BOUND, ("eager vs graphs", sid, LAYERS[k], diff)
        if len(ids) >= 1000:  # off-by-one guard: each capture is far from the neighbouring layers' states
            for k, layer in enumerate(LAYERS):
                for j in (layer, layer + 2):  # HF index of layer - 1 (embeddings for layer 0) and of layer + 1
                    if j < len(states):
                        d = _rel(got["graphs"][:, k], states[j])
                        min_neighbour[k] = min(min_neighbour[k], d)
                        assert d > NEIGHBOUR, ("neighbour", sid, layer, j, d)
    hf_s = time.perf_counter() - t1
    assert all(v < float("inf") for v in min_neighbour)
    print(f"qwen3_5 final state (post-norm, graphs) worst rel L2 {worst_final}, min vs last layer {min_final_vs_last}")
    print(f"qwen3_5 worst rel L2 per layer {LAYERS}: {worst}; eager vs graphs {worst_modes}; "
          f"min neighbour-layer rel L2 {min_neighbour}; build {build_s:.1f}s, HF reference {hf_s:.1f}s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu-parity-qwen3_5.json"), "w") as f:
            json.dump({"arch": "qwen3_5", "worst_rel_l2": worst, "layers": LAYERS, "eager_vs_graphs": worst_modes,
                       "min_neighbour_rel_l2": min_neighbour, "final_state_worst_rel_l2": worst_final,
                       "final_state_min_vs_last_layer": min_final_vs_last, "build_seconds": round(build_s, 1),
                       "hf_reference_seconds": round(hf_s, 1), "extract": summaries, "model_runner": runners}, f)
