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


class _Slab:
    """One allocation that staging buffers are ranges of: values [S, C, H], statistics [S, C]
    and, when the ring has them, row sums [S, 2, C]. A decode step's rows of every generating
    request in the slab are placed with one scatter per tensor (`Assembler._place_generated`)."""

    __slots__ = ("buf", "stat", "moments", "words", "rows", "used", "live", "nbytes")

    def __init__(self, rows: int, host: torch.Tensor, host_stat: torch.Tensor, moments: torch.Tensor | None) -> None:
        self.buf = torch.empty((rows, *host.shape[1:]), dtype=host.dtype)
        self.stat = torch.empty((rows, host_stat.shape[1]), dtype=host_stat.dtype)
        self.moments = None if moments is None else torch.empty((rows, *moments.shape[1:]), dtype=moments.dtype)
        self.words = _words(self.buf)
        self.rows = rows
        self.used = 0  # rows [0, used) were cut into ranges since the slab was last empty
        self.live = 0  # ranges handed out and not given back
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.buf, self.stat, self.moments) if t is not None)


def _words(values: torch.Tensor) -> torch.Tensor:
    """Rows of values [n, C, H] (a view, also of the ring's strided rows) as 4-byte words
    [n, C*H*size/4]: the scatter copies element by element, and wider elements are fewer (the
    ring keeps each row's values a multiple of 4 bytes)."""
    return values.view(values.shape[0], -1).view(torch.int32)


class _Staged:
    """A generating request's rows [rows, C, H], statistics [rows, C] and, when the ring has
    them, row sums [rows, 2, C] (C: the ring's columns, the final state's included, as
    `Sink.add_rows` takes them), until its end is known: rows [offset, offset + rows) of a slab."""

    __slots__ = ("slab", "offset", "rows", "buf", "stat", "moments")

    def __init__(self, slab: _Slab, offset: int, rows: int) -> None:
        self.slab, self.offset, self.rows = slab, offset, rows
        sel = slice(offset, offset + rows)
        self.buf = slab.buf[sel]
        self.stat = slab.stat[sel]
        self.moments = None if slab.moments is None else slab.moments[sel]

    def place(self, pos: int, rows: torch.Tensor, stat: torch.Tensor, moments: torch.Tensor | None = None) -> None:
        n = rows.shape[0]
        self.buf[pos : pos + n].copy_(rows)
        self.stat[pos : pos + n].copy_(stat)
        if self.moments is not None:
            self.moments[pos : pos + n].copy_(moments)


class _StagePool:
    """Staging buffers of generating requests, as ranges of a few large slabs: a decode step
    places its rows with a few copies per slab instead of a few per request, and ranges are
    kept for the next requests (a fresh buffer's pages are faulted in as its rows arrive, ~3
    GB/s against ~12 reused, on the assembler thread the engine waits on; a wave of requests
    needs the same sizes again). Sizes are rounded up to GRAIN rows. A range comes from the
    ranges given back of its size, else is cut from the current slab, else from an empty slab,
    else is a larger range given back, else a new slab (`slab_bytes`, or the request's size)
    is made.

    What is kept: a slab while any of its ranges is in use (with the ranges given back in it,
    for reuse); an empty slab only while the slabs held total at most `cap_bytes`, else it goes
    back to the allocator. With `cap_bytes` 0 nothing is reused: every range is fresh memory.
    `give` may be called from any thread (the sink's writer threads, once they copied the rows)."""

    GRAIN = 128

    def __init__(self, cap_bytes: int = 2 << 30, slab_bytes: int = 1 << 30) -> None:
        self.cap_bytes = cap_bytes
        self.slab_bytes = slab_bytes
        self._slabs: list[_Slab] = []
        self._cur: _Slab | None = None  # where new ranges are cut from
        self._free: dict[int, list[_Staged]] = {}  # ranges given back, by size, in slabs still in use
        self._bytes = 0  # of the slabs held
        self._lock = threading.Lock()

    def take(self, rows: int, host: torch.Tensor, host_stat: torch.Tensor, moments: torch.Tensor | None) -> _Staged:
        n = -(-rows // self.GRAIN) * self.GRAIN
        with self._lock:
            kept = self._free.get(n)
            s = kept.pop() if kept else self._cut(n, host, host_stat, moments)
            s.slab.live += 1
            return s

    def _cut(self, n: int, host: torch.Tensor, host_stat: torch.Tensor, moments: torch.Tensor | None) -> _Staged:
        cur = self._cur
        if cur is None or cur.used + n > cur.rows:  # the rest of the current slab is left until it is empty
            cur = next((s for s in self._slabs if s.live == 0 and s.rows >= n), None)
            if cur is None:
                larger = [k for k, kept in self._free.items() if k > n and kept]
                if larger:  # memory held anyway, rather than more
                    return self._free[min(larger)].pop()
                row_bytes = sum(t[0].numel() * t.element_size() for t in (host, host_stat, moments) if t is not None)
                per_slab = -(-self.slab_bytes // row_bytes // self.GRAIN) * self.GRAIN
                cur = _Slab(max(per_slab, n), host, host_stat, moments)
                self._slabs.append(cur)
                self._bytes += cur.nbytes
            self._cur = cur
        s = _Staged(cur, cur.used, n)
        cur.used += n
        return s

    def give(self, s: _Staged) -> None:
        with self._lock:
            slab = s.slab
            slab.live -= 1
            if slab.live:
                if self.cap_bytes > 0:
                    self._free.setdefault(s.rows, []).append(s)
                return
            # empty: its ranges are cut afresh, or it goes
            for n in [n for n, kept in self._free.items() if any(r.slab is slab for r in kept)]:
                self._free[n] = [r for r in self._free[n] if r.slab is not slab]
            slab.used = 0
            if self._bytes > self.cap_bytes:
                self._slabs.remove(slab)
                self._bytes -= slab.nbytes
                if self._cur is slab:
                    self._cur = None


class _Partial:
    __slots__ = ("req", "slot", "total", "filled", "end", "finished")

    def __init__(self, req: NewRequest, slot: Slot) -> None:
        self.req = req
        self.slot = slot
        self.total = len(req.token_ids) if req.rows is None else req.rows
        self.filled = 0  # rows [0, filled) are valid
        self.end: dict[str, Any] | None = None  # --generate: where the response ended (the driver's word)
        self.finished = False  # --generate: the engine is done with the request


# A generating request's segment of fewer rows than this goes into its step's scatter (a decode
# row, a few with speculative decoding); a longer one (a prefill chunk) is copied as a slice.
_SCATTER_ROWS = 64


class _StepRows:
    """One step's rows of generating requests: where each goes, per slab (destination rows in
    the slab, source rows in the ring slot), placed together once all are known."""

    __slots__ = ("slabs", "filled", "gone")

    def __init__(self) -> None:
        self.slabs: dict[int, tuple[_Slab, list[int], list[int]]] = {}  # id(slab) -> (slab, dst, src)
        self.filled: dict[str, tuple[_Partial, int]] = {}  # request id -> (its part, rows valid once placed)
        self.gone: list[_Partial] = []  # failed this step: their buffers go back once the copies are done


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
            gen = _StepRows()
            for seg in rec.segments:
                try:
                    self._take(seg, host, stat, moments, gen)
                except CaptureError as e:
                    part = self._partial.pop(seg.req_id, None)
                    if part is None or not self.sink.on_failure(part.req.sample_id, str(e)):
                        raise
                    if part.req.generate:  # its buffer may still be a destination of this step's rows
                        gen.gone.append(part)
                    else:
                        self._discard(part)
            self._place_generated(gen, host, stat, moments)
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

    def _take(self, seg: Segment, host: torch.Tensor, stat: torch.Tensor, moments: torch.Tensor | None,
              gen: _StepRows) -> None:
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
            self._take_generated(seg, host, stat, moments, part, gen)
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
            part.slot.place(seg.pos, host[sel], stat[sel], None if moments is None else moments[sel])
            part.filled = seg.pos + keep
        if part.filled >= total and not part.req.until_finished:
            del self._partial[seg.req_id]
            self.sink.commit(part.slot)

    def _take_generated(self, seg: Segment, host: torch.Tensor, stat: torch.Tensor, moments: torch.Tensor | None,
                        part: _Partial, gen: _StepRows) -> None:
        """Rows of a generating request: where they go, noted in `gen` (a long segment is copied
        now); its bookkeeping waits for `_place_generated`. After a preemption its rows are
        computed again from position 0: they overwrite the same places (equal states of the
        same tokens), so rows already captured stay valid and nothing is reset."""
        noted = gen.filled.get(seg.req_id)
        filled = part.filled if noted is None else noted[1]
        if seg.pos > filled:
            raise CaptureError(f"request {part.req.sample_id!r}: rows arrive at position {seg.pos} but "
                               f"{filled} rows were captured")
        keep = min(seg.count, part.total - seg.pos)  # rows past `total`: past the response's end
        if keep >= _SCATTER_ROWS:
            sel = slice(seg.row, seg.row + keep)
            part.slot.place(seg.pos, host[sel], stat[sel], None if moments is None else moments[sel])
        elif keep > 0:
            staged = part.slot
            slab = staged.slab
            at = gen.slabs.get(id(slab))
            if at is None:
                at = gen.slabs[id(slab)] = (slab, [], [])
            first = staged.offset + seg.pos
            at[1].extend(range(first, first + keep))
            at[2].extend(range(seg.row, seg.row + keep))
        gen.filled[seg.req_id] = (part, max(filled, seg.pos + keep))

    def _place_generated(self, gen: _StepRows, host: torch.Tensor, stat: torch.Tensor,
                         moments: torch.Tensor | None) -> None:
        """The step's rows of generating requests, a scatter per slab and tensor; then each
        request's bookkeeping (which may hand its rows to the sink)."""
        if gen.slabs:
            words = _words(host)
            for slab, dst, src in gen.slabs.values():
                at = torch.tensor(dst, dtype=torch.int64)
                if src == list(range(src[0], src[0] + len(src))):  # decode rows side by side: no gather
                    sel = slice(src[0], src[0] + len(src))
                    rows, st, mo = words[sel], stat[sel], None if moments is None else moments[sel]
                else:
                    idx = torch.tensor(src, dtype=torch.int64)
                    rows, st = words.index_select(0, idx), stat.index_select(0, idx)
                    mo = None if moments is None else moments.index_select(0, idx)
                slab.words.index_copy_(0, at, rows)
                slab.stat.index_copy_(0, at, st)
                if slab.moments is not None:
                    slab.moments.index_copy_(0, at, mo)
        for rid, (part, filled) in gen.filled.items():
            if self._partial.get(rid) is part:  # not failed since
                part.filled = filled
                self._try_generated(rid, part)
        for part in gen.gone:
            self._stages.give(part.slot)

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
