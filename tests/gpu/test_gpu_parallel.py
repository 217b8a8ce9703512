"""2+ GPUs only: tensor-parallel (TP=2) and data-parallel (DP=2) extraction of a Qwen3.5/3.6
checkpoint at Qwen3.6-27B's widths (4 layers: 3 Gated DeltaNet, 1 gated full attention),
torch.compile + CUDA graphs, against TP=1 and against HF Transformers (float32) on the same
weights, every layer. Run: `pytest -q -s tests/gpu/test_gpu_parallel.py` on a 2-GPU host."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests.gpu.reference import Qwen35Reference
from tests.gpu.test_gpu_qwen35 import BATCHED, BOUND, ENGINE, LAYERS, MAX_LEN, VOCAB, _prompts, _rel

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def test_gpu_tp2_and_dp2_match_tp1_and_hf(tmp_path):
    from vllm_hidden.config import ExtractConfig
    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.demo import make_qwen35_model
    from vllm_hidden.extract import run_extract

    model = make_qwen35_model(tmp_path / "qwen3_5-4", num_layers=len(LAYERS), vocab_size=VOCAB)
    good = _prompts(tmp_path / "in.jsonl")
    outs, summaries = {}, {}
    for mode, dp, tp in (("tp1", 1, 1), ("tp2", 1, 2), ("dp2", 2, 1)):
        outs[mode] = tmp_path / mode
        t0 = time.perf_counter()
        s = run_extract(ExtractConfig(model=str(model), input_path=str(tmp_path / "in.jsonl"),
                                      output_dir=str(outs[mode]), layers=",".join(map(str, LAYERS)),
                                      max_model_len=MAX_LEN, max_num_batched_tokens=BATCHED, dtype="bfloat16",
                                      progress=False, engine_args=ENGINE, dp=dp, tp=tp))
        assert s.samples == len(good) and s.errors == 0, (mode, s.to_dict())
        summaries[mode] = {**s.to_dict(), "wall_s": round(time.perf_counter() - t0, 1)}
        print(f"qwen3_5 {mode}: {json.dumps(summaries[mode])[:800]}")
    m = json.loads((outs["tp2"] / "manifest.json").read_text())
    assert m["engine"]["tensor_parallel_size"] == 2
    parts = {s["file"].split("/")[0] for s in json.loads((outs["dp2"] / "manifest.json").read_text())["shards"]}
    assert parts == {"rank-000", "rank-001"}, parts  # both engines wrote

    hf = Qwen35Reference(model)
    by_id = {m: {d[i]["id"]: d[i] for i in range(len(d))} for m, d in
             ((m, HiddenStatesDataset(p)) for m, p in outs.items())}
    worst_hf = {m: [0.0] * len(LAYERS) for m in outs}
    worst_vs_tp1 = {m: [0.0] * len(LAYERS) for m in ("tp2", "dp2")}
    for sid, ids in good.items():
        r, states = hf.run(ids)
        del r
        got = {}
        for m in outs:
            smp = by_id[m][sid]
            assert smp["token_ids"].tolist() == ids
            got[m] = smp["hidden_states"].cuda().float()
            for k, layer in enumerate(LAYERS):
                err = _rel(got[m][:, k], states[layer + 1])
                worst_hf[m][k] = max(worst_hf[m][k], err)
                assert err <= BOUND, (m, sid, layer, err)
        for m in worst_vs_tp1:
            for k, layer in enumerate(LAYERS):
                d = _rel(got[m][:, k], got["tp1"][:, k])
                worst_vs_tp1[m][k] = max(worst_vs_tp1[m][k], d)
                assert d <= BOUND, (m, "vs tp1", sid, layer, d)
    print(f"worst rel L2 vs HF per layer {LAYERS}: {worst_hf}; vs TP=1: {worst_vs_tp1}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu-parallel-parity.json"), "w") as f:
            json.dump({"arch": "qwen3_5 (Qwen3.6-27B widths, 4 layers)", "layers": LAYERS, "bound": BOUND,
                       "samples": len(good), "worst_rel_l2_vs_hf": worst_hf, "worst_rel_l2_vs_tp1": worst_vs_tp1,
                       "extract": summaries}, f, indent=1)
