"""GPU host only (skipped without CUDA): `extract --generate` on a Qwen3.5/3.6 checkpoint at
Qwen3.6-27B's widths with 4 layers (3 Gated DeltaNet, 1 gated full attention), CUDA graphs
and torch.compile on (vLLM's defaults: decode steps replay graphs), chunked prefill, greedy.
Every row of every sample (prompt and response, the last kept token included) and the final
normed state are checked against HF Transformers in float32 over the whole sequence; every
generated token must be HF's greedy choice given its prefix (bf16 against float32: a token
where HF's two best logits are within NEAR_TIE is counted, not failed). Run: `pytest -q -s
tests/gpu` on the GPU host."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from tests.gpu.reference import Qwen35Reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BOUND = 1e-2
NEAR_TIE = 0.1  # logits (float32 HF); bf16 rounding of the states moves logits by about this much
LAYERS = [0, 1, 2, 3]
VOCAB = 4096
MAX_LEN = 2048
MAX_TOKENS = 48
ENGINE = ["--gdn-prefill-backend", "triton", "--language-model-only", "--gpu-memory-utilization", "0.5",
          "--max-num-seqs", "16"]


def _rel(got, ref):
    return ((got - ref).norm() / ref.norm()).item()


def _near_ties(logits, ids, positions, sid) -> int:
    """Tokens at `positions` that are not HF's greedy choice given all before them (token t was
    sampled from row t - 1); each must be a near tie. Returns how many there were."""
    n = 0
    for t in positions:
        top2 = logits[t - 1].topk(2)
        if ids[t] != int(top2.indices[0]):
            margin = float(top2.values[0] - logits[t - 1][ids[t]])
            assert margin < NEAR_TIE, (sid, t, ids[t], int(top2.indices[0]), margin)
            n += 1
    return n


def test_gpu_generate_rows_and_tokens_match_hf(tmp_path):
    from vllm_hidden.config import ExtractConfig, GenerateConfig
    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.demo import make_qwen35_model
    from vllm_hidden.extract import run_extract

    model = make_qwen35_model(tmp_path / "qwen3_5-4", num_layers=len(LAYERS), vocab_size=VOCAB)
    rng = random.Random(1)
    lengths = [1, 700, 1500] + [int(min(1500, max(2, rng.lognormvariate(5.0, 1.0)))) for _ in range(21)]
    prompts = {f"g{i}": [rng.randrange(VOCAB) for _ in range(n)] for i, n in enumerate(lengths)}
    with open(tmp_path / "in.jsonl", "w") as f:
        for sid, ids in prompts.items():
            f.write(json.dumps({"id": sid, "token_ids": ids}) + "\n")
    out = tmp_path / "out"
    s = run_extract(ExtractConfig(model=str(model), input_path=str(tmp_path / "in.jsonl"), output_dir=str(out),
                                  layers=",".join(map(str, LAYERS)), max_model_len=MAX_LEN,
                                  max_num_batched_tokens=512, dtype="bfloat16", progress=False, engine_args=ENGINE,
                                  final_state="post-norm",
                                  generate=GenerateConfig(max_tokens=MAX_TOKENS, temperature=0.0)))
    assert s.samples == len(prompts) and s.errors == 0
    print(f"generate: {s.to_dict()}")
    gens = {json.loads(x)["id"]: json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()}

    hf = Qwen35Reference(model)
    ds = HiddenStatesDataset(out)
    worst = [0.0] * len(LAYERS)
    worst_response = [0.0] * len(LAYERS)
    worst_final, checked, near_ties = 0.0, 0, 0
    for i in range(len(ds)):
        smp = ds[i]
        ids, p = smp["token_ids"].tolist(), smp["num_prompt_tokens"]
        assert ids[:p] == prompts[smp["id"]] and len(ids) - p == gens[smp["id"]]["num_generated_tokens"] >= 1
        assert gens[smp["id"]]["response_token_ids"] == ids[p:]
        assert smp["loss_mask"].tolist() == [False] * p + [True] * (len(ids) - p)
        r, states = hf.run(ids)
        got = smp["hidden_states"].cuda().float()
        for k, layer in enumerate(LAYERS):
            err = _rel(got[:, k], states[layer + 1])
            worst[k] = max(worst[k], err)
            assert err <= BOUND, (smp["id"], layer, err)
            if len(ids) - p >= 8:  # the response's rows alone, the last (never fed by a normal generation) among them
                err = _rel(got[p:, k], states[layer + 1][p:])
                worst_response[k] = max(worst_response[k], err)
                assert err <= BOUND, (smp["id"], "response rows", layer, err)
        err = _rel(smp["final_hidden_states"].cuda().float(), r.hidden_states[-1][0])
        worst_final = max(worst_final, err)
        assert err <= BOUND, (smp["id"], "final state", err)
        near_ties += _near_ties(r.logits[0], ids, range(p, len(ids)), smp["id"])
        checked += len(ids) - p
        del r
    print(f"generate worst rel L2 per layer {worst} (response rows {worst_response}), final state {worst_final}; "
          f"{checked} generated tokens checked, {near_ties} near-tie differences from HF's greedy choice")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu-generate-parity.json"), "w") as f:
            json.dump({"worst_rel_l2": worst, "response_rows_worst_rel_l2": worst_response, "layers": LAYERS,
                       "final_state_worst_rel_l2": worst_final, "generated_tokens_checked": checked,
                       "near_tie_differences": near_ties, "extract": s.to_dict()}, f)


def test_gpu_regenerate_all_turns_rows_and_tokens_match_hf(tmp_path):
    """Conversations of three user turns, every turn regenerated (--regenerate all) with the
    prefix cache on (uncaptured turns read it: vLLM's align mode on the Gated DeltaNet layers):
    the final conversation's rows against HF over its token ids, every response token HF's
    greedy choice given all before it (the target's own earlier turns among them)."""
    from transformers import AutoTokenizer

    from vllm_hidden.config import ExtractConfig, GenerateConfig
    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.demo import make_qwen35_model
    from vllm_hidden.extract import run_extract

    model = make_qwen35_model(tmp_path / "qwen3_5-4", num_layers=len(LAYERS), vocab_size=VOCAB)
    words = sorted(w for w in AutoTokenizer.from_pretrained(str(model)).get_vocab() if w.isalpha())
    rng = random.Random(2)
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(16):
            msgs = []
            for _ in range(3):
                n = int(min(300, max(2, rng.lognormvariate(4.0, 1.0))))
                msgs += [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(n))},
                         {"role": "assistant", "content": "x"}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    out = tmp_path / "out"
    s = run_extract(ExtractConfig(model=str(model), input_path=str(tmp_path / "in.jsonl"), output_dir=str(out),
                                  layers=",".join(map(str, LAYERS)), max_model_len=MAX_LEN,
                                  # align mode: a step holds at least one (784-token) block
                                  max_num_batched_tokens=1024, dtype="bfloat16", progress=False,
                                  engine_args=[*ENGINE, "--enable-prefix-caching"], final_state="post-norm",
                                  generate=GenerateConfig(max_tokens=MAX_TOKENS, temperature=0.0, regenerate="all")))
    assert s.samples == 16 and s.errors == 0
    gens = {json.loads(x)["id"]: json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()}
    hf = Qwen35Reference(model)
    ds = HiddenStatesDataset(out)
    worst, worst_final, checked, near_ties = [0.0] * len(LAYERS), 0.0, 0, 0
    for i in range(len(ds)):
        smp = ds[i]
        ids, turns = smp["token_ids"].tolist(), gens[smp["id"]]["turns"]
        assert len(turns) == 3 and "stopped" not in gens[smp["id"]]
        mask = smp["loss_mask"].tolist()
        starts = [t for t in range(1, len(ids)) if mask[t] and not mask[t - 1]]
        assert len(starts) == 3 and starts[0] == smp["num_prompt_tokens"]
        r, states = hf.run(ids)
        got = smp["hidden_states"].cuda().float()
        for k, layer in enumerate(LAYERS):
            err = _rel(got[:, k], states[layer + 1])
            worst[k] = max(worst[k], err)
            assert err <= BOUND, (smp["id"], layer, err)
        err = _rel(smp["final_hidden_states"].cuda().float(), r.hidden_states[-1][0])
        worst_final = max(worst_final, err)
        assert err <= BOUND, (smp["id"], "final state", err)
        for t0, turn in zip(starts, turns):
            n = len(turn["token_ids"])
            assert ids[t0 : t0 + n] == turn["token_ids"]
            near_ties += _near_ties(r.logits[0], ids, range(t0, t0 + n), smp["id"])
            checked += n
        del r
    print(f"regenerate all: worst rel L2 per layer {worst}, final state {worst_final}; {checked} generated tokens "
          f"checked, {near_ties} near-tie differences from HF's greedy choice")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu-regenerate-all-parity.json"), "w") as f:
            json.dump({"worst_rel_l2": worst, "layers": LAYERS, "final_state_worst_rel_l2": worst_final,
                       "generated_tokens_checked": checked, "near_tie_differences": near_ties,
                       "extract": s.to_dict()}, f)
