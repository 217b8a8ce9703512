"""Shard writer: many samples per safetensors file, rolled at a size limit, streamed to disk
while the run goes on, by a pool of threads.

Samples are assembled in place: each one gets rows in a preallocated host arena (one per
shard being filled or finished, reused), laid out as the shard's `hidden_states` tensor.
The assembler copies rows there straight from the pinned ring. Each arena has its shard's
temporary file open: completed samples are written to their final offsets (`pwrite`, no
concatenation, no serialize-to-bytes) as they complete, behind room reserved for the
safetensors header, and synced every so often. When the arena is full and its last sample
complete, only the header (index, shapes) and token ids are left to write, then fsync, a
BLAKE3 of the file (computed from memory, multi-threaded) and the rename to its final name.
So the end of a run waits for the last few samples, not for a whole shard.

The pool of arenas bounds host memory: when every arena is full or being finished,
`reserve` blocks, the assembler stops taking steps, and the engine waits on the capture
ring (backpressure instead of growth).

A shard holds `hidden_states` [R, K, H], then (with --final-state) `final_hidden_states`
[R, H], `token_ids` [R] int64, (with a loss mask) `loss_mask` [R] uint8, (with --generate)
`generations` [B] uint8: its samples' generations.jsonl lines, in index order, so that a
sample's generation record is durable exactly when its rows are; and in its metadata the
per-sample index [id, row offset, token count] (with --generate, [..., prompt tokens]). Rows the index does not list (a request
aborted mid-prefill) are zeros. Only `hidden_states` is streamed out as samples complete;
the smaller tensors after it, whose offsets depend on the shard's final row count, are
written from memory when the shard is finished.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from vllm_hidden.capture import quant
from vllm_hidden.config import ShardConfig
from vllm_hidden.storage.files import (FORMAT, SAMPLE_CHECKSUMS, ShardInfo, fsync_dir, hasher, sample_digest,
                                       shard_file, write_behind)

log = logging.getLogger("vllm_hidden")

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64",
              torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
_WRITE_BATCH = 32 << 20  # completed rows handed to a writer thread in batches of this size
_SYNC_EVERY = 256 << 20  # fdatasync as data accumulates, so the final fsync has little left
_HEADER_FIXED = 4096  # header bytes besides the sample index (tensor entries, format, layer ids)


# an arena's tensors: values [R, K, H], final state [R, H] | None, their statistics [R, K] and [R] | None
_Buffers = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, "torch.Tensor | None"]


def _raw(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous():
        raise ValueError(f"shard parts must be contiguous, got strides {t.stride()}")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _entry_bytes(sample_id: Any, row: int, count: int, num_prompt: int | None = None) -> int:
    # the index is a JSON string inside the JSON header: quotes and backslashes get escaped;
    # + its checksum in the SAMPLE_CHECKSUMS list (32 hex digits, escaped quotes, a comma)
    entry = [sample_id, row, count] if num_prompt is None else [sample_id, row, count, num_prompt]
    return len(json.dumps(json.dumps(entry))) + 1 + 37


class SampleSlot:
    """Rows reserved for one sample; the assembler fills them (`place`), then commits: `buf`
    [T, K, H], `final` [T, H] (--final-state), and their per-row statistics `stat` [T, K] and
    `final_stat` [T] (float32: the amax, or with fp8 values the scale; see capture.quant)."""

    __slots__ = ("arena", "sample_id", "token_ids", "row", "buf", "final", "stat", "final_stat", "state", "line",
                 "loss_spans", "num_prompt", "record", "src", "src_stat", "placed", "digest")
    # NOT_FINITE: committed, then refused by its writer thread (NaN/Inf); left out like DROPPED
    RESERVED, COMMITTED, DROPPED, NOT_FINITE = 0, 1, 2, 3

    def __init__(self, arena: "_Arena", sample_id: Any, token_ids: torch.Tensor, row: int,
                 line: int | None = None, loss_spans: list[list[int]] | None = None,
                 num_prompt: int | None = None, record: bytes | None = None) -> None:
        self.arena = arena
        self.num_prompt = num_prompt
        self.record = record
        self.src: torch.Tensor | None = None  # rows [T, C, H] its writer thread places (add_rows)
        self.src_stat: torch.Tensor | None = None
        self.sample_id = sample_id
        self.token_ids = token_ids
        self.row = row
        n = token_ids.shape[0]
        self.buf = arena.buf[row : row + n]
        self.final = arena.final[row : row + n] if arena.final is not None else None
        self.stat = arena.stat[row : row + n]
        self.final_stat = arena.final_stat[row : row + n] if arena.final_stat is not None else None
        self.state = SampleSlot.RESERVED
        self.placed = False  # rows came through `place`, with their statistics
        self.line = line
        self.loss_spans = loss_spans
        self.digest: str | None = None  # its SAMPLE_CHECKSUMS entry, made by the writer thread that writes it

    def entry(self, generate: bool) -> list[Any]:
        """Its shard index entry: [id, row offset, tokens(, prompt tokens)]."""
        return [self.sample_id, self.row, int(self.token_ids.shape[0]), *([self.num_prompt] if generate else [])]

    def mask(self) -> torch.Tensor:
        """Its loss mask rows, uint8 [T], from its spans."""
        m = torch.zeros(self.token_ids.shape[0], dtype=torch.uint8)
        for lo, hi in self.loss_spans:
            m[lo:hi] = 1
        return m

    def place(self, pos: int, rows: torch.Tensor, stat: torch.Tensor) -> None:
        """Rows [pos, pos + n) as the ring holds them: [n, C, H] and [n, C], the last column
        the final state's when this output stores it (kept apart)."""
        n = rows.shape[0]
        self.placed = True
        if self.final is None:
            self.buf[pos : pos + n].copy_(rows)
            self.stat[pos : pos + n].copy_(stat)
        else:
            self.buf[pos : pos + n].copy_(rows[:, :-1])
            self.final[pos : pos + n].copy_(rows[:, -1])
            self.stat[pos : pos + n].copy_(stat[:, :-1])
            self.final_stat[pos : pos + n].copy_(stat[:, -1])

    def zero(self) -> None:
        for t in (self.buf, self.final, self.stat, self.final_stat):
            if t is not None:
                t.zero_()


def slot_not_finite(slot: SampleSlot, layer_ids: list[int]) -> str | None:
    """From the rows' statistics ([T, K] floats, computed beside the gather): the states
    themselves are read only for a sample that has a non-finite row, to say where."""
    if bool(torch.isfinite(slot.stat).all()) and (slot.final_stat is None or bool(torch.isfinite(slot.final_stat).all())):
        return None
    if slot.buf.dtype == quant.FP8:  # the values are the quantized ones: the scales say where
        stat = slot.stat if slot.final_stat is None else torch.cat([slot.stat, slot.final_stat[:, None]], dim=1)
        return not_finite(stat[:, :, None], [*layer_ids, *(["final"] if slot.final_stat is not None else [])],
                          what="(token, layer) rows")
    why = not_finite(slot.buf, layer_ids)
    if why is None and slot.final is not None:
        why = not_finite(slot.final[:, None], ["final"])
    return why


def bad_values(buf: torch.Tensor) -> torch.Tensor | None:
    """The mask of `buf`'s NaN/Inf values, or None if every value is finite. One
    allocation-free reduction first (min/max propagate NaN and reach +-Inf), ~10 GB/s per
    core on bf16; the mask is only made for a bad sample."""
    if buf.numel() == 0:
        return None
    lo, hi = torch.aminmax(buf)
    if torch.isfinite(lo) and torch.isfinite(hi):
        return None
    return ~torch.isfinite(buf)


def not_finite(buf: torch.Tensor, layer_ids: list[Any], what: str = "values") -> str | None:
    """None if every value of `buf` [T, K, H] is finite, else what is wrong and where."""
    bad = bad_values(buf)
    if bad is None:
        return None
    nan = int(torch.isnan(buf).sum())
    layers = [layer_ids[k] for k in bad.any(dim=(0, 2)).nonzero().flatten().tolist()]
    rows = bad.any(dim=(1, 2)).nonzero().flatten()
    return (f"hidden states are not finite: {nan} NaN and {int(bad.sum()) - nan} Inf {what} in layer ids "
            f"{layers}, {rows.numel()} of {buf.shape[0]} tokens (first at token {int(rows[0])}); not written")


class _Arena:
    """One shard in the making: its rows in memory, its temporary file, its pending writes."""

    __slots__ = ("bufs", "buf", "final", "stat", "final_stat", "rows", "slots", "pending", "sealed", "pooled", "tmp",
                 "fd", "index_bytes", "batch", "batch_bytes", "writes", "unsynced")

    def __init__(self, bufs: "_Buffers", pooled: bool, tmp: Path) -> None:
        self.bufs = bufs
        self.buf, self.final, self.stat, self.final_stat = bufs
        self.rows = 0
        self.slots: list[SampleSlot] = []
        self.pending = 0  # reserved, not yet committed or dropped
        self.sealed = False
        self.pooled = pooled
        self.tmp = tmp
        self.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.index_bytes = 0
        self.batch: list[SampleSlot] = []  # committed, not yet handed to a writer
        self.batch_bytes = 0
        self.writes: list[Future] = []
        self.unsynced = 0

    def add(self, sample_id: Any, token_ids: torch.Tensor, entry_bytes: int, line: int | None = None,
            loss_spans: list[list[int]] | None = None, num_prompt: int | None = None,
            record: bytes | None = None) -> SampleSlot:
        slot = SampleSlot(self, sample_id, token_ids, self.rows, line, loss_spans, num_prompt, record)
        self.rows += token_ids.shape[0]
        self.slots.append(slot)
        self.pending += 1
        self.index_bytes += entry_bytes
        return slot


class ShardWriter:
    """reserve() -> slot.place(rows, stats) (or fill slot.buf) -> commit() (or drop()); close() finishes what is left and
    returns every shard written. reserve/commit/drop are called from one thread (the
    assembler); files are written by `cfg.writer_threads` threads."""

    def __init__(self, cfg: ShardConfig, layer_ids: list[int], hidden_size: int, dtype: torch.dtype) -> None:
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be positive, got {hidden_size!r}")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"unsupported hidden-state dtype {dtype}")
        if (dtype == quant.FP8) != cfg.fp8:
            raise ValueError(f"values of dtype {dtype} for an output with fp8={cfg.fp8}")
        self.fp8 = cfg.fp8
        self.cfg = cfg
        self.dir = Path(cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = list(layer_ids)
        self.dtype = dtype
        self.row_shape = (len(self.layer_ids), hidden_size)
        self.row_bytes = len(self.layer_ids) * hidden_size * dtype.itemsize
        self.final_row_bytes = hidden_size * dtype.itemsize if cfg.final_state else 0
        # Room for the header at the front of each file, so rows can be written at their final
        # offsets before the index is known; a shard rolls early if its index would overflow it.
        # Padding the header JSON with spaces is valid safetensors. `max_shard_bytes` bounds the
        # tensor data; the header adds at most 1 MiB.
        extra = self.final_row_bytes + 8 + cfg.loss_mask  # + the final state, token id and mask byte
        if self.fp8:  # + their scales
            extra += 4 * (len(self.layer_ids) + cfg.final_state)
        self.rows_per_shard = max(1, cfg.max_shard_bytes // (self.row_bytes + extra))
        room = _HEADER_FIXED + (32 + 37) * min(self.rows_per_shard, 1 << 15)  # ~32 B of index, 37 of checksum
        self.header_room = min(room + (-room % 8), 1 << 20)
        # one arena being filled + one per writer thread; more only when every other arena
        # waits for a sample still in prefill (chunked prompts), never while one is finishing
        self.max_arenas = cfg.writer_threads + 1
        self._pool = ThreadPoolExecutor(cfg.writer_threads, thread_name_prefix="vllm-hidden-writer")
        self._cv = threading.Condition()
        self._free: list[_Buffers] = []
        self._allocated = 0
        self._finishing = 0
        self._futures: list[Future] = []
        self._current: _Arena | None = None
        self._open: list[_Arena] = []  # not yet handed over to be finished
        self._seq = 0
        self._next_shard = cfg.first_index
        from vllm_hidden.storage.journal import Journal

        self._journal = Journal(self.dir)
        self._uploader = None
        if cfg.upload_uri:
            from vllm_hidden.storage.s3 import S3Location, S3Uploader

            self._uploader = S3Uploader(S3Location(cfg.upload_uri, cfg.s3_endpoint_url), max_pending=cfg.upload_pending,
                                        retry_for_s=cfg.upload_retry_s)
        self._shards: list[tuple[int, ShardInfo]] = []
        self._not_finite: list[list[Any]] = []  # [sample id, input line, what] of samples refused
        self._error: BaseException | None = None
        self._closed = False
        self._write_s = 0.0  # summed over writer threads
        self._reserve_wait_s = 0.0  # assembler blocked on a free arena (backpressure)
        self._close_s = 0.0
        self._unwritten = 0  # bytes of committed rows handed to the writer threads, not yet written
        self._close_unwritten = 0  # ...when close() began: what the end of a run had left to write
        self._tail: dict[str, float] = {}  # the slowest phases of the shards finished by close(): the end of a run

    # -- arenas ------------------------------------------------------------------------
    def _new_buffer(self, rows: int) -> "_Buffers":
        # untouched until rows are filled: a small run costs only what it writes; arenas
        # are reused, so the first-touch page faults are paid once per arena
        final = torch.empty((rows, self.row_shape[1]), dtype=self.dtype) if self.final_row_bytes else None
        final_stat = torch.empty(rows, dtype=torch.float32) if self.final_row_bytes else None
        return (torch.empty((rows, *self.row_shape), dtype=self.dtype), final,
                torch.empty((rows, self.row_shape[0]), dtype=torch.float32), final_stat)

    def _take_buffer(self) -> "_Buffers":
        t0 = time.perf_counter()
        with self._cv:
            while True:
                self._raise_error()
                if self._free:
                    self._reserve_wait_s += time.perf_counter() - t0
                    return self._free.pop()
                if self._allocated < self.max_arenas or self._finishing == 0:
                    if self._allocated >= self.max_arenas:
                        log.warning("vllm-hidden: every shard arena waits on a prompt still in prefill; "
                                    "allocating arena %d", self._allocated + 1)
                    self._allocated += 1
                    break
                self._cv.wait()  # backpressure: a finished shard will hand its arena back
            self._reserve_wait_s += time.perf_counter() - t0
        return self._new_buffer(self.rows_per_shard)

    def _new_arena(self, bufs: "_Buffers", pooled: bool) -> _Arena:
        self._seq += 1
        a = _Arena(bufs, pooled, self.dir / f".{self.cfg.prefix}-{os.getpid()}-{self._seq}.tmp")
        self._open.append(a)
        return a

    # -- samples -----------------------------------------------------------------------
    def reserve(self, sample_id: Any, token_ids: Any, *, line: int | None = None,
                loss_spans: list[list[int]] | None = None, num_prompt: int | None = None,
                record: bytes | None = None) -> SampleSlot:
        self._raise_error()
        if self._closed:
            raise RuntimeError("the shard writer is closed")
        tok = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        n = tok.shape[0]
        if n < 1:
            raise ValueError(f"sample {sample_id!r} has no tokens")
        if self.cfg.loss_mask:
            if loss_spans is None:
                raise ValueError(f"sample {sample_id!r} has no loss mask, and this output stores one per sample")
            for span in loss_spans:
                if len(span) != 2 or not 0 <= span[0] < span[1] <= n:
                    raise ValueError(f"sample {sample_id!r}: loss span {span!r} is not within its {n} tokens")
        if self.cfg.generate != (num_prompt is not None) or (num_prompt is not None and not 0 < num_prompt <= n):
            raise ValueError(f"sample {sample_id!r}: prompt length {num_prompt!r} of {n} tokens "
                             f"(this output {'stores one' if self.cfg.generate else 'is prefill only'})")
        a = self._current
        entry = _entry_bytes(sample_id, a.rows if a is not None else 0, n, num_prompt)
        if _HEADER_FIXED + entry > self.header_room:
            raise ValueError(f"sample id {str(sample_id)[:80]!r}... is too long to index ({entry} bytes)")
        if n > self.rows_per_shard:  # larger than a shard: a shard of its own
            big = self._new_arena(self._new_buffer(n), pooled=False)
            slot = big.add(sample_id, tok, entry, line, loss_spans, num_prompt, record)
            big.sealed = True
            return slot
        if a is None or a.rows + n > self.rows_per_shard or _HEADER_FIXED + a.index_bytes + entry > self.header_room:
            self._current = None
            if a is not None:
                self._seal(a)
            a = self._current = self._new_arena(self._take_buffer(), pooled=True)
        return a.add(sample_id, tok, entry, line, loss_spans, num_prompt, record)

    def commit(self, slot: SampleSlot) -> None:
        if self.fp8 and not slot.placed and slot.src is None:
            raise ValueError(f"sample {slot.sample_id!r}: an fp8 output takes rows with their scales (place), "
                             "not values written into buf")
        self._resolve(slot, SampleSlot.COMMITTED)

    def drop(self, slot: SampleSlot) -> None:
        if slot.state == SampleSlot.RESERVED:
            slot.zero()  # its rows in the file stay unwritten (zeros): keep memory equal for the checksum
        self._resolve(slot, SampleSlot.DROPPED)

    def add(self, sample_id: Any, token_ids: torch.Tensor, hidden_states: torch.Tensor, *,
            final_hidden_states: torch.Tensor | None = None, loss_spans: list[list[int]] | None = None) -> None:
        """A whole sample at once, in the model's dtype (quantized here for an fp8 output)."""
        if tuple(hidden_states.shape[1:]) != self.row_shape or hidden_states.shape[0] != len(token_ids):
            raise ValueError(f"sample {sample_id!r}: hidden_states shape {tuple(hidden_states.shape)} does not "
                             f"match [{len(token_ids)}, {self.row_shape[0]}, {self.row_shape[1]}]")
        if (final_hidden_states is not None) != bool(self.final_row_bytes):
            raise ValueError(f"sample {sample_id!r}: final_hidden_states must be given exactly when the output "
                             f"stores them (final_state={self.cfg.final_state})")
        slot = self.reserve(sample_id, token_ids, loss_spans=loss_spans)
        rows = hidden_states if final_hidden_states is None else torch.cat([hidden_states, final_hidden_states[:, None]], 1)
        stat = torch.empty(rows.shape[:2], dtype=torch.float32)
        if self.fp8:
            values = torch.empty(rows.shape, dtype=quant.FP8)
            quant.quantize(rows, values, stat, torch.empty_like(stat))
            rows = values
        else:
            quant.row_amax(rows, stat)
        slot.place(0, rows, stat)
        self.commit(slot)

    def add_rows(self, sample_id: Any, token_ids: Any, rows: torch.Tensor, stat: torch.Tensor, *,
                 loss_spans: list[list[int]] | None, num_prompt: int, record: str, line: int | None = None) -> None:
        """A generated sample, rows [T, C, H] and statistics [T, C] as the capture ring holds
        them (the layers, then the final state's column if this output stores it), with its
        generation record."""
        k = self.row_shape[0]
        if rows.shape[1] != k + bool(self.final_row_bytes) or rows.shape[0] != len(token_ids):
            raise ValueError(f"sample {sample_id!r}: rows of shape {tuple(rows.shape)} for {len(token_ids)} tokens")
        slot = self.reserve(sample_id, token_ids, line=line, loss_spans=loss_spans, num_prompt=num_prompt,
                            record=record.encode())
        # the copy into the arena is the writer threads' (several at once), not the caller's: a
        # wave of responses ending together is GBs, and the caller is what the engine waits on
        slot.src, slot.src_stat = rows, stat
        self.commit(slot)

    def _resolve(self, slot: SampleSlot, state: int) -> None:
        if slot.state != SampleSlot.RESERVED:
            raise RuntimeError(f"sample {slot.sample_id!r} was already committed or dropped")
        slot.state = state
        a = slot.arena
        a.pending -= 1
        if state == SampleSlot.COMMITTED and slot.placed and slot.src is None:
            # the stats came with the rows: decided now
            why = slot_not_finite(slot, self.layer_ids)
            if why is not None:
                self._refuse(slot, why)
                state = SampleSlot.NOT_FINITE
        if state == SampleSlot.COMMITTED:
            a.batch.append(slot)
            a.batch_bytes += slot.buf.numel() * slot.buf.element_size()
            if a.batch_bytes >= _WRITE_BATCH:
                self._flush_batch(a)
        if a.sealed and a.pending == 0:
            self._finish(a)
        self._raise_error()

    def _seal(self, a: _Arena) -> None:
        a.sealed = True
        if a.pending == 0:
            self._finish(a)

    # -- files -------------------------------------------------------------------------
    def _flush_batch(self, a: _Arena) -> None:
        if a.batch:
            batch, size, a.batch, a.batch_bytes = a.batch, a.batch_bytes, [], 0
            with self._cv:
                self._unwritten += size
            a.writes.append(self._pool.submit(self._write_rows, a, batch, size))

    def _write_rows(self, a: _Arena, batch: list[SampleSlot], size: int) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = 0
            for s in batch:
                if s.src is not None or not s.placed:  # deferred: its statistics are made here
                    if s.src is not None:
                        s.place(0, s.src, s.src_stat)
                        s.src = s.src_stat = None
                    else:  # values written into buf by the caller: no statistics came with them
                        quant.row_amax(s.buf, s.stat)
                        if s.final is not None:
                            quant.row_amax(s.final[:, None], s.final_stat[:, None])
                    why = slot_not_finite(s, self.layer_ids)
                    if why is not None:
                        self._refuse(s, why)
                        continue
                s.digest = self._digest(s)
                mv = _raw(s.buf)
                offset = self.header_room + s.row * self.row_bytes
                _pwrite_all(a.fd, mv, offset)
                write_behind(a.fd, offset, len(mv))
                nbytes += len(mv)
            with self._cv:
                a.unsynced += nbytes
                sync = a.unsynced >= _SYNC_EVERY
                if sync:
                    a.unsynced = 0
            if sync:
                os.fdatasync(a.fd)
        finally:
            with self._cv:
                self._write_s += time.perf_counter() - t0
                self._unwritten -= size

    def _digest(self, s: SampleSlot) -> str:
        """Its per-sample checksum (files.SAMPLE_CHECKSUMS): the bytes _layout puts in the file, in file order."""
        parts = [s.buf, s.final, *((s.stat, s.final_stat) if self.fp8 else ()), s.token_ids.contiguous(),
                 s.mask() if self.cfg.loss_mask else None]
        return sample_digest(s.entry(self.cfg.generate), (_raw(t) for t in parts if t is not None))

    def _refuse(self, s: SampleSlot, why: str) -> None:
        """Never written: its rows stay zeros (file and memory), the index skips it."""
        s.zero()
        s.state = SampleSlot.NOT_FINITE
        with self._cv:
            self._not_finite.append([s.sample_id, s.line, why])
        log.warning("vllm-hidden: sample %r: %s", s.sample_id, why)

    def _finish(self, a: _Arena) -> None:
        self._open.remove(a)
        self._flush_batch(a)
        index = -1
        if any(s.state == SampleSlot.COMMITTED for s in a.slots):
            index = self._next_shard  # names follow the order shards are sealed
            self._next_shard += 1
        with self._cv:
            self._finishing += 1
        self._futures.append(self._pool.submit(self._finish_file, a, index))

    def _layout(self, a: _Arena, done: list[SampleSlot]) -> tuple[bytes, list[tuple[str, torch.Tensor]], dict, int]:
        """The file around the streamed-out rows: the padded header, the tensors after
        `hidden_states` in file order, their entries, and the tensor data's size."""
        rows = a.rows
        hs_bytes = rows * self.row_bytes
        tokens = torch.zeros(rows, dtype=torch.int64)
        mask = torch.zeros(rows, dtype=torch.uint8) if self.cfg.loss_mask else None
        for s in done:
            tokens[s.row : s.row + s.token_ids.shape[0]] = s.token_ids
            if mask is not None:
                mask[s.row : s.row + s.token_ids.shape[0]] = s.mask()
        gens = None
        if self.cfg.generate:
            gens = torch.frombuffer(bytearray(b"".join(s.record for s in done)), dtype=torch.uint8)
        scales = [("hidden_states_scale", a.stat[:rows]),
                  ("final_hidden_states_scale", a.final_stat[:rows] if a.final_stat is not None else None)]
        tail = [("final_hidden_states", a.final[:rows] if a.final is not None else None),
                *(scales if self.fp8 else []), ("token_ids", tokens), ("loss_mask", mask), ("generations", gens)]
        tail = [(name, t) for name, t in tail if t is not None]
        listed = [s.entry(gens is not None) for s in done]
        meta = {"format": FORMAT, "layer_ids": json.dumps(self.layer_ids), "samples": json.dumps(listed),
                SAMPLE_CHECKSUMS: json.dumps([s.digest for s in done])}
        entries = {"hidden_states": {"dtype": _ST_DTYPES[self.dtype], "shape": [rows, *self.row_shape],
                                     "data_offsets": [0, hs_bytes]}}
        end = hs_bytes
        for name, t in tail:
            nbytes = t.numel() * t.element_size()
            entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [end, end + nbytes]}
            end += nbytes
        header = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
        if len(header) > self.header_room - 8:
            raise RuntimeError(f"shard header of {len(header)} bytes overflows its {self.header_room - 8} reserved")
        head = struct.pack("<Q", self.header_room - 8) + header + b" " * (self.header_room - 8 - len(header))
        return head, tail, entries, end

    def _finish_file(self, a: _Arena, index: int) -> None:
        """Runs after the arena's row writes were queued (so they run or are done). The header
        waits for them (they make the samples' checksums); the file's BLAKE3 is then computed
        from memory, beside the fsync rather than after it."""
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        h = hasher()
        failed: list[BaseException] = []
        hashing: threading.Thread | None = None

        def start_hash(head: bytes, tail: list[tuple[str, torch.Tensor]]) -> threading.Thread:
            def digest() -> None:
                t = time.perf_counter()
                try:
                    for part in (memoryview(head), _raw(a.buf[: a.rows]), *(_raw(x) for _, x in tail)):
                        h.update(part)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    failed.append(e)
                phases["hash_s"] = time.perf_counter() - t

            th = threading.Thread(target=digest, name="vllm-hidden-hash")
            th.start()
            return th

        try:
            try:
                wait(a.writes)  # all of them, even if one failed: none may still touch fd or buffer below
            finally:
                phases["wait_writes_s"] = time.perf_counter() - t0
            for w in a.writes:
                w.result()
            done = [s for s in a.slots if s.state == SampleSlot.COMMITTED]
            if index < 0 or not done:  # nothing to keep (every sample dropped or not finite)
                os.close(a.fd)
                a.fd = -1
                a.tmp.unlink()
                return
            head, tail, entries, end = self._layout(a, done)
            hashing = start_hash(head, tail)
            for name, t in tail:
                _pwrite_all(a.fd, _raw(t), self.header_room + entries[name]["data_offsets"][0])
            _pwrite_all(a.fd, memoryview(head), 0)
            t1 = time.perf_counter()
            os.fsync(a.fd)
            phases["fsync_s"] = time.perf_counter() - t1
            hashing.join()
            if failed:
                raise failed[0]
            t1 = time.perf_counter()
            os.close(a.fd)
            a.fd = -1
            name = shard_file(index, self.cfg.prefix)
            os.replace(a.tmp, self.dir / name)
            fsync_dir(self.dir)  # the rename is durable...
            info = ShardInfo(file=name, bytes=self.header_room + end, blake3=h.hexdigest(),
                             num_samples=len(done), num_tokens=sum(int(s.token_ids.shape[0]) for s in done))
            self._journal.record(info)  # ...before its samples count as done
            phases["rename_s"] = time.perf_counter() - t1
            with self._cv:
                self._shards.append((index, info))
            if self._uploader is not None:
                self._uploader.submit(self.dir / name, info)  # waits while too many are uploading
        except BaseException as e:  # noqa: BLE001 - surfaced to the assembler thread
            log.exception("vllm-hidden: writing a shard failed")
            with self._cv:
                if self._error is None:
                    self._error = e
        finally:
            wait(a.writes)  # on every path: none may still use fd or buffer
            if hashing is not None:
                hashing.join()  # it reads the arena, which goes back to the pool below
            if a.fd >= 0:
                os.close(a.fd)
                a.fd = -1
            a.tmp.unlink(missing_ok=True)  # renamed already if it succeeded
            with self._cv:
                self._finishing -= 1
                self._write_s += time.perf_counter() - t0
                if self._closed:
                    phases["finish_s"] = time.perf_counter() - t0
                    for k, v in phases.items():
                        self._tail[k] = max(self._tail.get(k, 0.0), v)
                if a.pooled:
                    self._free.append(a.bufs)
                self._cv.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise OSError(f"writing a shard to {str(self.dir)!r} failed: {self._error!r}") from self._error

    def stats(self) -> dict[str, Any]:
        with self._cv:
            d = {"writer_threads": self.cfg.writer_threads, "arenas": self._allocated,
                 "writer_busy_s": round(self._write_s, 3), "arena_wait_s": round(self._reserve_wait_s, 3),
                 "writer_close_s": round(self._close_s, 4), "close_unwritten_bytes": self._close_unwritten,
                 "writer_close_phases": {k: round(v, 4) for k, v in sorted(self._tail.items())}}
        if self._uploader is not None:
            d.update(upload_busy_s=round(self._uploader.busy_s, 3), uploaded_bytes=self._uploader.bytes)
        return d

    @property
    def not_finite(self) -> list[list[Any]]:
        """[sample id, input line, reason] of every sample refused for NaN/Inf so far."""
        with self._cv:
            return [list(x) for x in self._not_finite]

    @property
    def shards(self) -> list[ShardInfo]:
        with self._cv:
            return [info for _, info in sorted(self._shards, key=lambda x: x[0])]

    def close(self) -> list[ShardInfo]:
        """Finish every shard (samples still reserved, never completed, are left out), wait
        for every write, return all shards in order."""
        if not self._closed:
            t0 = time.perf_counter()
            with self._cv:
                self._closed = True
                self._close_unwritten = self._unwritten + sum(a.batch_bytes for a in self._open)
            self._current = None
            for a in list(self._open):
                for s in a.slots:
                    if s.state == SampleSlot.RESERVED:
                        s.zero()
                        s.state = SampleSlot.DROPPED
                        a.pending -= 1
                self._seal(a)
            for f in list(self._futures):
                f.exception()  # wait; errors were recorded where they happened
            self._pool.shutdown(wait=True)
            self._journal.close()
            self._close_s = time.perf_counter() - t0
        uploaded = None
        if self._uploader is not None:
            try:
                uploaded = self._uploader.close()  # only what S3 confirmed counts as written
            except BaseException:
                if self._error is None:
                    raise
        self._raise_error()  # a write failure first: the upload failure may only follow from it
        return uploaded if uploaded is not None else self.shards
