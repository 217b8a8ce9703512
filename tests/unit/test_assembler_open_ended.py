"""Open-ended ("until finished") capture in the assembler: the server's prompt + generated
rows, complete when the request finishes. Real StepTransfer on CPU, as in test_assembler.py."""

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

    def __init__(self, max_tokens=16, slots=2, on_failure=None):
        self.tr = StepTransfer(max_tokens, K, H, torch.float32, torch.device("cpu"), slots)
        self.out = []
        sink = MemorySink((K, H), torch.float32, self.out.append, on_failure=on_failure)
        self.asm = Assembler(self.tr, sink)

    def step(self, parts, new=None, finished=()):
        """parts: list of (req_id, sample_index, length, pos, count)."""
        rows, segs, r = [], [], 0
        for rid, s, length, pos, count in parts:
            rows.append(truth(s, length)[pos : pos + count])
            segs.append(Segment(rid, r, count, pos))
            r += count
        step = torch.cat(rows)
        layers = [step[:, k].contiguous() for k in range(K)]
        slot = self.tr.acquire(timeout=5)  # a leaked slot fails here instead of hanging
        self.tr.submit(layers, r, slot)
        self.asm.process(StepRecord(slot, r, segs, new or {}, frozenset(finished)))

    def finish(self, *req_ids):
        """A finish-only record: no rows this step."""
        self.asm.process(StepRecord(None, 0, [], {}, frozenset(req_ids)))

    def assert_all_slots_free(self):
        got = [self.tr.acquire(timeout=1) for _ in range(self.tr.slots)]
        assert sorted(got) == list(range(self.tr.slots))
        for s in got:
            self.tr.release(s)


def test_open_ended_is_emitted_on_finish_with_the_rows_so_far():
    h = Harness(slots=2)
    prompt = [11, 12, 13, 14, 15]
    h.step([("r", 0, 20, 0, 3)], new={"r": NewRequest("s", prompt, rows=12)})
    h.step([("r", 0, 20, 3, 2)])  # prompt complete: 5 rows
    assert h.out == [] and h.asm.in_flight == 1
    for pos in range(5, 9):  # decode steps, one row each; more steps than ring slots
        h.step([("r", 0, 20, pos, 1)])
        assert h.out == []
    h.finish("r")
    assert len(h.out) == 1
    s = h.out[0]
    assert s.sample_id == "s"
    assert s.hidden_states.shape == (9, K, H)
    assert torch.equal(s.hidden_states, truth(0, 20)[:9])
    assert s.token_ids.tolist() == prompt
    assert h.asm.in_flight == 0 and h.asm.dropped == []
    h.assert_all_slots_free()


def test_open_ended_alongside_other_requests_and_many_steps():
    h = Harness(slots=2)
    h.step([("o", 0, 30, 0, 4), ("f", 1, 6, 0, 2)],
           new={"o": NewRequest("open", [1, 2, 3, 4], rows=30), "f": NewRequest("fixed", list(range(6)))})
    assert h.out == []
    h.step([("f", 1, 6, 2, 4), ("o", 0, 30, 4, 1)])
    assert [s.sample_id for s in h.out] == ["fixed"]  # fixed-length completes at its last row
    for pos in range(5, 15):
        h.step([("o", 0, 30, pos, 1), ("x", 9, 30, pos, 1)])  # "x": not captured
    assert [s.sample_id for s in h.out] == ["fixed"]
    h.finish("o")
    assert [s.sample_id for s in h.out] == ["fixed", "open"]
    assert torch.equal(h.out[0].hidden_states, truth(1, 6))
    assert torch.equal(h.out[1].hidden_states, truth(0, 30)[:15])
    h.assert_all_slots_free()


def test_finish_in_a_record_with_rows_for_other_requests():
    h = Harness()
    h.step([("o", 0, 10, 0, 3)], new={"o": NewRequest("open", [1, 2, 3], rows=10)})
    h.step([("o", 0, 10, 3, 1)])
    h.step([("q", 2, 2, 0, 2)], new={"q": NewRequest("q", [5, 6])}, finished={"o"})
    assert sorted(s.sample_id for s in h.out) == ["open", "q"]
    got = {s.sample_id: s for s in h.out}
    assert torch.equal(got["open"].hidden_states, truth(0, 10)[:4])
    assert torch.equal(got["q"].hidden_states, truth(2, 2))


def test_rows_beyond_the_limit_are_ignored():
    h = Harness()
    h.step([("r", 0, 10, 0, 3)], new={"r": NewRequest("s", [1, 2, 3], rows=4)})
    h.step([("r", 0, 10, 3, 1)])  # now full
    h.step([("r", 0, 10, 4, 1)])  # beyond: ignored, no error
    h.step([("r", 0, 10, 5, 1)])
    assert h.out == []
    h.finish("r")
    assert len(h.out) == 1
    assert h.out[0].hidden_states.shape == (4, K, H)
    assert torch.equal(h.out[0].hidden_states, truth(0, 10)[:4])
    h.assert_all_slots_free()


def test_a_segment_straddling_the_limit_keeps_only_the_rows_asked_for():
    h = Harness()
    h.step([("r", 0, 10, 0, 2)], new={"r": NewRequest("s", [1, 2], rows=5)})
    h.step([("r", 0, 10, 2, 6)])  # rows 2..7; only 2..4 fit
    h.finish("r")
    assert h.out[0].hidden_states.shape == (5, K, H)
    assert torch.equal(h.out[0].hidden_states, truth(0, 10)[:5])


def test_limit_reached_within_the_prompt_step():
    h = Harness()
    h.step([("r", 0, 10, 0, 8)], new={"r": NewRequest("s", list(range(8)), rows=3)})
    assert h.out == []  # still open-ended: emitted only on finish
    h.finish("r")
    assert torch.equal(h.out[0].hidden_states, truth(0, 10)[:3])


def test_recomputation_from_position_zero_overwrites():
    h = Harness()
    h.step([("r", 0, 10, 0, 4)], new={"r": NewRequest("s", [1, 2, 3, 4], rows=10)})
    h.step([("r", 0, 10, 4, 1)])
    h.step([("r", 0, 10, 5, 1)])  # 6 rows of sample 0's values
    # preempted, then recomputed from position 0 (prompt + generated) with other values
    h.step([("r", 7, 10, 0, 6)])
    h.step([("r", 7, 10, 6, 1)])
    h.finish("r")
    assert len(h.out) == 1
    assert torch.equal(h.out[0].hidden_states, truth(7, 10)[:7])


def test_recomputation_shorter_than_before_is_not_padded_with_stale_rows():
    h = Harness()
    h.step([("r", 0, 10, 0, 6)], new={"r": NewRequest("s", [1, 2, 3, 4], rows=10)})
    h.step([("r", 7, 10, 0, 3)])  # recomputation from 0 arrives in chunks; finished after the first
    h.finish("r")
    assert torch.equal(h.out[0].hidden_states, truth(7, 10)[:3])


def test_open_ended_finished_before_any_rows_is_dropped():
    h = Harness()
    h.step([("q", 1, 2, 0, 2)], new={"r": NewRequest("s", [1, 2], rows=8), "q": NewRequest("q", [1, 2])})
    h.finish("r")
    assert [s.sample_id for s in h.out] == ["q"]
    assert h.asm.dropped == ["r"] and h.asm.in_flight == 0


def test_skipped_position_reported_to_on_failure_and_others_go_on():
    failures = []
    h = Harness(on_failure=lambda sid, msg: failures.append((sid, msg)))
    h.step(
        [("a", 0, 8, 4, 4), ("b", 1, 3, 0, 3), ("c", 2, 6, 0, 2)],
        new={"a": NewRequest("sa", list(range(8))), "b": NewRequest("sb", [1, 2, 3]),
             "c": NewRequest("sc", list(range(6)))},
    )
    assert len(failures) == 1
    sid, msg = failures[0]
    assert sid == "sa" and "position 4" in msg
    assert [s.sample_id for s in h.out] == ["sb"]  # same step, after the failing segment
    assert h.asm.dropped == []  # reported through on_failure instead: a server keeps no list
    h.step([("c", 2, 6, 2, 4), ("a", 0, 8, 0, 4)])  # later step; rows for "a" are no longer tracked
    assert [s.sample_id for s in h.out] == ["sb", "sc"]
    assert torch.equal(h.out[1].hidden_states, truth(2, 6))
    assert len(failures) == 1
    h.assert_all_slots_free()


def test_skipped_position_of_an_open_ended_request_reported_to_on_failure():
    failures = []
    h = Harness(on_failure=lambda sid, msg: failures.append((sid, msg)))
    h.step([("o", 0, 20, 0, 3), ("f", 1, 2, 0, 2)],
           new={"o": NewRequest("open", [1, 2, 3], rows=20), "f": NewRequest("fixed", [1, 2])})
    h.step([("o", 0, 20, 5, 1)])  # rows 3 and 4 never came
    assert failures and failures[0][0] == "open" and "position 5" in failures[0][1]
    h.finish("o")  # already gone: not emitted
    assert [s.sample_id for s in h.out] == ["fixed"]
    h.assert_all_slots_free()


def test_skipped_position_without_on_failure_raises_and_frees_the_slot():
    h = Harness()
    with pytest.raises(CaptureError, match="position 4"):
        h.step(
            [("b", 1, 3, 0, 3), ("a", 0, 8, 4, 4)],
            new={"a": NewRequest("sa", list(range(8))), "b": NewRequest("sb", [1, 2, 3])},
        )
    h.assert_all_slots_free()


def test_fixed_length_aborted_before_completion_is_dropped():
    h = Harness()
    h.step([("r", 0, 8, 0, 4)], new={"r": NewRequest("s", list(range(8)))})
    h.finish("r")
    assert h.out == []
    assert h.asm.dropped == ["r"] and h.asm.in_flight == 0
    h.step([("r", 0, 8, 4, 4)])  # late rows of the aborted request: ignored
    assert h.out == []
    h.assert_all_slots_free()


def test_fixed_length_finished_before_any_rows_is_dropped():
    h = Harness()
    h.asm.process(StepRecord(None, 0, [], {"r": NewRequest("s", [1, 2])}, frozenset()))
    assert h.asm.in_flight == 1
    h.finish("r")
    assert h.out == [] and h.asm.dropped == ["r"] and h.asm.in_flight == 0


def test_finishing_an_unknown_request_is_a_no_op():
    h = Harness()
    h.finish("nobody")
    assert h.out == [] and h.asm.dropped == []


def test_step_transfer_copies_only_the_requested_span():
    tr = StepTransfer(8, K, H, torch.float32, torch.device("cpu"), 2)
    step = truth(0, 8)  # [8, K, H]
    layers = [step[:, k].contiguous() for k in range(K)]
    slot = tr.acquire(timeout=5)
    tr.host[slot].fill_(-1)
    tr.submit(layers, 3, slot, start=2)  # rows 2..4 only
    host = tr.wait(slot)
    assert torch.equal(host[:3], step[2:5])
    assert bool((host[3:] == -1).all())  # nothing beyond the span was written
    tr.release(slot)


def test_aborted_mid_prompt_is_reported_to_on_failure_at_once():
    failures = []
    h = Harness(on_failure=lambda sid, msg: failures.append((sid, msg)))
    h.step([("r", 0, 10, 0, 4)], new={"r": NewRequest("s", list(range(10)))})
    h.asm.process(StepRecord(None, 0, [], {"q": NewRequest("never", [1, 2])}, frozenset()))
    h.finish("r", "q")  # aborted mid-prefill, and before its first row
    assert h.out == []
    assert sorted(sid for sid, _ in failures) == ["never", "s"]
    assert all("before its prompt rows" in msg for _, msg in failures)
    assert h.asm.dropped == [] and h.asm.in_flight == 0
