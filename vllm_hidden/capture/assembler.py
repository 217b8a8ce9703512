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

import torch

from vllm_hidden.capture.records import CaptureError, NewRequest, ResponseEnd, Rows, Segment, Sink, Slot, StepRecord
from vllm_hidden.capture.ring import StepTransfer
from vllm_hidden.capture.staging import Slab, Staged, StagePool, words

log = logging.getLogger(__name__)


class _Partial:
    """A request's rows so far, placed straight into the sample's place in the sink."""

    __slots__ = ("req", "slot", "total", "filled")

    def __init__(self, req: NewRequest, slot: Slot) -> None:
        self.req = req
        self.slot = slot
        self.total = len(req.token_ids) if req.rows is None else req.rows
        self.filled = 0  # rows [0, filled) are valid


class _Generating:
    """extract --generate: a request's rows so far, staged until the driver says where its
    response ended."""

    __slots__ = ("req", "staged", "total", "filled", "end", "finished")

    def __init__(self, req: NewRequest, rows: int, staged: Staged) -> None:
        self.req = req
        self.staged = staged
        self.total = rows  # prompt + max tokens until the end is known, then prompt + response
        self.filled = 0  # rows [0, filled) are valid
        self.end: ResponseEnd | None = None  # where the response ended (the driver's word)
        self.finished = False  # the engine is done with the request


# A generating request's segment of fewer rows than this goes into its step's scatter (a decode
# row, a few with speculative decoding); a longer one (a prefill chunk) is copied as a slice.
_SCATTER_ROWS = 64


class _SlabRows:
    """A step's rows bound for one slab: destination rows in the slab, source rows in the ring slot."""

    __slots__ = ("slab", "dst", "src")

    def __init__(self, slab: Slab) -> None:
        self.slab = slab
        self.dst: list[int] = []
        self.src: list[int] = []


class _StepRows:
    """One step's rows of generating requests: where each goes, per slab, placed together once
    all are known."""

    __slots__ = ("slabs", "filled", "gone")

    def __init__(self) -> None:
        self.slabs: dict[int, _SlabRows] = {}  # by id(slab)
        self.filled: dict[str, tuple[_Generating, int]] = {}  # request id -> (its part, rows valid once placed)
        self.gone: list[_Generating] = []  # failed this step: their buffers go back once the copies are done


class Assembler:
    """Consumes StepRecords in order on one thread; places finished samples in `sink`."""

    def __init__(self, transfer: StepTransfer, sink: Sink) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"the assembler's sink must be a capture.records.Sink, got {sink!r}")
        self.transfer = transfer
        self.sink = sink
        self._pending: dict[str, NewRequest] = {}
        self._partial: dict[str, _Partial | _Generating] = {}
        self._by_line: dict[tuple[int, int], str] = {}  # --generate: (input line, turn) -> the engine's request id
        self.dropped: list[str] = []
        self.wait_copy_s = 0.0  # waiting for D2H copies to land
        self._stages = StagePool()

    def process(self, rec: StepRecord) -> None:
        try:  # the ring slot goes back whatever happens, or the engine would wait for it forever
            self._pending.update(rec.new)
            for rid, req in rec.new.items():
                if req.generate and req.line is not None:  # (always: NewRequest checks it)
                    self._by_line[req.line, req.turn] = rid
            for end in rec.ends:
                ended = self._by_line.pop((end.line, end.turn), None)
                if ended is not None:
                    self._end(ended, end)
            for rid in rec.finished:
                self._finished(rid)
            if rec.slot is None:
                return
            t0 = time.perf_counter()
            step = Rows(self.transfer.wait(rec.slot), self.transfer.host_row_scale[rec.slot],
                        self.transfer.host_row_sums[rec.slot])
            self.wait_copy_s += time.perf_counter() - t0
            gen = _StepRows()
            for seg in rec.segments:
                try:
                    self._take(seg, step, gen)
                except CaptureError as e:
                    part = self._partial.pop(seg.req_id, None)
                    if part is None or not self.sink.on_failure(part.req.sample_id, str(e)):
                        raise
                    if isinstance(part, _Generating):  # its buffer may still be a destination of this step's rows
                        gen.gone.append(part)
                    else:
                        self._discard(part)
            self._place_generated(gen, step)
        finally:
            if rec.slot is not None:
                self.transfer.release(rec.slot)

    def _finished(self, rid: str) -> None:
        """The engine is done with request `rid`: all of its rows came in earlier records."""
        part = self._partial.get(rid)
        if isinstance(part, _Generating):  # complete once the driver says where it ended
            part.finished = True
            self._try_generated(rid, part)
            return
        # An open-ended capture is complete now; anything else still here was aborted before its
        # prompt was complete (normal completions left already).
        self._partial.pop(rid, None)
        if part is not None and part.req.until_finished:
            part.slot.buf = part.slot.buf[: part.filled]
            self.sink.commit(part.slot)
            return
        if part is not None:
            self.sink.drop(part.slot)
        req = part.req if part is not None else self._pending.pop(rid, None)
        if req is not None:
            self._dropped(rid, req, "the request ended before its prompt rows were all computed")

    def _discard(self, part: _Partial | _Generating) -> None:
        """A request's rows go nowhere: the sink drops its slot, or (generating) its staging
        buffer is kept for another request."""
        if isinstance(part, _Generating):  # a generating request's rows were never the sink's
            self._stages.give(part.staged)
        else:
            self.sink.drop(part.slot)

    def _dropped(self, rid: str, req: NewRequest, why: str) -> None:
        """The sink's `on_failure` hears of it at once (the server's takes it, so the waiting
        response fails fast); if the sink does not take it, the id is kept for the run's
        end-of-run check."""
        if not self.sink.on_failure(req.sample_id, why):
            self.dropped.append(rid)

    def _end(self, rid: str, end: ResponseEnd) -> None:
        """--generate: the driver knows where request `rid`'s response ended."""
        if end.drop is not None:  # an error record, or a turn whose rows a later turn computes again: its rows go
            self._pending.pop(rid, None)
            gone = self._partial.pop(rid, None)
            if gone is not None:
                self._discard(gone)
            return
        part = self._partial.get(rid)
        if not isinstance(part, _Generating):
            req = self._pending.pop(rid, None)
            if req is not None:
                self._dropped(rid, req, "the response ended before any of its rows were captured")
            return
        if end.rows > part.total:
            raise CaptureError(f"request {part.req.sample_id!r}: its response ends at row {end.rows}, past the "
                               f"{part.total} rows reserved for it")
        part.total, part.end = end.rows, end
        self._try_generated(rid, part)

    def _try_generated(self, rid: str, part: _Generating) -> None:
        """A generated sample goes to the sink once its end is known and its rows up to it are in."""
        if part.end is None:
            return
        if part.filled >= part.total:
            del self._partial[rid]
            end = part.end
            staged, n = part.staged, part.total
            self.sink.add_rows(part.req.sample_id, end.token_ids, staged.first(n), loss_spans=end.loss_spans,
                               num_prompt=end.num_prompt, record=end.record, line=part.req.line,
                               done=lambda: self._stages.give(staged))
        elif part.finished:  # no more rows will come
            del self._partial[rid]
            self._stages.give(part.staged)
            self._dropped(rid, part.req, f"the request ended with {part.filled} of its {part.total} rows captured")

    def _take(self, seg: Segment, step: Rows, gen: _StepRows) -> None:
        part = self._partial.get(seg.req_id)
        if part is None:
            req = self._pending.pop(seg.req_id, None)
            if req is None:
                return  # a request we were not asked to capture, or one already complete
            if req.generate and req.rows is not None:  # (always both: NewRequest checks it)
                part = _Generating(req, req.rows, self._stages.take(req.rows, step.values, step.row_scale,
                                                                    step.row_sums))
            elif req.rows is None:
                part = _Partial(req, self.sink.reserve(req.sample_id, req.token_ids, line=req.line,
                                                       loss_spans=req.loss_spans))
            else:
                part = _Partial(req, self.sink.reserve(req.sample_id, req.token_ids, rows=req.rows))
            self._partial[seg.req_id] = part
        if isinstance(part, _Generating):
            self._take_generated(seg, step, part, gen)
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
            part.slot.place(seg.pos, step[seg.row : seg.row + keep])
            part.filled = seg.pos + keep
        if part.filled >= total and not part.req.until_finished:
            del self._partial[seg.req_id]
            self.sink.commit(part.slot)

    def _take_generated(self, seg: Segment, step: Rows, part: _Generating, gen: _StepRows) -> None:
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
            part.staged.place(seg.pos, step[seg.row : seg.row + keep])
        elif keep > 0:
            staged = part.staged
            slab = staged.slab
            to = gen.slabs.get(id(slab))
            if to is None:
                to = gen.slabs[id(slab)] = _SlabRows(slab)
            first = staged.offset + seg.pos
            to.dst.extend(range(first, first + keep))
            to.src.extend(range(seg.row, seg.row + keep))
        gen.filled[seg.req_id] = (part, max(filled, seg.pos + keep))

    def _place_generated(self, gen: _StepRows, step: Rows) -> None:
        """The step's rows of generating requests, a scatter per slab and tensor; then each
        request's bookkeeping (which may hand its rows to the sink)."""
        if gen.slabs:
            host_words, row_scale, row_sums = words(step.values), step.row_scale, step.row_sums
            for to in gen.slabs.values():
                slab, src = to.slab, to.src
                at = torch.tensor(to.dst, dtype=torch.int64)
                if src == list(range(src[0], src[0] + len(src))):  # decode rows side by side: no gather
                    sel = slice(src[0], src[0] + len(src))
                    rows, st, mo = host_words[sel], row_scale[sel], None if row_sums is None else row_sums[sel]
                else:
                    idx = torch.tensor(src, dtype=torch.int64)
                    rows, st = host_words.index_select(0, idx), row_scale.index_select(0, idx)
                    mo = None if row_sums is None else row_sums.index_select(0, idx)
                slab.words.index_copy_(0, at, rows)
                slab.row_scale.index_copy_(0, at, st)
                if slab.row_sums is not None:
                    slab.row_sums.index_copy_(0, at, mo)
        for rid, (part, filled) in gen.filled.items():
            if self._partial.get(rid) is part:  # not failed since
                part.filled = filled
                self._try_generated(rid, part)
        for part in gen.gone:
            self._stages.give(part.staged)

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
