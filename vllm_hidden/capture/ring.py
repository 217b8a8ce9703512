"""The step transfer: gather -> ONE preallocated device buffer -> ONE async D2H copy into a
preallocated (pinned on CUDA) host ring slot, completion tracked with events. Beside the
values, each row carries its per-column statistic (`quant`), computed on the device in the
same pass: the writer's finiteness check, and with fp8 storage the scale. With `row_sums`
(an output that keeps per-layer statistics) each row also carries, per column, its sum and
centred sum of squares (`format.stats.RowSums`), reduced on the device where the rows already
are: the host then sums a few floats per row instead of reading every value again.

Nothing here allocates per step. On CPU the "device" buffer is host memory and the copy is
synchronous, but the code path is the same, so CPU tests exercise it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from vllm_hidden.format import quant
from vllm_hidden.format.stats import RowSums

# values the device's row sums convert to float32 at a time (64 MiB of scratch): a few kernels
# per step, against the host's 2 MiB chunks sized for a core's cache
_DEVICE_SUM_CHUNK = 1 << 24


class _NullEvent:
    def record(self, stream=None) -> None:  # noqa: D401 - CPU copies are synchronous
        pass

    def synchronize(self) -> None:
        pass


class StepTransfer:
    """Owns the device step buffer and `slots` host buffers of the same layout: per token one
    packed row holding its C columns' values [C, H] and their per-column float32 statistic
    [C] (`quant`: the amax, or with fp8 values the scale), with `row_sums` then their sums and
    centred sums of squares [2, C], so one copy carries them all."""

    def __init__(self, max_tokens: int, num_layers: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, slots: int = 2, fp8: bool = False, per_token: bool = False,
                 row_sums: bool = False) -> None:
        if max_tokens < 1 or num_layers < 1 or hidden_size < 1:
            raise ValueError(f"bad buffer shape ({max_tokens}, {num_layers}, {hidden_size})")
        if slots < 2:
            raise ValueError(f"the host ring needs >= 2 slots, got {slots}")
        self.shape = (max_tokens, num_layers, hidden_size)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = dtype  # what the model computes
        self.fp8 = fp8
        self.per_token = per_token  # fp8: one scale per token (hs_connectors' layout), else per column
        self.values_dtype = quant.FP8 if fp8 else dtype  # what is stored
        self._values_bytes = num_layers * hidden_size * self.values_dtype.itemsize
        if self._values_bytes % 4:
            raise ValueError(f"hidden size {hidden_size} leaves the row statistics unaligned")
        self.has_row_sums = row_sums
        self.bytes_per_row = self._values_bytes + 4 * num_layers * (3 if row_sums else 1)
        self._device_rows = torch.empty((max_tokens, self.bytes_per_row), dtype=torch.uint8, device=self.device)
        self._device_values, self._device_row_scale, self._device_row_sums = self._views(self._device_rows)
        if row_sums:  # contiguous scratch for the reductions' outputs, then one copy into the rows
            self._row_sums = RowSums(num_layers * hidden_size, fp8, self.device,
                                     _DEVICE_SUM_CHUNK if self.cuda else 1 << 19)
            self._sums = torch.empty((2, max_tokens, num_layers), dtype=torch.float32, device=self.device)
        # fp8: the layers are gathered in the model's dtype first, then quantized into the rows
        self._gather = torch.empty(self.shape, dtype=dtype, device=self.device) if fp8 else None
        self._work = torch.empty(self.shape[:2], dtype=torch.float32, device=self.device) if fp8 else None
        self._token_work = torch.empty((max_tokens, 1), dtype=torch.float32, device=self.device) \
            if fp8 and per_token else None
        self._host_rows = [torch.empty((max_tokens, self.bytes_per_row), dtype=torch.uint8, pin_memory=self.cuda)
                           for _ in range(slots)]
        views = [self._views(r) for r in self._host_rows]
        self.host = [v[0] for v in views]  # [max_tokens, C, H] values per slot (rows strided)
        self.host_row_scale = [v[1] for v in views]  # [max_tokens, C] float32 per slot
        # row_sums: [max_tokens, 2, C] float32 per slot (sum, centred sum of squares); else None
        self.host_row_sums = [v[2] for v in views]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self._gathered = torch.cuda.Event()
            self._copied = [torch.cuda.Event() for _ in range(slots)]
            # recorded after every copy: what a forward writing into `stage` waits on (engine.stash);
            # external, so that a CUDA graph replay waits on its latest record too
            self.copy_done: torch.cuda.Event | None = torch.cuda.Event(external=True)
        else:
            self.copy_stream = None
            self._gathered = _NullEvent()
            self._copied = [_NullEvent() for _ in range(slots)]
            self.copy_done = None
        self._last_copy: int | None = None
        self.host_copies = 0  # steps copied to the host ring (none when colocated: `fill`)
        # Free-slot accounting: the producer blocks here when the consumer falls behind
        # (backpressure: the engine slows down rather than memory growing).
        self._free = list(range(slots))
        self._cv = threading.Condition()

    def _views(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        n, c, h = self.shape
        values = rows[:, : self._values_bytes].view(self.values_dtype).view(n, c, h)
        floats = rows[:, self._values_bytes :].view(torch.float32)
        return values, floats[:, :c], floats[:, c:].view(n, 2, c) if self.has_row_sums else None

    def stage(self) -> torch.Tensor:
        """[max_tokens, C, H] in the model's dtype: where a step's columns are put before their
        statistics (and fp8 quantization) are made: the step buffer's values themselves, or with
        fp8 the work space they are quantized from. A forward may write its columns here directly
        (engine.stash) and `submit` them with `staged`."""
        return self._gather if self.fp8 else self._device_values

    @property
    def slots(self) -> int:
        return len(self.host)

    def device_bytes(self) -> dict[str, int]:
        """The device memory these buffers hold, by what holds it (all allocated here, once):
        `rows` the step buffer (values and per-row statistics), `row_sums` the reductions'
        scratch and outputs, `fp8` the gather and quantization work space."""
        def size(*ts: torch.Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        out = {"rows": size(self._device_rows)}
        if self.has_row_sums:
            out["row_sums"] = size(self._row_sums.f32, self._row_sums.i16, self._sums)
        if self.fp8:
            out["fp8"] = size(self._gather, self._work, self._token_work)
        return out

    def host_bytes(self) -> int:
        """The host ring (pinned on CUDA)."""
        return sum(r.numel() for r in self._host_rows)

    def acquire(self, timeout: float | None = None) -> int:
        with self._cv:
            if not self._cv.wait_for(lambda: self._free, timeout=timeout):
                raise TimeoutError("no free host ring slot")
            return self._free.pop(0)

    def release(self, slot: int) -> None:
        with self._cv:
            self._free.append(slot)
            self._cv.notify()

    def submit(self, layers: Sequence[torch.Tensor], num_tokens: int, slot: int, start: int = 0,
               staged: int = 0) -> None:
        """Rows [start, start + num_tokens) of the step to host slot `slot`, in one transfer. With
        `staged` 0, every column is gathered from `layers` into the device buffer's rows [0, n);
        with `staged` k, the first k columns are in `stage()` at rows [start, start + n) already
        (the forward wrote them) and `layers` gives the rest, gathered beside them. Stream-ordered
        after the forward, so it is safe with CUDA-graph outputs that the next replay overwrites."""
        layers, n, base = self._span(layers, num_tokens, start, staged)
        rows = self._device_rows[base:base + n]
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            if self._last_copy is not None:
                # the previous D2H must have read the device buffer before we overwrite it
                compute.wait_event(self._copied[self._last_copy])
            self._fill(layers, n, base, staged)
            self._gathered.record(compute)
            self.copy_stream.wait_event(self._gathered)
            with torch.cuda.stream(self.copy_stream):
                self._host_rows[slot][:n].copy_(rows, non_blocking=True)
                self._copied[slot].record(self.copy_stream)
                if self.copy_done is not None:  # always, on CUDA
                    self.copy_done.record(self.copy_stream)
        else:
            self._fill(layers, n, base, staged)
            self._host_rows[slot][:n].copy_(rows)
        self._last_copy = slot
        self.host_copies += 1

    def fill(self, layers: Sequence[torch.Tensor], num_tokens: int, start: int = 0, staged: int = 0) -> torch.Tensor:
        """`submit` without the copy to the host (colocated capture, `capture.device`): the
        step's rows [n, C, H] in the device buffer, valid until the next step's fill."""
        layers, n, base = self._span(layers, num_tokens, start, staged)
        self._fill(layers, n, base, staged)
        return self._device_values[base:base + n]

    def _span(self, layers: Sequence[torch.Tensor], n: int, start: int,
              staged: int) -> tuple[Sequence[torch.Tensor], int, int]:
        """(the columns to gather from row 0, the step's rows, where they are in the device buffer)."""
        if not 0 < n <= self.shape[0]:
            raise ValueError(f"step has {n} tokens; the capture buffer holds {self.shape[0]}")
        if staged + len(layers) != self.shape[1]:
            raise ValueError(f"{staged} staged + {len(layers)} gathered columns; the buffer has {self.shape[1]}")
        if start:
            layers = [t[start:] for t in layers]  # a view: still one gather
        return layers, n, start if staged else 0

    def _fill(self, layers: Sequence[torch.Tensor], n: int, base: int, first: int) -> None:
        """The step's rows [base, base + n) of the device buffer: columns `first`... gathered from
        `layers` (those before are staged), then every column's statistic; a few kernels, no
        allocation."""
        at = slice(base, base + n)
        values, row_scale = self._device_values[at], self._device_row_scale[at]
        gather, work, row_sums = self._gather, self._work, self._device_row_sums  # fp8: gather, work; row_sums: sums
        stage = gather[at] if gather is not None else values
        for k, t in enumerate(layers):  # the rows are packed: one copy per column, not one stack
            stage[:, first + k].copy_(t[:n])
        if work is not None:
            token_work = None if self._token_work is None else self._token_work[at]
            quant.quantize(stage, values, row_scale, work[at], token_work)
        else:
            quant.row_amax(values, row_scale)
        if row_sums is not None:  # of the values as stored (fp8: before their scale, as the host's are)
            self._row_sums(values, self._sums[0, at], self._sums[1, at])
            row_sums[at].copy_(self._sums[:, at].transpose(0, 1))

    def wait(self, slot: int) -> torch.Tensor:
        """Block until slot's copy landed; returns the slot's values [max_tokens, C, H]
        (their statistics: `host_row_scale[slot]`)."""
        self._copied[slot].synchronize()
        return self.host[slot]
