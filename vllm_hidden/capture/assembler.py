"""Host-side assembly: each step's rows, already mapped to requests by the runner hook
(`capture.records.StepRecord`), accumulated per request across steps (chunked prefill)
until its prompt (or, with --generate, its response) is complete.

Rows are copied once, from the pinned ring slot into the sample's final place, which a sink
hands out (`capture.records.Sink.reserve`). With --generate the rows are staged in a buffer of
the assembler's until the driver says where the response ends, then handed to the sink whole
(`Sink.add_rows`). A request whose rows cannot be assembled goes to the sink's `on_failure`.
Runs on its own thread (`AssemblerThread`), off the engine's."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import torch

from vllm_hidden.capture.records import CaptureError, NewRequest, Segment, Sink, Slot, StepRecord
from vllm_hidden.capture.ring import StepTransfer

log = logging.getLogger(__name__)


class _Staged:
    """A generating request's rows [rows, C, H], statistics [rows, C] and, when the ring has
    them, row sums [rows, 2, C] (C: the ring's columns, the final state's included, as
    `Sink.add_rows` takes them), until its end is known."""

    __slots__ = ("buf", "stat", "moments", "nbytes")

    def __init__(self, rows: int, host: torch.Tensor, host_stat: torch.Tensor, moments: torch.Tensor | None) -> None:
        self.buf = torch.empty((rows, *host.shape[1:]), dtype=host.dtype)
        self.stat = torch.empty((rows, host_stat.shape[1]), dtype=host_stat.dtype)
        self.moments = None if moments is None else torch.empty((rows, *moments.shape[1:]), dtype=moments.dtype)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.buf, self.stat, self.moments) if t is not None)

    def place(self, pos: int, rows: torch.Tensor, stat: torch.Tensor, moments: torch.Tensor | None = None) -> None:
        n = rows.shape[0]
        self.buf[pos : pos + n].copy_(rows)
        self.stat[pos : pos + n].copy_(stat)
        if self.moments is not None:
            self.moments[pos : pos + n].copy_(moments)


class _StagePool:
    """Staging buffers of generating requests, kept for the next ones: a fresh buffer's pages are
    faulted in as its rows arrive (~3 GB/s against ~12 reused, on the assembler thread the
    engine waits on), and a wave of requests needs the same sizes again. Sizes are rounded up
    to GRAIN rows; the buffers kept are bounded by `cap_bytes` (more go back to the allocator).
    `give` may be called from any thread (the sink's writer threads, once they copied the rows)."""

    GRAIN = 128

    def __init__(self, cap_bytes: int = 8 << 30) -> None:
        self.cap_bytes = cap_bytes
        self._free: dict[int, list[_Staged]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, rows: int, host: torch.Tensor, host_stat: torch.Tensor, moments: torch.Tensor | None) -> _Staged:
        n = -(-rows // self.GRAIN) * self.GRAIN
        with self._lock:
            kept = self._free.get(n)
            if kept:
                s = kept.pop()
                self._bytes -= s.nbytes
                return s
        return _Staged(n, host, host_stat, moments)

    def give(self, s: _Staged) -> None:
        with self._lock:
            if self._bytes + s.nbytes <= self.cap_bytes:
                self._free.setdefault(s.buf.shape[0], []).append(s)
                self._bytes += s.nbytes


class _Partial:
    __slots__ = ("req", "slot", "total", "filled", "end", "finished")

    def __init__(self, req: NewRequest, slot: Slot) -> None:
        self.req = req
        self.slot = slot
        self.total = len(req.token_ids) if req.rows is None else req.rows
        self.filled = 0  # rows [0, filled) are valid
        self.end: dict[str, Any] | None = None  # --generate: where the response ended (the driver's word)
        self.finished = False  # --generate: the engine is done with the request


class Assembler:
    """Consumes StepRecords in order on one thread; places finished samples in `sink`."""

    def __init__(self, transfer: StepTransfer, sink: Sink) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"the assembler's sink must be a capture.records.Sink, got {sink!r}")
        self.transfer = transfer
        self.sink = sink
        self._pending: dict[str, NewRequest] = {}
        self._partial: dict[str, _Partial] = {}
        self._by_line: dict[tuple[int, int], str] = {}  # --generate: (input line, turn) -> the engine's request id
        self.dropped: list[str] = []
        self.wait_copy_s = 0.0  # waiting for D2H copies to land
        self._stages = _StagePool()

    def process(self, rec: StepRecord) -> None:
        try:  # the ring slot goes back whatever happens, or the engine would wait for it forever
            self._pending.update(rec.new)
            for rid, req in rec.new.items():
                if req.generate:
                    self._by_line[req.line, req.turn] = rid
            for end in rec.ends:
                rid = self._by_line.pop((end["line"], end.get("turn", 0)), None)
                if rid is not None:
                    self._end(rid, end)
            for rid in rec.finished:
                self._finished(rid)
            if rec.slot is None:
                return
            t0 = time.perf_counter()
            host = self.transfer.wait(rec.slot)
            stat = self.transfer.host_stat[rec.slot]
            moments = self.transfer.host_moments[rec.slot]
            self.wait_copy_s += time.perf_counter() - t0
            for seg in rec.segments:
                try:
                    self._take(seg, host, stat, moments)
                except CaptureError as e:
                    part = self._partial.pop(seg.req_id, None)
                    if part is None or not self.sink.on_failure(part.req.sample_id, str(e)):
                        raise
                    self._discard(part)
        finally:
            if rec.slot is not None:
                self.transfer.release(rec.slot)

    def _finished(self, rid: str) -> None:
        """The engine is done with request `rid`: all of its rows came in earlier records."""
        gen = self._partial.get(rid)
        if gen is not None and gen.req.generate:  # complete once the driver says where it ended
            gen.finished = True
            self._try_generated(rid, gen)
            return
        # An open-ended capture is complete now; anything else still here was aborted before its
        # prompt was complete (normal completions left already).
        part = self._partial.pop(rid, None)
        if part is not None and part.req.until_finished:
            part.slot.buf = part.slot.buf[: part.filled]
            self.sink.commit(part.slot)
            return
        if part is not None:
            self.sink.drop(part.slot)
        req = part.req if part is not None else self._pending.pop(rid, None)
        if req is not None:
            self._dropped(rid, req, "the request ended before its prompt rows were all computed")

    def _discard(self, part: _Partial) -> None:
        """A request's rows go nowhere: the sink drops its slot, or (generating) its staging
        buffer is kept for another request."""
        if part.req.generate:  # a generating request's rows were never the sink's
            self._stages.give(part.slot)
        else:
            self.sink.drop(part.slot)

    def _dropped(self, rid: str, req: NewRequest, why: str) -> None:
        """The sink's `on_failure` hears of it at once (the server's takes it, so the waiting
        response fails fast); if the sink does not take it, the id is kept for the run's
        end-of-run check."""
        if not self.sink.on_failure(req.sample_id, why):
            self.dropped.append(rid)

    def _end(self, rid: str, end: dict[str, Any]) -> None:
        """--generate: the driver knows where request `rid`'s response ended."""
        if "drop" in end:  # an error record, or a turn whose rows a later turn computes again: its rows go
            self._pending.pop(rid, None)
            part = self._partial.pop(rid, None)
            if part is not None:
                self._stages.give(part.slot)
            return
        part = self._partial.get(rid)
        if part is None:
            req = self._pending.pop(rid, None)
            if req is not None:
                self._dropped(rid, req, "the response ended before any of its rows were captured")
            return
        if end["rows"] > part.total:
            raise CaptureError(f"request {part.req.sample_id!r}: its response ends at row {end['rows']}, past the "
                               f"{part.total} rows reserved for it")
        part.total, part.end = end["rows"], end
        self._try_generated(rid, part)

    def _try_generated(self, rid: str, part: _Partial) -> None:
        """A generated sample goes to the sink once its end is known and its rows up to it are in."""
        if part.end is None:
            return
        if part.filled >= part.total:
            del self._partial[rid]
            end = part.end
            staged, n = part.slot, part.total
            self.sink.add_rows(part.req.sample_id, end["token_ids"], staged.buf[:n], staged.stat[:n],
                               loss_spans=end["loss_spans"], num_prompt=end["num_prompt"], record=end["record"],
                               line=part.req.line, moments=None if staged.moments is None else staged.moments[:n],
                               done=lambda: self._stages.give(staged))
        elif part.finished:  # no more rows will come
            del self._partial[rid]
            self._stages.give(part.slot)
            self._dropped(rid, part.req, f"the request ended with {part.filled} of its {part.total} rows captured")

    def _take(self, seg: Segment, host: torch.Tensor, stat: torch.Tensor, moments: torch.Tensor | None) -> None:
        part = self._partial.get(seg.req_id)
        if part is None:
            req = self._pending.pop(seg.req_id, None)
            if req is None:
                return  # a request we were not asked to capture, or one already complete
            if req.generate:
                slot = self._stages.take(req.rows, host, stat, moments)
            elif req.rows is None:
                slot = self.sink.reserve(req.sample_id, req.token_ids, line=req.line, loss_spans=req.loss_spans)
            else:
                slot = self.sink.reserve(req.sample_id, req.token_ids, rows=req.rows)
            part = self._partial[seg.req_id] = _Partial(req, slot)
        if part.req.generate:
            sel = slice(seg.row, seg.row + seg.count)
            self._take_generated(seg, host[sel], stat[sel], None if moments is None else moments[sel], part)
            return
        total = part.total
        if seg.pos == 0:
            part.filled = 0  # first chunk, or recomputation after preemption
        elif part.filled >= total:
            return  # an open-ended capture is full: later rows were not asked for
        elif seg.pos != part.filled:
            raise CaptureError(
                f"request {part.req.sample_id!r}: rows arrive at position {seg.pos} but "
                f"{part.filled} rows were captured; were prompt tokens skipped (prefix cache)?"
            )
        keep = min(seg.count, total - seg.pos)  # rows past `total`: tokens nobody asked for
        if keep > 0:
            sel = slice(seg.row, seg.row + keep)
            if moments is None:
                part.slot.place(seg.pos, host[sel], stat[sel])
            else:
                part.slot.place(seg.pos, host[sel], stat[sel], moments[sel])
            part.filled = seg.pos + keep
        if part.filled >= total and not part.req.until_finished:
            del self._partial[seg.req_id]
            self.sink.commit(part.slot)

    def _take_generated(self, seg: Segment, rows: torch.Tensor, stat: torch.Tensor, moments: torch.Tensor | None,
                        part: _Partial) -> None:
        """Rows of a generating request (this step's: `rows`, `stat`, `moments`). After a
        preemption its rows are computed again from position 0: they overwrite the same places
        (equal states of the same tokens), so rows already captured stay valid and nothing is
        reset."""
        if seg.pos > part.filled:
            raise CaptureError(f"request {part.req.sample_id!r}: rows arrive at position {seg.pos} but "
                               f"{part.filled} rows were captured")
        keep = min(seg.count, part.total - seg.pos)
        if keep > 0:
            part.slot.place(seg.pos, rows[:keep], stat[:keep], None if moments is None else moments[:keep])
            part.filled = max(part.filled, seg.pos + keep)
        self._try_generated(seg.req_id, part)

    def abandon(self) -> list[str]:
        """Drop every request still incomplete (end of a run); returns their request ids."""
        gone = list(self._partial) + list(self._pending)
        for part in self._partial.values():
            self._discard(part)
        self._partial.clear()
        self._pending.clear()
        self.dropped.extend(gone)
        return gone

    @property
    def in_flight(self) -> int:
        return len(self._partial) + len(self._pending)


class AssemblerThread:
    """Runs an Assembler (and its sink's bookkeeping) off the engine thread.
    The first error is kept and re-raised to the engine on its next step or at close."""

    def __init__(self, assembler: Assembler, cpus: set[int] | None = None) -> None:
        self.assembler = assembler
        self.cpus = cpus
        self._q: queue.Queue[StepRecord | None] = queue.Queue()
        self.error: BaseException | None = None
        self.busy_s = 0.0  # processing steps, incl. waiting for their copies
        self._t = threading.Thread(target=self._run, name="vllm-hidden-assembler", daemon=True)
        self._t.start()

    def _run(self) -> None:
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)  # this thread only (Linux)
        while True:
            rec = self._q.get()
            if rec is None:
                return
            if self.error is not None:
                if rec.slot is not None:
                    self.assembler.transfer.release(rec.slot)
                continue
            t0 = time.perf_counter()
            try:
                self.assembler.process(rec)
            except BaseException as e:  # noqa: BLE001 - surfaced to the engine thread
                log.exception("vllm-hidden: capture consumer failed")
                self.error = e
            self.busy_s += time.perf_counter() - t0

    def check(self) -> None:
        if self.error is not None:
            raise CaptureError(f"hidden-state capture failed: {self.error!r}") from self.error

    def put(self, rec: StepRecord) -> None:
        self._q.put(rec)

    def close(self) -> None:
        """Process every queued step, stop the thread, and raise its error if it had one."""
        self._q.put(None)
        self._t.join()
        self.check()
