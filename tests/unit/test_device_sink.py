"""The colocated sink (`capture.device.DeviceBatches`) on CPU tensors: each step's segments
land at their samples' places in the batch tensors (layers and the final state apart), rows
recomputed after a preemption overwrite the same places, a skipped position is an error, and
a destination that does not fit is refused naming the shapes."""

import pytest
import torch

from vllm_hidden.capture.device import Destination, DeviceBatches
from vllm_hidden.capture.records import CaptureError, NewRequest, Segment

K, H = 2, 4


def _sink(final=True):
    return DeviceBatches(K, final, H, torch.float32, torch.device("cpu"), 0)


def _step(n):
    """A step buffer [n, K + 1, H] whose value at (row, column) is 100 * row + column."""
    v = torch.arange(n, dtype=torch.float32)[:, None, None] * 100 + torch.arange(K + 1)[None, :, None]
    return v.expand(n, K + 1, H).contiguous()


def test_rows_land_at_their_samples_places_over_chunked_steps():
    sink = _sink()
    hidden, final = torch.zeros(10, K, H), torch.zeros(10, H)
    sink.expect("a", Destination(hidden, 0, 6, final))
    sink.expect("b", Destination(hidden, 6, 4, final))
    sink.track({"ra": NewRequest("a", [1] * 6), "rb": NewRequest("b", [1] * 4)})
    sink.place(_step(7), [Segment("ra", 0, 4, 0), Segment("rb", 4, 3, 0)])  # a's first chunk, b's first 3
    sink.place(_step(3), [Segment("ra", 0, 2, 4), Segment("rb", 2, 1, 3)])  # the rest
    assert hidden[:4, 1, 0].tolist() == [1, 101, 201, 301] and hidden[4:6, 0, 0].tolist() == [0, 100]
    assert hidden[6:9, 0, 0].tolist() == [400, 500, 600] and hidden[9, 1, 0].item() == 201
    assert final[:, 0].tolist() == [2, 102, 202, 302, 2, 102, 402, 502, 602, 202]
    assert sink.finish("a") == 6 and sink.finish("b") == 4 and sink.expected == 0
    assert sink.rows == 10 and sink.steps == 2


def test_a_preempted_request_overwrites_its_rows_and_a_gap_is_an_error():
    sink = _sink(final=False)
    hidden = torch.zeros(5, K, H)
    sink.expect("a", Destination(hidden, 0, 5))
    sink.track({"ra": NewRequest("a", [1] * 5)})
    sink.place(_step(3), [Segment("ra", 0, 3, 0)])
    sink.place(_step(5) + 7, [Segment("ra", 0, 5, 0)])  # computed again from 0 after a preemption
    assert hidden[:, 0, 0].tolist() == [7, 107, 207, 307, 407]
    sink.expect("b", Destination(hidden, 0, 5))
    sink.track({"rb": NewRequest("b", [1] * 5)})
    with pytest.raises(CaptureError, match="rows arrive at position 2 but 0 rows were captured"):
        sink.place(_step(2), [Segment("rb", 0, 2, 2)])


def test_a_destination_that_does_not_fit_is_refused():
    sink = _sink(final=False)
    with pytest.raises(CaptureError, match=r"its batch tensor is \(4, 3, 4\), not \[N, 2, 4\]"):
        sink.expect("a", Destination(torch.zeros(4, 3, H), 0, 2))
    with pytest.raises(CaptureError, match=r"rows \[3, 6\) are outside its batch's 4"):
        sink.expect("a", Destination(torch.zeros(4, K, H), 3, 3))
    with pytest.raises(CaptureError, match="a final-state tensor given where the capture has no final state"):
        sink.expect("a", Destination(torch.zeros(4, K, H), 0, 2, torch.zeros(4, H)))
