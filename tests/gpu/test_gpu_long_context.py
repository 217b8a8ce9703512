"""GPU host only (skipped without CUDA): long prompts on the Qwen3.5/3.6 hybrid at Qwen3.6-27B's
widths (4 layers: 3 Gated DeltaNet, then 1 gated full attention). Prompts of 8k, 16k and 32k
tokens with max_model_len 32768 and 16,384-token steps, so a prompt spans steps and the
DeltaNet state and the KV cache cross step boundaries; a few short prompts share the steps.
Checked against HF Transformers in float32 (its torch fallback of the DeltaNet kernels) on the
same weights, on every layer, and separately on each step-sized stretch of a prompt's rows, so
a state carried wrongly from one step to the next shows where it happens. HF in bf16 is
measured against the same float32 reference, as the scale of the error bf16 itself makes.
Run: `pytest -q -s tests/gpu/test_gpu_long_context.py` on the GPU host."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

from tests.gpu.reference import Qwen35Reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BOUND = 1e-2
NEIGHBOUR = 5e-2  # each captured layer must differ from HF's neighbouring layers' states by more than this
LAYERS = [0, 1, 2, 3]
VOCAB = 4096
MAX_LEN = 32768
STEP = 16384  # max_num_batched_tokens
LONG = {"l8k": 8192, "l16k": 16384, "l32k": 32768, "l24k": 24000}
ENGINE = ["--gdn-prefill-backend", "triton", "--language-model-only", "--gpu-memory-utilization", "0.5",
          "--max-num-seqs", "16"]


BLOCK = 2048  # query rows per attention call in the HF reference


def _rel(got, ref):
    return ((got - ref).norm() / ref.norm()).item()


def _blocked_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF's sdpa attention a block of queries at a time (one unpadded sequence, causal). In
    float32 with grouped KV heads PyTorch takes its math kernel, whose score matrix for a
    32k-token prompt would be 96 GiB; in blocks of 2048 rows it is 6 GiB."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    q_len, kv_len = query.shape[2], key.shape[2]
    out = torch.empty_like(query)
    for a in range(0, q_len, BLOCK):
        b = min(q_len, a + BLOCK)
        end = kv_len - q_len + b
        if attention_mask is None:  # query row i sees keys up to its own position
            mask = torch.ones(b - a, end, dtype=torch.bool, device=query.device).tril(kv_len - q_len + a)
        else:
            mask = attention_mask[:, :, a:b, :end]
        out[:, :, a:b] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, :end], value[:, :, :end], attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _references(model, prompts):
    """Per prompt, the embeddings and every decoder layer's output (the last one's before the
    final norm), from HF in float32 and in bf16, with attention in query blocks."""
    from transformers import AttentionInterface

    refs, seconds = {}, {}
    sdpa = AttentionInterface._global_mapping["sdpa"]
    AttentionInterface._global_mapping["sdpa"] = _blocked_sdpa
    try:
        for dtype in (torch.float32, torch.bfloat16):
            hf = Qwen35Reference(model, dtype=dtype)
            assert len(hf.decoder) == len(LAYERS)
            refs[dtype] = {}
            t1 = time.perf_counter()
            for sid, ids in prompts.items():
                r, states = hf.run(ids, logits_to_keep=1)
                # [0] the embeddings, [k + 1] the output of layer k
                refs[dtype][sid] = [h.float().cpu() for h in states]
                del r, states
            seconds[dtype] = time.perf_counter() - t1
            del hf
            torch.cuda.empty_cache()
    finally:
        AttentionInterface._global_mapping["sdpa"] = sdpa
    return refs[torch.float32], refs[torch.bfloat16], seconds


def test_gpu_long_context_matches_hf(tmp_path):
    from vllm_hidden.config import ExtractConfig
    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.demo import make_qwen35_model
    from vllm_hidden.extract import run_extract

    model = make_qwen35_model(tmp_path / "qwen3_5-4", num_layers=len(LAYERS), vocab_size=VOCAB)
    rng = random.Random(0)
    # short ones first in the file, so the long ones start mid-step beside them
    lengths = {"s0": 1, "s1": 300, "s2": 5000, **LONG}
    prompts = {sid: [rng.randrange(VOCAB) for _ in range(n)] for sid, n in lengths.items()}
    with open(tmp_path / "in.jsonl", "w") as f:
        for sid, ids in prompts.items():
            f.write(json.dumps({"id": sid, "token_ids": ids}) + "\n")
    t0 = time.perf_counter()
    s = run_extract(ExtractConfig(model=str(model), input_path=str(tmp_path / "in.jsonl"),
                                  output_dir=str(tmp_path / "out"), layers=",".join(map(str, LAYERS)),
                                  max_model_len=MAX_LEN, max_num_batched_tokens=STEP, dtype="bfloat16",
                                  progress=False, engine_args=ENGINE))
    extract_s = time.perf_counter() - t0
    assert s.samples == len(prompts) and s.errors == 0, s.to_dict()

    # the engine is shut down: the references have the GPU to themselves
    ds = HiddenStatesDataset(tmp_path / "out")
    by_id = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    fp32, bf16, ref_s = _references(model, prompts)
    report = {}
    for sid, ids in prompts.items():
        smp = by_id[sid]
        assert smp["token_ids"].tolist() == ids
        got = smp["hidden_states"].float()
        n = len(ids)
        row = report[sid] = {"tokens": n, "vllm": [], "hf_bf16": [], "vllm_per_step": []}
        for k, layer in enumerate(LAYERS):
            ref = fp32[sid][layer + 1]
            err = _rel(got[:, k], ref)
            row["vllm"].append(err)
            row["hf_bf16"].append(_rel(bf16[sid][layer + 1], ref))
            assert err <= BOUND, (sid, layer, err, row["hf_bf16"][-1])
            # each step-sized stretch on its own: an error in the state handed across steps shows
            # in the stretches after the first
            parts = [_rel(got[a : a + STEP, k], ref[a : a + STEP]) for a in range(0, n, STEP)] if n > 1 else [err]
            row["vllm_per_step"].append(parts)
            assert max(parts) <= BOUND, (sid, layer, parts)
            if n >= 1000:  # off by one layer would be far off: the check can fail
                for j in (layer, layer + 2):
                    if j < len(fp32[sid]):
                        d = _rel(got[:, k], fp32[sid][j])
                        assert d > NEIGHBOUR, ("neighbour", sid, layer, j, d)
    print(f"long context: extract {extract_s:.1f}s {s.to_dict()}")
    for sid, row in report.items():
        print(f"  {sid} ({row['tokens']} tokens): vLLM rel L2 per layer {row['vllm']}; HF bf16 {row['hf_bf16']}; "
              f"vLLM per {STEP}-token stretch {row['vllm_per_step']}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu-long-context-qwen3_5.json"), "w") as f:
            json.dump({"arch": "qwen3_5", "widths": "qwen3.6-27b", "layers": LAYERS, "bound": BOUND,
                       "max_model_len": MAX_LEN, "max_num_batched_tokens": STEP, "samples": report,
                       "extract_seconds": round(extract_s, 1), "extract": s.to_dict(),
                       "hf_fp32_seconds": round(ref_s[torch.float32], 1),
                       "hf_bf16_seconds": round(ref_s[torch.bfloat16], 1)}, f)
