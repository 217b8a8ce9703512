"""Per-layer statistics: made by the shard writer's threads, kept per shard (header, journal,
manifest entry), summed into the manifest's layer_stats across shards and resumes, and
checked by `inspect` (flags, --strict)."""

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from tests.outputs import random_sample, shard_writer, write_manifest, write_output, write_samples
from vllm_hidden.capture.records import Rows
from vllm_hidden.cli import app
from vllm_hidden.format import quant
from vllm_hidden.format.shard import ShardInfo
from vllm_hidden.format.stats import KEYS, ColumnStats, aggregate, flags, header_bytes
from vllm_hidden.storage.files import shard_header
from vllm_hidden.storage.journal import read_journal, write_json_atomic
from vllm_hidden.storage.manifest import Manifest
from vllm_hidden.storage.output import Output
from vllm_hidden.storage.verify import verify_output

IDS = [2, 3, 5]
K, H = len(IDS), 64
IDENTITY = {"format": "vllm-hidden/1", "model": "m", "layer_ids": IDS, "hidden_size": H}


def _samples(n, final=False, first=0):
    return {f"s{i}": random_sample(i, 3 + i % 7, K, H, final=final) for i in range(first, first + n)}


def _columns(samples, final=False):
    """column name -> float64 [N, H] of every row written, in the writer's column order."""
    hs = torch.cat([s[1] for s in samples.values()]).double()
    cols = {str(lid): hs[:, k] for k, lid in enumerate(IDS)}
    if final:
        cols["final"] = torch.cat([s[2] for s in samples.values()]).double()
    return cols


def _assert_matches(stats, cols):
    assert list(stats) == list(cols)
    for name, x in cols.items():
        v = stats[name]
        assert v["rows"] == x.shape[0] and v["zero_rows"] == 0 and v["nonfinite_rows"] == 0, (name, v)
        assert v["mean"] == pytest.approx(float(x.mean()), rel=1e-6, abs=1e-9), name
        assert v["std"] == pytest.approx(float(x.std(correction=0)), rel=1e-6), name
        assert v["absmax"] == float(x.abs().max()), name


def _inspect(path, *args):
    return CliRunner().invoke(app, ["inspect", str(path), *args])


# -- what the writer computes ------------------------------------------------------------------


@pytest.mark.parametrize("final", [False, True])
def test_statistics_are_torchs_own_over_the_rows_written(tmp_path, final):
    samples = _samples(12, final=final)
    shards = write_output(tmp_path, IDS, H, samples, rows=16, writer_threads=2, final_state=final)
    assert len(shards) > 2
    m = Manifest.read(tmp_path)
    _assert_matches(m.layer_stats, _columns(samples, final))
    assert m.layer_stats_shards is None
    # each shard's record: in its header, its journal line and its manifest entry alike
    journal = {s.file: s for s in read_journal(tmp_path)}
    for s in m.shards:
        assert set(s.stats) == {*map(str, IDS), *(["final"] if final else [])}
        assert all(set(v) == set(KEYS) for v in s.stats.values())
        assert shard_header(tmp_path, s).stats == s.stats == journal[s.file].stats
        assert all(v["rows"] == s.num_tokens for v in s.stats.values())


def test_fp8_statistics_are_of_the_dequantized_values(tmp_path):
    samples = _samples(10, final=True)
    for _, hs, _ in samples.values():  # a wide range of magnitudes per row
        hs.mul_(torch.logspace(-3, 3, hs.shape[0])[:, None, None].to(hs.dtype))
        hs[0, 1] = 0  # an all-zero row: scale 0
    shards = write_output(tmp_path, IDS, H, samples, rows=24, writer_threads=2, final_state=True, fp8=True)
    vals = {str(lid): [] for lid in IDS} | {"final": []}
    for s in shards:
        with safe_open(str(tmp_path / s.file), framework="pt") as f:
            n = s.num_tokens
            hs = quant.dequantize(f.get_tensor("hidden_states")[:n], f.get_tensor("hidden_states_scale")[:n],
                                  torch.float64)
            fin = quant.dequantize(f.get_tensor("final_hidden_states")[:n],
                                   f.get_tensor("final_hidden_states_scale")[:n], torch.float64)
        for k, lid in enumerate(IDS):
            vals[str(lid)].append(hs[:, k])
        vals["final"].append(fin)
    stats = Manifest.read(tmp_path).layer_stats
    for name, parts in vals.items():
        x = torch.cat(parts)
        v = stats[name]
        assert v["rows"] == x.shape[0] and v["zero_rows"] == (len(samples) if name == str(IDS[1]) else 0)
        assert v["mean"] == pytest.approx(float(x.mean()), rel=1e-6, abs=1e-12), name
        assert v["std"] == pytest.approx(float(x.std(correction=0)), rel=1e-6), name
        assert v["absmax"] == pytest.approx(float(x.abs().max()), rel=1e-6), name


@pytest.mark.parametrize("fp8", [False, True])
def test_rows_wider_than_the_scratch_are_summed_a_chunk_at_a_time(tmp_path, fp8):
    """A layer row of 4096 values x 3 layers: the float32 scratch holds 42 rows, the sample has 100."""
    tok, hs = random_sample(0, 100, 3, 4096)
    hs[:, 2] += 1000  # a large mean: float32 per-row sums, float64 across rows
    shards = write_output(tmp_path, [0, 1, 2], 4096, {"a": (tok, hs)}, fp8=fp8)
    stats = Manifest.read(tmp_path).layer_stats
    with safe_open(str(tmp_path / shards[0].file), framework="pt") as f:
        x = f.get_tensor("hidden_states")
        x = quant.dequantize(x, f.get_tensor("hidden_states_scale"), torch.float64) if fp8 else x.double()
    for k in range(3):
        assert stats[str(k)]["mean"] == pytest.approx(float(x[:, k].mean()), rel=1e-6, abs=1e-9)
        assert stats[str(k)]["std"] == pytest.approx(float(x[:, k].std(correction=0)), rel=1e-5)


def test_values_written_into_the_slot_get_statistics_too(tmp_path):
    """The caller fills slot.buf itself (no statistics come with the rows): the writer thread
    makes the per-row amax and the statistics."""
    w = shard_writer(tmp_path, IDS, H, writer_threads=2)
    tok, hs = random_sample(0, 9, K, H)
    slot = w.reserve("a", tok)
    slot.buf.copy_(hs)
    w.commit(slot)
    shards = w.close()
    _assert_matches(write_manifest(tmp_path, shards, IDS, H).layer_stats, _columns({"a": (tok, hs)}))


@pytest.mark.parametrize("deferred", [False, True])
def test_a_refused_non_finite_sample_is_counted_not_written(tmp_path, deferred):
    """Its non-finite rows count per layer (from the per-row statistic, before the slot is
    zeroed); its other rows are in no statistic. `deferred`: the rows reach the writer thread
    unplaced (add_rows), which makes the statistics and refuses the sample there."""
    w = shard_writer(tmp_path, IDS, H, writer_threads=2, final_state=True, generate=deferred)
    good = _samples(3, final=True)
    tok, hs, fin = random_sample(9, 6, K, H, final=True)
    hs[1, 0, 3] = float("nan")
    hs[4, 0, 0] = float("inf")
    hs[4, 2, 7] = float("nan")
    fin[5, 1] = float("-inf")

    def add(sid, tok, hs, fin):
        if not deferred:
            w.add(sid, tok, hs, final_hidden_states=fin)
            return
        rows = torch.cat([hs, fin[:, None]], 1)
        row_scale = torch.empty(rows.shape[:2])
        quant.row_amax(rows, row_scale)
        w.add_rows(sid, tok, Rows(rows, row_scale), loss_spans=None, num_prompt=1,
                   record=json.dumps({"id": sid}) + "\n")

    for sid, s in list(good.items())[:2]:
        add(sid, *s)
    add("bad", tok, hs, fin)
    add("s2", *good["s2"])
    shards = w.close()
    assert [x[0] for x in w.not_finite] == ["bad"]
    assert sum(s.num_samples for s in shards) == 3
    m = write_manifest(tmp_path, shards, IDS, H)
    nonfinite = {name: v["nonfinite_rows"] for name, v in m.layer_stats.items()}
    assert nonfinite == {"2": 2, "3": 0, "5": 1, "final": 1}
    cols = _columns(good, final=True)
    for name, x in cols.items():
        assert m.layer_stats[name]["rows"] == x.shape[0]
        assert m.layer_stats[name]["std"] == pytest.approx(float(x.std(correction=0)), rel=1e-6)
    r = verify_output(tmp_path)
    assert r.ok and [(f["layer"], f["flag"]) for f in r.flags] == [("2", "nonfinite"), ("5", "nonfinite"),
                                                                  ("final", "nonfinite")]


def test_statistics_fit_the_header_room_whatever_their_values(tmp_path):
    """A column's record at its longest (the widest ints and floats JSON writes) stays within
    the room the writer reserves for it, escaped as it is inside the header."""
    names = [str(10**9 + i) for i in range(64)] + ["final"]
    acc = ColumnStats(len(names))
    acc.rows = 2**62
    acc.sum.fill_(-2.2250738585072014e-308)
    acc.sumsq.fill_(float("inf"))
    acc.absmax.fill_(-1.7976931348623157e308)
    acc.zero_rows.fill_(-(2**62))
    acc.nonfinite_rows.fill_(-(2**62))
    rec = acc.record(names)
    assert len(json.dumps(json.dumps(rec, separators=(",", ":")))) <= header_bytes(len(names))
    # and a real one: 64 layers, one-token samples in small shards, long ids
    ids = list(range(64))
    samples = {"x" * 150 + str(i): random_sample(i, 1, 64, 4) for i in range(20)}
    shards = write_output(tmp_path, ids, 4, samples, rows=8, writer_threads=2)
    assert verify_output(tmp_path).ok and all(len(s.stats) == 64 for s in shards)


def test_statistics_off(tmp_path, monkeypatch):
    """VHIDDEN_LAYER_STATS=0 (for benchmarks of their cost): shards without them, and an
    output whose statistics say so; any other value is refused."""
    monkeypatch.setenv("VHIDDEN_LAYER_STATS", "0")
    shards = write_output(tmp_path, IDS, H, _samples(4), rows=8, writer_threads=2)
    assert all(s.stats is None for s in shards) and shard_header(tmp_path, shards[0]).stats is None
    assert Manifest.read(tmp_path).layer_stats is None
    res = _inspect(tmp_path, "--strict")
    assert res.exit_code == 0 and "no statistics" in res.output
    monkeypatch.setenv("VHIDDEN_LAYER_STATS", "yes")
    with pytest.raises(ValueError, match="VHIDDEN_LAYER_STATS must be 0 or 1, got 'yes'"):
        shard_writer(tmp_path / "b", IDS, H)


def test_statistics_off_by_the_old_variable_name_warns(tmp_path, monkeypatch, caplog):
    """The variable's name before VHIDDEN_ was the one prefix still works, with a warning naming the new one."""
    from vllm_hidden import envs

    monkeypatch.delenv("VHIDDEN_LAYER_STATS", raising=False)
    monkeypatch.setenv("VLLM_HIDDEN_LAYER_STATS", "0")
    monkeypatch.setattr(envs, "_warned", set())
    with caplog.at_level("WARNING", logger="vllm_hidden"):
        shards = write_output(tmp_path, IDS, H, _samples(2), rows=8, writer_threads=1)
    assert all(s.stats is None for s in shards)
    assert "VLLM_HIDDEN_LAYER_STATS is deprecated" in caplog.text and "set VHIDDEN_LAYER_STATS" in caplog.text


# -- across shards and resumes -------------------------------------------------------------------


def _resumed(root, first, then, bad=None):
    """An output interrupted after `first` (no manifest), resumed with `then`, finished; `bad`:
    a sample with a NaN row that the first attempt refused and the second writes."""
    out = Output(str(root), IDENTITY)
    out.begin(False)
    w = shard_writer(out.shard_config(None, max_shard_bytes=16 * (K * H * 2 + 8), writer_threads=2), IDS, H)
    if bad is not None:
        tok, hs = bad
        hs = hs.clone()
        hs[0, 1, 0] = float("nan")
        w.add("bad", tok, hs)
    write_samples(w, first)
    again = Output(str(root), IDENTITY)
    state = again.begin(True)
    assert state.done_ids == set(first) and all(s.stats is not None for s in state.shards)
    more = {**then, **({"bad": bad} if bad is not None else {})}
    new = write_samples(shard_writer(again.shard_config(None, writer_threads=2), IDS, H), more)
    return again.finish(new, model="m", layer_ids=IDS, layer_semantics="s", num_model_layers=8, hidden_size=H,
                        dtype="bfloat16")


def test_statistics_cover_the_shards_of_every_attempt_of_a_resumed_run(tmp_path):
    first, then = _samples(8), _samples(5, first=8)
    bad = random_sample(99, 4, K, H)
    m = _resumed(tmp_path, first, then, bad)
    assert len(m.shards) > 2 and m.num_samples == 14
    _assert_matches(m.layer_stats, _columns({**first, **then, "bad": bad}))
    # the earlier attempt's shard recorded the refused sample; the resume tried it again and
    # wrote it: nothing is left non-finite
    assert sum(v["nonfinite_rows"] for s in m.shards for v in (s.stats or {}).values()) == 1
    assert verify_output(tmp_path).flags == []


def test_an_interrupted_output_is_inspected_from_the_shards_so_far(tmp_path):
    write_json_atomic(tmp_path / "run.json", IDENTITY)
    samples = _samples(6)
    for s in samples.values():
        s[1][:, 1] = 0
    write_output(tmp_path, IDS, H, samples, rows=8, writer_threads=2, manifest=False)
    r = verify_output(tmp_path)
    assert not r.complete and r.layer_stats["3"]["zero_rows"] == r.layer_stats["3"]["rows"] == r.summary["tokens"]
    assert [(f["layer"], f["flag"]) for f in r.flags] == [("3", "all_zero")]
    res = _inspect(tmp_path, "--json")
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.exit_code == 1 and d["flags"] == r.flags and d["layer_stats"] == r.layer_stats


def test_s3_resume_reads_the_statistics_from_the_shard_headers(s3, tmp_path):
    """Object metadata has no room for them: a resume over S3 takes them from each uploaded
    shard's header, so the manifest still covers every shard."""
    url, bucket, _ = s3
    uri = f"s3://{bucket}/run"
    out = Output(uri, IDENTITY, s3_endpoint_url=url, staging_dir=str(tmp_path / "stage"))
    out.begin(False)
    first, then = _samples(6), _samples(4, first=6)
    write_samples(shard_writer(out.shard_config(None, max_shard_bytes=16 * (K * H * 2 + 8), writer_threads=2),
                               IDS, H), first)
    again = Output(uri, IDENTITY, s3_endpoint_url=url, staging_dir=str(tmp_path / "stage"))
    state = again.begin(True)
    assert len(state.shards) > 1 and all(s.stats is not None for s in state.shards)
    new = write_samples(shard_writer(again.shard_config(None, writer_threads=2), IDS, H), then)
    m = again.finish(new, model="m", layer_ids=IDS, layer_semantics="s", num_model_layers=8, hidden_size=H,
                     dtype="bfloat16")
    assert m.layer_stats_shards is None
    _assert_matches(m.layer_stats, _columns({**first, **then}))
    r = verify_output(uri, s3_endpoint_url=url)
    assert r.ok and r.layer_stats == m.layer_stats


def test_an_output_without_statistics_still_loads_and_says_so(tmp_path):
    shards = write_output(tmp_path, IDS, H, _samples(6), rows=8, writer_threads=2)
    d = json.loads((tmp_path / "manifest.json").read_text())
    del d["layer_stats"], d["layer_stats_shards"]
    for s in d["shards"]:
        del s["stats"]
    m = Manifest.from_dict(d)
    assert m.layer_stats is None and m.shards == shards
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    res = _inspect(tmp_path, "--strict")
    assert res.exit_code == 0 and "no statistics" in res.output and "all shards verified" in res.output
    d2 = json.loads(_inspect(tmp_path, "--json").stdout.strip().splitlines()[-1])
    assert d2["ok"] and d2["layer_stats"] is None and d2["flags"] == []
    # a journal line from before statistics
    line = {k: v for k, v in shards[0].to_dict().items() if k != "stats"}
    assert ShardInfo.from_dict(line) == shards[0] and ShardInfo.from_dict(line).stats is None
    assert ShardInfo(**line).stats is None
    # some shards with, some without: the statistics say how many they cover
    d["shards"][0]["stats"] = shards[0].stats
    m = Manifest.from_dict(d)
    assert m.layer_stats_shards == 1 and m.layer_stats["2"]["rows"] == shards[0].num_tokens


# -- inspect ------------------------------------------------------------------------------------


def test_inspect_flags_a_layer_of_zeros_and_strict_fails_on_it(tmp_path):
    samples = _samples(6)
    for s in samples.values():
        s[1][:, 2] = 0
    write_output(tmp_path / "zeros", IDS, H, samples, rows=8, writer_threads=2)
    res = _inspect(tmp_path / "zeros")
    assert res.exit_code == 0 and "all shards verified" in res.output
    assert "flag: layer 5: all_zero" in res.output and "1 flag(s)" in res.output
    lines = res.stdout.splitlines()
    head = lines.index(next(x for x in lines if x.split()[:2] == ["layer", "rows"]))
    assert [x.split()[0] for x in lines[head + 1 : head + 4]] == ["2", "3", "5"]
    assert _inspect(tmp_path / "zeros", "--strict").exit_code == 1
    d = json.loads(_inspect(tmp_path / "zeros", "--json").stdout.strip().splitlines()[-1])
    assert d["ok"] and d["flags"] == [{"layer": "5", "flag": "all_zero", "detail": d["flags"][0]["detail"]}]
    assert d["layer_stats"]["5"]["std"] == 0 and d["layer_stats"]["5"]["zero_rows"] == d["tokens"]

    write_output(tmp_path / "normal", IDS, H, _samples(6, final=True), rows=8, writer_threads=2, final_state=True)
    res = _inspect(tmp_path / "normal", "--strict")
    assert res.exit_code == 0 and "flag:" not in res.output and "flag(s)" not in res.output
    assert any(x.split()[:1] == ["final"] for x in res.stdout.splitlines())


@pytest.mark.parametrize("fp8", [False, True])
def test_a_constant_layer_is_flagged_with_a_std_of_exactly_zero(tmp_path, fp8):
    samples = _samples(5, final=True)
    for s in samples.values():
        s[1][:, 0] = 0.3
        s[2][:] = -2.5
    write_output(tmp_path, IDS, H, samples, rows=8, writer_threads=2, final_state=True, fp8=fp8)
    stats = Manifest.read(tmp_path).layer_stats
    assert stats["2"]["std"] == 0 and stats["final"]["std"] == 0
    assert [(f["layer"], f["flag"]) for f in verify_output(tmp_path).flags] == [("2", "constant"),
                                                                              ("final", "constant")]


def _stats(**stds):
    return {name: {"rows": 10, "mean": 0.0, "std": std, "absmax": 10 * std, "zero_rows": 0, "nonfinite_rows": 0}
            for name, std in stds.items()}


def test_a_std_jump_is_flagged_against_near_layers_only():
    def jumps(**stds):
        found = flags(_stats(**{k.lstrip("L"): v for k, v in stds.items()}))
        return [f["layer"] for f in found if f["flag"] == "std_jump"]

    # a spike: 20x above both near layers
    assert jumps(L8=1.0, L10=20.0, L12=1.5) == ["10"]
    # and a dip
    assert jumps(L8=1.0, L10=0.05, L12=1.5) == ["10"]
    # 10x off only one near layer: not a jump (the other agrees)
    assert jumps(L8=1.0, L10=12.0, L12=5.0) == []
    # layers further apart than 4 ids are never compared: 100x is what real models do
    assert jumps(L1=1.0, L20=100.0, L40=1000.0) == []
    # a layer with no near layer gets no check; the final state is never compared
    assert jumps(L3=1.0, L30=50.0, final=500.0) == []
    # an all-zero / constant neighbour is not a reference
    stats = _stats(**{"8": 1.0, "10": 1.2, "12": 1.0})
    stats["10"].update(std=0.0, zero_rows=10, absmax=0.0)
    assert [(f["layer"], f["flag"]) for f in flags(stats)] == [("10", "all_zero")]
    assert flags(None) == [] and flags({}) == []


# -- row sums made beside the gather ------------------------------------------------------------


def _through_the_ring(tmp_path, samples, *, final, fp8, generate, monkeypatch):
    """Samples {id: (tok, hs[, fin])} through the real StepTransfer (row sums made in its fill, as
    on the GPU), Assembler and ShardWriter, in steps of 8 rows; the writer may not reduce rows
    itself. Returns the values read back per column (float64, dequantized)."""
    from vllm_hidden.capture.assembler import Assembler
    from vllm_hidden.capture.records import NewRequest, ResponseEnd, Segment, StepRecord
    from vllm_hidden.capture.ring import StepTransfer

    def host_reduction(*a, **kw):
        raise AssertionError("the writer reduced rows that came with their sums")

    monkeypatch.setattr(ColumnStats, "add_rows", host_reduction)
    cols = K + final
    tr = StepTransfer(8, cols, H, torch.bfloat16, torch.device("cpu"), 2, fp8=fp8, row_sums=True)
    w = shard_writer(tmp_path, IDS, H, rows=20, writer_threads=2, final_state=final, fp8=fp8, generate=generate)
    asm = Assembler(tr, w)
    rows = {sid: torch.cat([s[1], s[2][:, None]], 1) if final else s[1] for sid, s in samples.items()}
    queue = [(sid, pos) for sid, r in rows.items() for pos in range(r.shape[0])]
    for first in range(0, len(queue), 8):
        step = queue[first : first + 8]
        new, segs = {}, []
        for i, (sid, pos) in enumerate(step):
            if pos == 0:
                tok = samples[sid][0].tolist()
                new[sid] = (NewRequest(sid, tok[:2], rows=len(tok), line=list(rows).index(sid), generate=True)
                            if generate
                            else NewRequest(sid, tok, line=0))
            segs.append(Segment(sid, i, 1, pos))
        block = torch.stack([rows[sid][pos] for sid, pos in step])
        slot = tr.acquire()
        tr.submit([block[:, c] for c in range(cols)], len(step), slot)
        ends = []
        if generate:  # each sample ends once its last row is in: prompt of 2, the rest its response
            ends = [ResponseEnd(i, 0, rows=rows[sid].shape[0], token_ids=samples[sid][0].tolist(), num_prompt=2,
                                record="{}\n")
                    for i, sid in enumerate(rows) if any(s == sid and p == rows[sid].shape[0] - 1 for s, p in step)]
        asm.process(StepRecord(slot, len(step), segs, new, frozenset()))
        if ends:
            asm.process(StepRecord(None, 0, [], ends=ends))
    shards = w.close()
    vals = {str(lid): [] for lid in IDS} | ({"final": []} if final else {})
    for s in shards:
        with safe_open(str(tmp_path / s.file), framework="pt") as f:
            n = s.num_tokens
            hs, fin = f.get_tensor("hidden_states")[:n], f.get_tensor("final_hidden_states")[:n] if final else None
            if fp8:
                hs = quant.dequantize(hs, f.get_tensor("hidden_states_scale")[:n], torch.float64)
                if final:
                    fin = quant.dequantize(fin, f.get_tensor("final_hidden_states_scale")[:n], torch.float64)
        for k, lid in enumerate(IDS):
            vals[str(lid)].append(hs[:, k].double())
        if final:
            vals["final"].append(fin.double())
    return aggregate([s.stats for s in shards], H)[0], {name: torch.cat(v) for name, v in vals.items()}


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("generate", [False, True])
def test_row_sums_made_beside_the_gather_give_the_statistics_of_the_rows_written(tmp_path, monkeypatch, final,
                                                                                 fp8, generate):
    samples = _samples(9, final=final)
    for _, hs, *_ in samples.values():  # a large mean against the spread: the centring must hold
        hs[:, 2] += 500
    stats, cols = _through_the_ring(tmp_path, samples, final=final, fp8=fp8, generate=generate,
                                    monkeypatch=monkeypatch)
    assert list(stats) == list(cols)
    for name, x in cols.items():
        v = stats[name]
        assert v["rows"] == x.shape[0] == sum(s[0].shape[0] for s in samples.values()), name
        assert v["mean"] == pytest.approx(float(x.mean()), rel=1e-6, abs=1e-9), name
        assert v["std"] == pytest.approx(float(x.std(correction=0)), rel=1e-5), name
        assert v["absmax"] == pytest.approx(float(x.abs().max()), rel=1e-6), name
