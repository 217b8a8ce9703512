import pytest
import torch

from vllm_hidden.capture.assembler import Assembler
from vllm_hidden.capture.memory import MemorySink
from vllm_hidden.capture.records import CaptureError, NewRequest, Segment, StepRecord
from vllm_hidden.capture.ring import StepTransfer

K, H = 3, 4


def truth(sample: int, length: int) -> torch.Tensor:
    # distinct value per (sample, position, layer, feature)
    t = torch.arange(length * K * H, dtype=torch.float32).reshape(length, K, H)
    return t + 1000 * sample


class Harness:
    """Feeds steps through the real StepTransfer + Assembler (CPU path)."""

    def __init__(self, max_tokens=16, slots=2):
        self.tr = StepTransfer(max_tokens, K, H, torch.float32, torch.device("cpu"), slots)
        self.out = []
        self.asm = Assembler(self.tr, MemorySink((K, H), torch.float32, self.out.append))

    def step(self, parts, new=None, finished=()):
        """parts: list of (req_id, sample_index, length, pos, count)."""
        rows = []
        segs = []
        r = 0
        for rid, s, length, pos, count in parts:
            rows.append(truth(s, length)[pos : pos + count])
            segs.append(Segment(rid, r, count, pos))
            r += count
        step = torch.cat(rows)  # [n, K, H]
        layers = [step[:, k].contiguous() for k in range(K)]  # what the model hands us
        slot = self.tr.acquire()
        self.tr.submit(layers, r, slot)
        self.asm.process(StepRecord(slot, r, segs, new or {}, frozenset(finished)))


def test_rows_split_across_steps_and_interleaved():
    h = Harness()
    a, b = NewRequest("a", list(range(10))), NewRequest("b", list(range(7)))
    h.step([("ra", 0, 10, 0, 6), ("rb", 1, 7, 0, 5)], new={"ra": a, "rb": b})
    assert h.out == [] and h.asm.in_flight == 2
    h.step([("rb", 1, 7, 5, 2), ("ra", 0, 10, 6, 4)])
    got = {s.sample_id: s for s in h.out}
    assert set(got) == {"a", "b"}
    assert torch.equal(got["a"].hidden_states, truth(0, 10))
    assert torch.equal(got["b"].hidden_states, truth(1, 7))
    assert got["a"].token_ids.tolist() == list(range(10))
    assert h.asm.in_flight == 0


def test_untracked_requests_are_skipped_and_ring_slots_recycle():
    h = Harness(slots=2)
    for i in range(5):  # more steps than slots: release must happen
        h.step([("x", 9, 4, 0, 4), (f"r{i}", i, 3, 0, 3)], new={f"r{i}": NewRequest(i, [1, 2, 3])})
    assert [s.sample_id for s in h.out] == [0, 1, 2, 3, 4]
    assert torch.equal(h.out[3].hidden_states, truth(3, 3))


def test_preemption_restart_overwrites():
    h = Harness()
    h.step([("r", 0, 8, 0, 5)], new={"r": NewRequest("s", list(range(8)))})
    h.step([("r", 0, 8, 0, 8)])  # recomputed from position 0 after preemption
    assert len(h.out) == 1 and torch.equal(h.out[0].hidden_states, truth(0, 8))


def test_skipped_positions_fail_loudly():
    h = Harness()
    with pytest.raises(CaptureError, match="position 4 but 0 rows"):
        h.step([("r", 0, 8, 4, 4)], new={"r": NewRequest("s", list(range(8)))})


def test_generated_rows_beyond_prompt_are_ignored():
    h = Harness()
    h.step([("r", 0, 6, 0, 4)], new={"r": NewRequest("s", list(range(5)))})
    h.step([("r", 0, 6, 4, 2)])
    assert torch.equal(h.out[0].hidden_states, truth(0, 6)[:5])


def test_aborted_partial_is_dropped():
    h = Harness()
    h.step([("r", 0, 8, 0, 4)], new={"r": NewRequest("s", list(range(8)))})
    h.step([("q", 1, 2, 0, 2)], new={"q": NewRequest("t", [1, 2])}, finished={"r"})
    assert [s.sample_id for s in h.out] == ["t"] and h.asm.dropped == ["r"]


def test_step_larger_than_buffer_is_refused():
    tr = StepTransfer(4, K, H, torch.float32, torch.device("cpu"), 2)
    with pytest.raises(ValueError, match="step has 5 tokens; the capture buffer holds 4"):
        tr.submit([torch.zeros(5, H)] * K, 5, 0)


def test_consumer_error_reaches_the_engine_thread_and_slots_keep_flowing():
    from vllm_hidden.capture.assembler import AssemblerThread

    tr = StepTransfer(8, K, H, torch.float32, torch.device("cpu"), 2)

    def emit(sample):
        raise OSError("disk full")

    th = AssemblerThread(Assembler(tr, MemorySink((K, H), torch.float32, emit)))
    for i in range(4):  # more steps than slots: a failed consumer must still free them
        slot = tr.acquire(timeout=5)
        tr.submit([torch.zeros(2, H)] * K, 2, slot)
        th.put(StepRecord(slot, 2, [Segment(f"r{i}", 0, 2, 0)], {f"r{i}": NewRequest(i, [1, 2])}))
    with pytest.raises(CaptureError, match="disk full"):
        th.close()
