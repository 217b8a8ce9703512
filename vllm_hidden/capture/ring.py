"""The step transfer: gather -> ONE preallocated device buffer -> ONE async D2H copy into a
preallocated (pinned on CUDA) host ring slot, completion tracked with events.

Nothing here allocates per step. On CPU the "device" buffer is host memory and the copy is
synchronous, but the code path is the same, so CPU tests exercise it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


class _NullEvent:
    def record(self, stream=None) -> None:  # noqa: D401 - CPU copies are synchronous
        pass

    def synchronize(self) -> None:
        pass


class StepTransfer:
    """Owns the device buffer [max_tokens, K, H] and `slots` host buffers of the same shape."""

    def __init__(self, max_tokens: int, num_layers: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, slots: int = 2) -> None:
        if max_tokens < 1 or num_layers < 1 or hidden_size < 1:
            raise ValueError(f"bad buffer shape ({max_tokens}, {num_layers}, {hidden_size})")
        if slots < 2:
            raise ValueError(f"the host ring needs >= 2 slots, got {slots}")
        self.shape = (max_tokens, num_layers, hidden_size)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.device_buf = torch.empty(self.shape, dtype=dtype, device=self.device)
        self.host = [torch.empty(self.shape, dtype=dtype, pin_memory=self.cuda) for _ in range(slots)]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self._gathered = torch.cuda.Event()
            self._copied = [torch.cuda.Event() for _ in range(slots)]
        else:
            self.copy_stream = None
            self._gathered = _NullEvent()
            self._copied = [_NullEvent() for _ in range(slots)]
        self._last_copy: int | None = None
        # Free-slot accounting: the producer blocks here when the consumer falls behind
        # (backpressure: the engine slows down rather than memory growing).
        self._free = list(range(slots))
        self._cv = threading.Condition()
        self.bytes_per_row = num_layers * hidden_size * self.device_buf.element_size()

    @property
    def slots(self) -> int:
        return len(self.host)

    def acquire(self, timeout: float | None = None) -> int:
        with self._cv:
            if not self._cv.wait_for(lambda: self._free, timeout=timeout):
                raise TimeoutError("no free host ring slot")
            return self._free.pop(0)

    def release(self, slot: int) -> None:
        with self._cv:
            self._free.append(slot)
            self._cv.notify()

    def submit(self, layers: Sequence[torch.Tensor], num_tokens: int, slot: int, start: int = 0) -> None:
        """Gather rows [start, start + num_tokens) of each layer tensor into the device buffer,
        then copy them to host slot `slot` in one transfer. Stream-ordered after the forward,
        so it is safe with CUDA-graph outputs that the next replay overwrites."""
        n = num_tokens
        if not 0 < n <= self.shape[0]:
            raise ValueError(f"step has {n} tokens; the capture buffer holds {self.shape[0]}")
        if start:
            layers = [t[start:] for t in layers]  # a view: still one gather
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            if self._last_copy is not None:
                # the previous D2H must have read the device buffer before we overwrite it
                compute.wait_event(self._copied[self._last_copy])
            torch.stack([t[:n] for t in layers], dim=1, out=self.device_buf[:n])
            self._gathered.record(compute)
            self.copy_stream.wait_event(self._gathered)
            with torch.cuda.stream(self.copy_stream):
                self.host[slot][:n].copy_(self.device_buf[:n], non_blocking=True)
                self._copied[slot].record(self.copy_stream)
        else:
            torch.stack([t[:n] for t in layers], dim=1, out=self.device_buf[:n])
            self.host[slot][:n].copy_(self.device_buf[:n])
        self._last_copy = slot

    def wait(self, slot: int) -> torch.Tensor:
        """Block until slot's copy landed; returns the host slot tensor."""
        self._copied[slot].synchronize()
        return self.host[slot]
