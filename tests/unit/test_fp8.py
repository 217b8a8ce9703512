"""fp8 storage and the per-row statistic: e4m3 values with one float32 scale per (token,
layer), computed in the step transfer (the GPU path, run here on CPU), stored by the shard
writer, read back dequantized; and the finiteness check taken from the statistic."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.outputs import shard_writer, write_output
from vllm_hidden.capture.records import Rows
from vllm_hidden.capture.ring import StepTransfer
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.format.quant import FP8, dequantize, quantize


def _states(n: int, k: int, h: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, h, generator=g) * torch.logspace(-2, 2, n)[:, None, None]  # scales over 4 decades
    x[0, 0, 3] = 500.0  # an outlier dominating its row's scale
    x[1, -1] = 0.0  # an all-zero row
    return x.to(torch.bfloat16)


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.empty(x.shape, dtype=FP8)
    scale = torch.empty(x.shape[:2])
    quantize(x, values, scale, torch.empty(x.shape[:2]))
    return values, scale


def test_round_trip_error_is_within_e4m3_rounding_of_each_value():
    x = _states(64, 3, 256)
    values, scale = _quantized(x)
    xf = x.float()
    amax = xf.abs().amax(-1)  # independent of the code under test
    assert torch.equal(scale, amax / 448)
    assert scale[1, -1] == 0 and torch.all(values[1, -1].float() == 0)
    back = dequantize(values, scale)
    assert back.dtype == torch.bfloat16 and back.shape == x.shape
    # e4m3: 3 mantissa bits, half an ulp = 2^-4 relative for normals; subnormal spacing 2^-9 x scale;
    # then bf16's own rounding of the result (2^-9 relative)
    bound = torch.maximum(xf.abs() * 2**-4, scale[..., None] * 2**-10) * (1 + 2**-8) + xf.abs() * 2**-8
    assert torch.all((back.float() - xf).abs() <= bound + 1e-30)
    rel = ((back.float() - xf).norm() / xf.norm()).item()
    assert rel < 0.03, rel
    assert values.view(torch.uint8).ne(0x7F).all()  # no NaN codes from finite input


def test_non_finite_rows_get_a_non_finite_scale():
    x = _states(4, 2, 64)
    x[2, 0, 5] = float("nan")
    x[3, 1, 0] = float("inf")
    _, scale = _quantized(x)
    bad = ~torch.isfinite(scale)
    assert bad.nonzero().tolist() == [[2, 0], [3, 1]]


@pytest.mark.parametrize("fp8", [False, True])
def test_step_transfer_packs_values_and_their_statistic_in_one_row(fp8):
    n, k, h = 10, 3, 64
    x = _states(n, k, h, seed=1)
    layers = [x[:, i].clone() for i in range(k)]
    tr = StepTransfer(16, k, h, torch.bfloat16, torch.device("cpu"), 2, fp8=fp8)
    assert tr.bytes_per_row == k * h * (1 if fp8 else 2) + 4 * k
    slot = tr.acquire()
    tr.submit(layers, n - 2, slot, start=2)
    values, row_scale = tr.wait(slot)[: n - 2], tr.host_row_scale[slot][: n - 2]
    want = x[2:]
    if fp8:
        ref_values, ref_scale = _quantized(want)
        assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8)) and torch.equal(row_scale, ref_scale)
    else:
        assert torch.equal(values, want) and torch.equal(row_scale, want.float().abs().amax(-1))


def _write(tmp_path, fp8: bool, samples, final: bool = False):
    out = tmp_path / ("fp8" if fp8 else "bf16")
    shards = write_output(out, [4, 9, 2], 256, {sid: (tok, hs, fin if final else None)
                                                for sid, (tok, hs, fin) in samples.items()},
                          fp8=fp8, final_state=final, writer_threads=2, max_shard_bytes=1 << 20,
                          manifest={"layer_semantics": "", "num_model_layers": 10,
                                    "final_state": "post-norm" if final else "none"})
    return out, shards


def test_fp8_shards_hold_values_and_scales_and_read_back_as_bf16(tmp_path):
    samples = {f"s{i}": (torch.arange(5 + 7 * i), _states(5 + 7 * i, 3, 256, seed=i),
                         _states(5 + 7 * i, 1, 256, seed=100 + i)[:, 0]) for i in range(12)}
    out8, shards8 = _write(tmp_path, True, samples, final=True)
    out16, shards16 = _write(tmp_path, False, samples, final=True)
    with safe_open(str(out8 / shards8[0].file), framework="pt") as f:
        assert f.get_slice("hidden_states").get_dtype() == "F8_E4M3"
        rows = f.get_slice("hidden_states").get_shape()[0]
        assert f.get_slice("hidden_states_scale").get_shape() == [rows, 3]
        assert f.get_slice("final_hidden_states_scale").get_shape() == [rows]
    def data_bytes(out, shards):  # the tensors, without the header (its room is padding, sized per row)
        return sum(s.bytes - 8 - int.from_bytes((out / s.file).read_bytes()[:8], "little") for s in shards)

    ratio = data_bytes(out8, shards8) / data_bytes(out16, shards16)
    assert ratio <= 0.53, ratio  # H=256: 4 scale bytes per 256 values, plus the token ids
    ds, raw = HiddenStatesDataset(out8), HiddenStatesDataset(out8, dequantize=False)
    assert len(ds) == len(samples)
    for i in range(len(ds)):
        s, r = ds[i], raw[i]
        tok, hs, fin = samples[s["id"]]
        assert torch.equal(s["token_ids"], tok)
        assert s["hidden_states"].dtype == torch.bfloat16 and "hidden_states_scale" not in s
        for got, want in ((s["hidden_states"], hs), (s["final_hidden_states"], fin)):
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 0.03
        assert r["hidden_states"].dtype == FP8 and r["hidden_states_scale"].shape == hs.shape[:2]
        assert torch.equal(r["hidden_states_scale"], hs.float().abs().amax(-1) / 448)
        assert torch.equal(dequantize(r["hidden_states"], r["hidden_states_scale"]), s["hidden_states"])


@pytest.mark.parametrize("fp8", [False, True])
def test_a_non_finite_row_refuses_its_sample_from_the_statistic(tmp_path, fp8):
    k, h = 2, 64
    tr = StepTransfer(8, k, h, torch.bfloat16, torch.device("cpu"), 2, fp8=fp8)
    w = shard_writer(tmp_path, [0, 5], h, dtype=tr.values_dtype, fp8=fp8)
    for sid, poison in (("clean", False), ("bad", True)):
        x = _states(6, k, h)
        if poison:
            x[4, 1, 7] = float("nan")
        slot = tr.acquire()
        tr.submit([x[:, 0], x[:, 1]], 6, slot)
        s = w.reserve(sid, torch.arange(6), line=3 if poison else 1)
        s.place(0, Rows(tr.wait(slot)[:6], tr.host_row_scale[slot][:6]))
        w.commit(s)
        tr.release(slot)
    (info,) = w.close()
    ((sid, line, why),) = w.not_finite
    assert (sid, line) == ("bad", 3) and "NaN" in why and "layer ids [5]" in why and "first at token 4" in why, why
    with safe_open(str(tmp_path / info.file), framework="pt") as f:
        assert [e[0] for e in json.loads(f.metadata()["samples"])] == ["clean"]


def test_fp8_output_refuses_values_without_scales(tmp_path):
    w = shard_writer(tmp_path, [0], 8, dtype=FP8, fp8=True)
    s = w.reserve("x", torch.arange(2))
    with pytest.raises(ValueError, match="scales"):
        w.commit(s)
    with pytest.raises(ValueError, match="fp8=True"):
        shard_writer(tmp_path / "b", [0], 8, dtype=torch.bfloat16, fp8=True)
    w.close()
