"""Colocated capture: the trainer's own process runs the engine (`vllm_hidden.colocate`), and
each step's captured rows go from the step buffer straight into the tensors of the batch the
trainer will get, on the same device: no host ring, no assembler thread, no disk.

The driver allocates a batch's tensors and says where each of its samples goes (`expect`)
before it adds the requests; the worker's step hook places every captured segment with one
device copy per tensor (`place`, stream-ordered after the forward that made the rows); the
driver takes each sample back when the engine finishes its request (`finish`). Everything
here runs on the thread that steps the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_hidden.capture.records import CaptureError, NewRequest, Segment


@dataclass(slots=True)
class Destination:
    """Where one sample's rows go: rows [offset, offset + rows) of `hidden` [N, K, H] (and of
    `final` [N, H], the model's final normed state, where the batch has it)."""

    hidden: torch.Tensor
    offset: int
    rows: int
    final: torch.Tensor | None = None
    filled: int = 0  # rows [0, filled) placed
    req_id: str | None = field(default=None)  # the engine's id, once its first rows came


class DeviceBatches:
    """The worker's sink when the trainer runs the engine in its own process: `num_layers`
    captured layers of `hidden_size` in `dtype` on `device`, and the final state where asked
    (the step buffer's last column)."""

    def __init__(self, num_layers: int, final_state: bool, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, capture_bytes: int) -> None:
        self.num_layers = num_layers
        self.final_state = final_state
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.capture_bytes = capture_bytes  # the device step buffer (allocated at model load)
        # recorded after each step's copies, on the stream they ran on: the driver's stream
        # waits on it before a batch is handed over (a device-side wait, not a host sync)
        self.placed_event = torch.cuda.Event() if device.type == "cuda" else None
        self._by_sample: dict[Any, Destination] = {}
        self._by_req: dict[str, Destination] = {}
        self.steps = 0  # steps that placed rows
        self.rows = 0  # rows placed (a recomputed row after a preemption counts again)
        self.copies = 0  # device copies made (per segment and tensor)

    def expect(self, sample_id: Any, dest: Destination) -> None:
        if sample_id in self._by_sample:
            raise CaptureError(f"sample {sample_id!r} is expected already")
        shape = (self.num_layers, self.hidden_size)
        if dest.hidden.dim() != 3 or tuple(dest.hidden.shape[1:]) != shape:
            raise CaptureError(f"sample {sample_id!r}: its batch tensor is {tuple(dest.hidden.shape)}, not [N, "
                               f"{shape[0]}, {shape[1]}]")
        if (dest.final is not None) != self.final_state:
            given = "given" if dest.final is not None else "missing"
            raise CaptureError(f"sample {sample_id!r}: a final-state tensor {given} where the capture "
                               f"{'has' if self.final_state else 'has no'} final state")
        if dest.offset < 0 or dest.offset + dest.rows > dest.hidden.shape[0]:
            raise CaptureError(f"sample {sample_id!r}: rows [{dest.offset}, {dest.offset + dest.rows}) are outside "
                               f"its batch's {dest.hidden.shape[0]}")
        self._by_sample[sample_id] = dest

    def track(self, new: dict[str, NewRequest]) -> None:
        """The step's new requests, by the engine's id (vLLM adds a suffix to the driver's)."""
        for rid, req in new.items():
            dest = self._by_sample.get(req.sample_id)
            if dest is not None:
                dest.req_id = rid
                self._by_req[rid] = dest

    def place(self, values: torch.Tensor, segments: list[Segment]) -> None:
        """A step's rows: `values` [n, C, H] the step buffer's rows, `segments` where each
        request's are. A slice copy per segment and tensor, on the current stream, after the
        forward: no host copy, no sync, no allocation. After a preemption a request's rows
        come again from position 0 and overwrite the same places (the same tokens' states)."""
        k = self.num_layers
        placed = False
        for seg in segments:
            dest = self._by_req.get(seg.req_id)
            if dest is None:
                continue
            if seg.pos > dest.filled:
                raise CaptureError(f"request {seg.req_id!r}: rows arrive at position {seg.pos} but {dest.filled} "
                                   "rows were captured; were prompt tokens skipped (prefix cache)?")
            keep = min(seg.count, dest.rows - seg.pos)
            if keep <= 0:
                continue
            at = dest.offset + seg.pos
            src = values[seg.row : seg.row + keep]
            dest.hidden[at : at + keep].copy_(src[:, :k])
            if dest.final is not None:
                dest.final[at : at + keep].copy_(src[:, k])
            self.copies += 1 + (dest.final is not None)
            dest.filled = max(dest.filled, seg.pos + keep)
            self.rows += keep
            placed = True
        self.steps += placed
        if placed and self.placed_event is not None:
            self.placed_event.record()

    def finish(self, sample_id: Any) -> int:
        """The engine is done with this sample's request: it leaves the sink; returns the rows
        placed (the driver checks them against the prompt's length)."""
        dest = self._by_sample.pop(sample_id, None)
        if dest is None:
            raise CaptureError(f"sample {sample_id!r} was not expected")
        if dest.req_id is not None:
            self._by_req.pop(dest.req_id, None)
        return dest.filled

    def forget(self) -> None:
        """Every expected sample dropped (a failed or abandoned batch)."""
        self._by_sample.clear()
        self._by_req.clear()

    @property
    def expected(self) -> int:
        return len(self._by_sample)
