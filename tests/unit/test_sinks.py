"""The sink contract (`capture.records.Sink`): the shard writer and the server's memory sink
both implement all of it, the shard writer as a context manager, and the assembler reports a
failed request through the sink's failure hook."""

import threading

import blake3
import pytest
import torch

from tests.outputs import random_sample, shard_writer, write_manifest
from tests.unit.test_assembler_open_ended import H, Harness, K, truth
from vllm_hidden.capture.assembler import Assembler
from vllm_hidden.capture.memory import MemorySink
from vllm_hidden.capture.records import CaptureError, NewRequest, Rows, Sink, StepRecord
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.storage import shards as shards_mod
from vllm_hidden.storage.shards import ShardWriter

LAYERS = [3, 5]  # the shard writer's; the ring's are K columns of H


def _writer(tmp_path, **config):
    return shard_writer(tmp_path, LAYERS, H, **config)


def _writer_threads():
    return {t for t in threading.enumerate() if t.name.startswith("vllm-hidden-writer")}


def _in_thread(fn, timeout=60):
    """Runs fn() on a thread of its own: a hang fails the test instead of stalling it. Returns
    what fn raised, or None."""
    raised = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout} s"
    return raised[0] if raised else None


def test_both_sinks_are_sinks(tmp_path):
    mem = MemorySink((len(LAYERS), H), torch.float32, lambda s: None)
    with _writer(tmp_path) as w:
        assert isinstance(w, Sink) and isinstance(w, ShardWriter)
    assert isinstance(mem, Sink)


@pytest.mark.parametrize("missing", ["reserve", "add_rows", "commit", "drop"])
def test_a_sink_missing_a_method_cannot_be_instantiated(missing):
    methods = {name: (lambda self, *a, **kw: None) for name in ("reserve", "add_rows", "commit", "drop")}
    del methods[missing]
    partial = type("Partial", (Sink,), methods)
    with pytest.raises(TypeError, match=missing):
        partial()


def test_the_default_failure_hook_does_not_take_the_report(tmp_path):
    with _writer(tmp_path) as w:
        assert w.on_failure("s", "why") is False
    assert MemorySink((K, H), torch.float32, lambda s: None).on_failure("s", "why") is False
    told = []
    sink = MemorySink((K, H), torch.float32, lambda s: None, lambda *a: told.append(a))
    assert sink.on_failure("s", "why") is True
    assert told == [("s", "why")]


def test_memory_sink_add_rows_delivers_the_rows_given_as_one_sample():
    out = []
    sink = MemorySink((K, H), torch.float32, out.append)
    big = truth(0, 10)  # the sample is a view of a larger buffer, as the assembler's staging is
    rows = big[:6]
    row_scale = rows.abs().amax(-1)
    sink.add_rows("s", [5, 6, 7, 8, 9, 10], Rows(rows, row_scale), loss_spans=[[2, 6]], num_prompt=2, record="r\n",
                  line=4)
    (s,) = out
    assert s.sample_id == "s" and s.finite and s.token_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert s.token_ids.dtype == torch.int64
    assert torch.equal(s.hidden_states, rows) and s.hidden_states.dtype == torch.float32
    assert s.hidden_states.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()  # its own tensor
    bad = row_scale.clone()
    bad[1, 0] = float("nan")
    sink.add_rows("n", [1] * 6, Rows(rows, bad), loss_spans=None, num_prompt=2, record="r\n")
    assert out[1].sample_id == "n" and not out[1].finite


def test_memory_sink_add_rows_refuses_rows_that_do_not_fit():
    sink = MemorySink((K, H), torch.float32, lambda s: None)
    rows = truth(0, 4)
    with pytest.raises(ValueError, match=r"rows of shape \(4, 3, 4\) for 5 tokens"):
        sink.add_rows("s", [1] * 5, Rows(rows, rows.abs().amax(-1)), loss_spans=None, num_prompt=1, record="r\n")
    with pytest.raises(ValueError, match=r"row_scale of shape \(4, 2\)"):
        sink.add_rows("s", [1] * 4, Rows(rows, rows.abs().amax(-1)[:, :2]), loss_spans=None, num_prompt=1,
                      record="r\n")


def test_memory_sink_reserve_takes_rows_by_keyword():
    sink = MemorySink((K, H), torch.float32, lambda s: None)
    assert sink.reserve("s", [1, 2, 3]).buf.shape == (3, K, H)
    assert sink.reserve("s", [1, 2, 3], rows=7).buf.shape == (7, K, H)


def test_shard_writer_reserve_refuses_rows_naming_them(tmp_path):
    with _writer(tmp_path) as w:
        with pytest.raises(ValueError, match="rows=7"):
            w.reserve("s", torch.arange(3), rows=7)


def test_shard_writer_as_a_context_manager_writes_a_readable_shard(tmp_path):
    data = {f"id{i}": random_sample(i, n, len(LAYERS), H) for i, n in enumerate([4, 7])}
    with _writer(tmp_path) as w:
        for sid, (tok, hs) in data.items():
            w.add(sid, tok, hs)
    (info,) = w.shards
    assert info.num_samples == 2 and not list(tmp_path.glob(".*.tmp"))
    write_manifest(tmp_path, w.shards, LAYERS, H)
    ds = HiddenStatesDataset(tmp_path)
    got = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    assert set(got) == set(data)
    for sid, (tok, hs) in data.items():
        assert torch.equal(got[sid]["token_ids"], tok) and torch.equal(got[sid]["hidden_states"], hs)


def test_shard_writer_leaving_a_failed_block_keeps_what_was_complete_and_stops_its_threads(tmp_path):
    before = _writer_threads()
    started = set()
    data = {sid: random_sample(i, 5, len(LAYERS), H) for i, sid in enumerate(["first", "second"])}
    w = _writer(tmp_path, rows=8, writer_threads=2)

    def block():
        with w:
            for sid, (tok, hs) in data.items():  # the second rolls the first shard: a writer thread finishes it
                w.add(sid, tok, hs)
            w.reserve("half", random_sample(2, 3, len(LAYERS), H)[0])  # never completed
            started.update(_writer_threads() - before)
            raise RuntimeError("the run failed")

    e = _in_thread(block)
    assert isinstance(e, RuntimeError) and str(e) == "the run failed"
    assert started and not any(t.is_alive() for t in started)
    # the complete samples are durable, the incomplete one is left out
    assert [(s.num_samples, s.num_tokens) for s in w.shards] == [(1, 5), (1, 5)]
    for info in w.shards:
        assert blake3.blake3((tmp_path / info.file).read_bytes()).hexdigest() == info.blake3
    write_manifest(tmp_path, w.shards, LAYERS, H)
    ds = HiddenStatesDataset(tmp_path)
    got = {ds[i]["id"]: ds[i]["hidden_states"] for i in range(len(ds))}
    assert set(got) == set(data) and all(torch.equal(got[sid], hs) for sid, (_, hs) in data.items())


def test_shard_writer_leaving_a_failed_block_raises_the_blocks_error_not_the_close_failure(tmp_path, monkeypatch):
    def fail(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(shards_mod, "commit_shard", fail)
    before = _writer_threads()
    tok, hs = random_sample(0, 5, len(LAYERS), H)

    def block():
        with _writer(tmp_path) as w:
            w.add("a", tok, hs)
            raise RuntimeError("the run failed")

    e = _in_thread(block)
    assert isinstance(e, RuntimeError) and str(e) == "the run failed"

    def clean():  # no failure in the block: close's is raised
        with _writer(tmp_path / "b") as w:
            w.add("a", tok, hs)

    e = _in_thread(clean)
    assert isinstance(e, OSError) and "disk full" in str(e)
    assert not {t for t in _writer_threads() - before if t.is_alive()}


class _Reporting(MemorySink):
    """Takes every failure report."""

    def __init__(self, out):
        super().__init__((K, H), torch.float32, out.append)
        self.failures = []

    def on_failure(self, sample_id, reason):
        self.failures.append((sample_id, reason))
        return True


def _harness(sink):
    h = Harness()
    h.asm = Assembler(h.tr, sink)
    return h


def test_the_assembler_reports_a_failed_request_through_the_failure_hook():
    out = []
    sink = _Reporting(out)
    h = _harness(sink)
    h.step([("a", 0, 8, 0, 3), ("b", 1, 2, 0, 2)],
           new={"a": NewRequest("sa", list(range(8))), "b": NewRequest("sb", [1, 2])})
    h.step([("a", 0, 8, 5, 3)])  # rows 3 and 4 never came
    h.asm.process(StepRecord(None, 0, [], {"c": NewRequest("sc", [1, 2, 3])}, frozenset()))
    h.finish("c")  # ended before any of its rows
    assert [sid for sid, _ in sink.failures] == ["sa", "sc"]
    assert "position 5" in sink.failures[0][1] and "before its prompt rows" in sink.failures[1][1]
    assert [s.sample_id for s in out] == ["sb"] and h.asm.dropped == [] and h.asm.in_flight == 0
    h.assert_all_slots_free()


def test_a_sink_that_does_not_take_the_report_makes_the_assembler_raise_or_keep_the_id(tmp_path):
    out = []
    h = _harness(MemorySink((K, H), torch.float32, out.append))
    with pytest.raises(CaptureError, match="position 4"):
        h.step([("a", 0, 8, 4, 4)], new={"a": NewRequest("sa", list(range(8)))})
    h.assert_all_slots_free()
    with _writer(tmp_path) as w:  # the shard writer's hook is the default one
        h.asm = asm = Assembler(h.tr, w)
        asm.process(StepRecord(None, 0, [], {"r": NewRequest("sr", [1, 2])}, frozenset()))
        h.finish("r")
        assert asm.dropped == ["r"]


def test_the_assembler_takes_only_a_sink():
    h = Harness()

    class Duck:
        def add_rows(self, *a, **kw):
            pass

    with pytest.raises(TypeError, match="Duck"):
        Assembler(h.tr, Duck())
