"""`check --reference engine` without an engine: the final norm and LM head built alone from
a checkpoint give HF's own logprobs, the engine's prompt logprobs land on the right rows, the
fp8 probe measures e4m3's error, and the engine gets the output's dtype and quantization."""

from __future__ import annotations

import pytest
import torch

from vllm_hidden.check.against_engine import _source, engine_cli_args, fp8_regrid
from vllm_hidden.check.head import Head, engine_pairs
from vllm_hidden.check.reference import FINAL, Reference


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3"])
def test_the_head_alone_gives_hfs_logprobs(tiny_models, arch):
    """Qwen3-Next's norm scales by 1 + w, Qwen3's by w: the head uses the model's own module."""
    from transformers import AutoModelForCausalLM

    model = tiny_models(arch, 4)
    ids = list(range(3, 60, 2))
    ref = Reference(str(model))
    states = ref.run(ids, {3, FINAL})
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    head = Head(str(model))
    rows = torch.arange(len(ids)).repeat_interleave(3)
    cols = torch.tensor([5, 17, 101] * len(ids))
    for x, normed in ((states[3], False), (states[FINAL], True)):
        got = head.logprobs(x, rows, cols, normed=normed)
        assert torch.allclose(got, want[rows, cols], atol=1e-4), (got - want[rows, cols]).abs().max()
    # at the engine's precision the numbers move by bf16 rounding, not more
    low = head.logprobs(states[3], rows, cols, normed=False, dtype=torch.bfloat16)
    assert 0 < (low - want[rows, cols]).abs().mean() < 0.05


def test_engine_logprobs_belong_to_the_row_before():
    rows, cols, vals = engine_pairs([None, {4: -1.0, 9: -2.0}, {7: -0.5}])
    assert rows.tolist() == [0, 0, 1] and cols.tolist() == [4, 9, 7] and vals.tolist() == [-1.0, -2.0, -0.5]


def test_the_fp8_probe_draws_e4m3s_error_afresh():
    x = torch.randn(64, 256)
    once = fp8_regrid(x)
    err = ((once - x).norm() / x.norm()).item()
    assert 0.01 < err < 0.05, err
    again = ((fp8_regrid(once) - once).norm() / once.norm()).item()  # values already on an e4m3 grid move too
    assert 0.5 * err < again < 2 * err, (err, again)


def test_the_engine_gets_the_outputs_dtype_and_online_quantization():
    class M:
        dtype = "bfloat16"
        quantization = {"method": "fp8", "source": "online"}

    assert engine_cli_args(M, []) == ["--dtype", "bfloat16", "--quantization", "fp8"]
    assert engine_cli_args(M, ["--dtype=float16", "-q", "fp8_per_tensor"]) == ["--dtype=float16", "-q",
                                                                                  "fp8_per_tensor"]
    M.quantization = {"method": "fp8", "source": "checkpoint"}  # the checkpoint says it itself
    assert engine_cli_args(M, ["--enforce-eager"]) == ["--enforce-eager", "--dtype", "bfloat16"]


def test_each_sample_must_meet_its_own_bound():
    ok = {"a": {"mean_abs": 0.003, "max_abs": 0.02, "rounding": 0.002, "top1": 1.0},
          "b": {"mean_abs": 0.001, "max_abs": 0.01, "rounding": 0.0001, "top1": 0.5}}
    s = _source("last layer", ok)
    assert s.ok and s.bound == pytest.approx(4 * 0.002) and s.top1_agree == 0.75 and s.max_abs == 0.02
    bad = {**ok, "c": {"mean_abs": 0.5, "max_abs": 3.0, "rounding": 0.002, "top1": 0.0}}
    s = _source("last layer", bad)
    assert not s.ok and s.worst_sample == "c"
    nan = {"d": {"mean_abs": float("nan"), "max_abs": float("nan"), "rounding": 0.002, "top1": 0.0}}
    assert not _source("final state", nan).ok
