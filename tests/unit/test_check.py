"""`vllm-hidden check`: its metric, bound and verdict on synthetic numbers, the sample choice,
its HF reference against the test suite's own, and whole checks of outputs written from HF's
bfloat16 states (right, with two layers swapped, fp8) -- no engine."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tests.integration.helpers import HFReference
from tests.integration.helpers import rel_l2 as helpers_rel_l2
from tests.outputs import write_output
from vllm_hidden.check import FLOOR, FP8_FACTOR, RATIO, Column, Measure, bound, check_output, choose_samples, verdict
from vllm_hidden.check.compare import fp8_error, rel_l2
from vllm_hidden.check.reference import EMBEDDINGS, FINAL, Reference
from vllm_hidden.cli import app
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.format.shard import FP8_STORAGE

NUM_LAYERS = 4
LAYERS = [0, 2, 3]  # the first (its lower neighbour: the embeddings) and the last (before the final norm)
H = 256


# -- the numbers -------------------------------------------------------------------------------

def test_rel_l2_is_the_test_suites():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(30, H, generator=g)
    got = (ref + 0.01 * torch.randn(30, H, generator=g)).to(torch.bfloat16)
    assert rel_l2(got, ref) == pytest.approx(helpers_rel_l2(got, ref), rel=1e-6)
    assert 0.005 < rel_l2(got, ref) < 0.02
    assert rel_l2(torch.zeros(3, 4), torch.zeros(3, 4)) == 0.0
    assert rel_l2(torch.ones(3, 4), torch.zeros(3, 4)) == math.inf


def test_bound_without_and_with_fp8():
    assert bound(0.005) == pytest.approx(RATIO * 0.005)
    assert bound(1e-7) == pytest.approx(RATIO * FLOOR)  # a float32 output: the floor
    assert bound(0.005, 0.03) == pytest.approx(RATIO * 0.005 + FP8_FACTOR * 0.03)
    assert bound(0.0, 0.03) == pytest.approx(RATIO * FLOOR + FP8_FACTOR * 0.03)


def test_fp8_error_is_the_writers_quantization():
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(1))
    x[3] *= 100  # per-row scales: one large row does not widen the others' error
    e = fp8_error(x)
    assert 0.01 < e < 0.05, e  # e4m3: 3 mantissa bits


def _col(errs, rounding=0.002, neighbours=0.5, fp8=None):
    return Column.of({f"s{i}": Measure(rel_l2=e, neighbours={9: neighbours}, hf_rounding=rounding, fp8_error=fp8)
                      for i, e in enumerate(errs)})


def test_column_worst_mean_and_bound():
    c = _col([0.001, 0.006, 0.002], rounding=0.002)
    assert (c.rel_l2, c.worst_sample) == (0.006, "s1") and c.rel_l2_mean == pytest.approx(0.003)
    assert c.bound == pytest.approx(RATIO * 0.002) and c.ok and c.neighbour_ok
    assert not _col([0.009], rounding=0.002).ok  # 0.009 > 4 * 0.002
    assert _col([0.009], rounding=0.002, fp8=0.03).ok  # fp8 widens it
    assert set(_col([0.001], fp8=0.03).to_dict()) == {"rel_l2", "rel_l2_mean", "worst_sample", "hf_rounding",
                                                      "fp8_error", "bound", "neighbour_ok", "ok"}
    assert "fp8_error" not in _col([0.001]).to_dict()


def test_a_state_closer_to_a_neighbour_fails_within_the_bound():
    m = Measure(rel_l2=0.004, neighbours={1: 0.5, 3: 0.003})
    assert not m.neighbour_ok
    c = Column.of({"a": Measure(rel_l2=0.004, neighbours={1: 0.5}, hf_rounding=0.002), "b": m})
    assert c.rel_l2 <= c.bound and not c.neighbour_ok and not c.ok


def test_verdict_names_the_worst_failing_sample_and_layer():
    cols = {0: _col([0.001, 0.007]), 5: _col([0.02, 0.001]), "final": _col([0.004])}
    v, w = verdict(cols)
    assert v == "fail" and (w.sample, w.layer, w.rel_l2) == ("s0", 5, 0.02) and w.bound == pytest.approx(0.008)
    # a neighbour failure ranks before a larger error that is within its bound
    cols = {0: _col([0.0079]), 1: _col([0.001], neighbours=0.0005)}
    assert verdict(cols)[0] == "fail" and verdict(cols)[1].layer == 1
    v, w = verdict({0: _col([0.001]), 1: _col([0.004])})
    assert v == "pass" and w.layer == 1  # closest to its bound
    nan = {0: _col([float("nan"), 0.001])}
    assert verdict(nan)[0] == "fail" and nan[0].to_dict()["rel_l2"] is None  # strict JSON: no NaN


def test_samples_spread_over_the_shards(tmp_path):
    g = torch.Generator().manual_seed(0)
    samples = {f"s{i}": (torch.randint(0, 100, (10,), generator=g), torch.randn(10, 1, 8, generator=g)
                         .to(torch.bfloat16)) for i in range(20)}
    write_output(tmp_path, [0], 8, samples, rows=50)  # 5 samples per shard
    ds = HiddenStatesDataset(tmp_path)
    assert ds.num_shards == 4
    for seed in range(5):
        chosen = choose_samples(len(ds), 4, seed)
        assert sorted({ds.locate(i)[0] for i in chosen}) == [0, 1, 2, 3], (seed, chosen)
    assert choose_samples(20, 4, 3) == choose_samples(20, 4, 3)
    assert len({tuple(choose_samples(20, 4, s)) for s in range(5)}) > 1
    assert choose_samples(20, 7, 0) == sorted(set(choose_samples(20, 7, 0)))
    assert choose_samples(3, 8) == [0, 1, 2]
    with pytest.raises(ValueError, match="got 0"):
        choose_samples(20, 0)


# -- against HF --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen3", NUM_LAYERS)


@pytest.fixture(scope="module")
def hf(model):
    return HFReference(model)


def test_reference_states_are_the_test_suites(model, hf):
    ids = list(range(10, 60))
    want = hf.states(ids)
    ref = Reference(str(model))
    got = ref.run(ids, {EMBEDDINGS, *range(NUM_LAYERS), FINAL})
    # two float32 forwards of one model on the CPU: equal but for the last bits (a oneDNN/MKL kernel
    # can reduce in another order between calls), far closer than one layer is to the next
    for i in range(NUM_LAYERS):
        torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5, msg=f"layer {i}")
        if i:
            assert not torch.allclose(got[i], want[i - 1], rtol=1e-2, atol=1e-2), i
    torch.testing.assert_close(got[FINAL], hf.post_norm, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[NUM_LAYERS - 1], got[FINAL])  # the last layer is before the norm
    assert torch.equal(got[EMBEDDINGS], hf.model.model.embed_tokens(torch.tensor(ids)))
    assert set(ref.run(ids, {1})) == {1}  # only what is asked for is kept


def _write(root, bf16, *, swap=False, fp8=False, n=6):
    """An output of n samples of `bf16`'s states (an engine's stand-in), 2 per shard; `swap`:
    layers 2 and 3 stored under each other's ids."""
    g = torch.Generator().manual_seed(0)
    samples = {}
    for k in range(n):
        ids = torch.randint(10, 1000, (20 + 7 * k,), generator=g)
        st = bf16.states(ids.tolist())
        order = [0, 3, 2] if swap else LAYERS
        hs = torch.stack([st[i] for i in order], 1).to(torch.bfloat16)
        samples[f"s{k}"] = (ids, hs, bf16.post_norm.to(torch.bfloat16))
    rows = 2 * (20 + 7 * n)
    fields = {"final_state": "post-norm", "num_model_layers": NUM_LAYERS, **({"storage": FP8_STORAGE} if fp8 else {})}
    write_output(root, LAYERS, H, samples, rows=rows, final_state=True, fp8=fp8, manifest=fields)
    return root


@pytest.fixture(scope="module")
def outputs(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    bf16 = HFReference(model)
    bf16.model.to(torch.bfloat16)
    return {name: _write(root / name, bf16, **kw) for name, kw in
            (("good", {}), ("swapped", {"swap": True}), ("fp8", {"fp8": True}))}


def test_an_output_of_the_models_states_passes(model, outputs):
    r = check_output(str(outputs["good"]), str(model), samples=4)
    assert r.verdict == "pass" and len(r.samples) == 4 and r.seconds_per_sample > 0, r.table()
    assert list(r.layers) == LAYERS and r.final_state is not None
    for c in [*r.layers.values(), r.final_state]:
        # the stand-in engine is HF in bf16: its error is HF's rounding error
        assert c.rel_l2 == pytest.approx(c.hf_rounding, rel=1e-3) and 1e-4 < c.rel_l2 < 0.05 and c.fp8_error is None


def test_swapped_layers_fail_naming_them(model, outputs):
    r = check_output(str(outputs["swapped"]), str(model), samples=2, seed=1)
    assert r.verdict == "fail" and r.worst.layer in (2, 3) and r.worst.sample in r.samples
    assert not r.layers[2].neighbour_ok and not r.layers[3].neighbour_ok and r.layers[0].ok and r.final_state.ok
    assert f"layer {r.worst.layer}" in r.message() and repr(r.worst.sample) in r.message()


def test_fp8_storage_passes_within_the_widened_bound(model, outputs):
    r = check_output(str(outputs["fp8"]), str(model), samples=2)
    assert r.verdict == "pass", r.table()
    for c in [*r.layers.values(), r.final_state]:
        assert 0.01 < c.fp8_error < 0.05 and c.rel_l2 > RATIO * max(c.hf_rounding, FLOOR)  # fp8 needs the term
    assert "fp8_error" in r.to_dict()["layers"]["0"]


def test_cli(model, outputs, tmp_path):
    run = CliRunner().invoke
    r = run(app, ["check", str(outputs["good"]), "--model", str(model), "--samples", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(d) == {"path", "model", "device", "dtype", "samples", "bound", "layers", "final_state", "verdict",
                      "worst", "seconds_per_sample", "gdn_kernels"}
    assert d["gdn_kernels"] is None  # Qwen3 has no Gated-DeltaNet layer
    assert d["verdict"] == "pass" and list(d["layers"]) == ["0", "2", "3"] and len(d["samples"]) == 2
    assert d["bound"] == {"ratio": RATIO, "floor": FLOOR, "fp8_factor": FP8_FACTOR}
    assert set(d["worst"]) == {"sample", "layer", "rel_l2", "bound"}
    r = run(app, ["check", str(outputs["swapped"]), "--model", str(model), "--samples", "1"])
    assert r.exit_code == 1 and "fail" in r.stdout and "layer " in r.stdout.splitlines()[-1], r.output
    for args, part in ((["--samples", "0"], "got 0"), (["--device", "tpu"], "got 'tpu'")):
        r = run(app, ["check", str(outputs["good"]), "--model", str(model), *args])
        assert r.exit_code == 2 and part in r.stderr, r.output
    r = run(app, ["check", str(tmp_path), "--model", str(model)])
    assert r.exit_code == 2 and "not an extract output" in r.stderr and str(tmp_path) in r.stderr, r.output
    if not torch.cuda.is_available():
        r = run(app, ["check", str(outputs["good"]), "--model", str(model), "--device", "cuda"])
        assert r.exit_code == 2 and "no CUDA device" in r.stderr, r.output


def test_an_output_on_s3(model, outputs, s3):
    url, bucket, client = s3
    for f in outputs["good"].iterdir():
        client.upload_file(str(f), bucket, f"run/{f.name}")
    r = check_output(f"s3://{bucket}/run", str(model), samples=2, seed=3, s3_endpoint_url=url)
    local = check_output(str(outputs["good"]), str(model), samples=2, seed=3)
    assert r.verdict == "pass" and r.samples == local.samples
    assert {k: c.rel_l2 for k, c in r.layers.items()} == {k: c.rel_l2 for k, c in local.layers.items()}
