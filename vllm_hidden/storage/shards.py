"""Shard writer: many samples per safetensors file, rolled at a size limit, streamed to disk
while the run goes on, by a pool of threads.

Samples are assembled in place, in arenas (`arena.py`: one per shard being filled or
finished, reused); completed samples are written to their final offsets as they complete,
and synced every so often. When an arena is full and its last sample complete, only the
header (index, shapes) and token ids are left to write, then the commit (`commit.py`: fsync,
BLAKE3 from memory, rename), then the journal records it. So the end of a run waits for the
last few samples, not for a whole shard. What a shard holds is `format.shard`.

The writer threads also sum each written sample's per-layer statistics into its arena
(`format.stats`): from the row sums the device made beside the gather (`capture.ring`), a few
floats per row, or, for rows that came without them, from the rows while they are in memory;
the shard's header and record carry them.

The pool of arenas bounds host memory: when every arena is full or being finished,
`reserve` blocks, the assembler stops taking steps, and the engine waits on the capture
ring (backpressure instead of growth).

The writer is the extract run's sink (`capture.records.Sink`), and a context manager: leaving
the block closes it (`close`), also when the block raised.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from vllm_hidden.capture.records import Rows, Sink
from vllm_hidden.config import ShardConfig
from vllm_hidden.format import quant
from vllm_hidden.format import stats as layer_stats
from vllm_hidden.format.header import DTYPE_NAMES
from vllm_hidden.format.shard import HEADER_FIXED, ShardInfo, entry_header_bytes, header_room, index_entry, shard_file
from vllm_hidden.storage.arena import Arena, Buffers, SampleSlot, layout, new_buffers, pwrite_all, raw, sample_checksum
from vllm_hidden.storage.commit import commit_shard
from vllm_hidden.storage.files import write_behind

log = logging.getLogger("vllm_hidden")

_WRITE_BATCH = 32 << 20  # completed rows handed to a writer thread in batches of this size
_SYNC_EVERY = 256 << 20  # fdatasync as data accumulates, so the final fsync has little left


class ShardWriter(Sink):
    """reserve() -> slot.place(pos, rows) (or fill slot.buf) -> commit() (or drop()), or a whole
    sample at once: add() (the model's dtype) or add_rows() (the ring's rows, --generate).
    close() finishes what is left and returns every shard written; so does leaving a with-block,
    where on an exception the block's exception is raised, not close's (see `Sink.__exit__`).
    reserve/commit/drop/add/add_rows are called from one thread (the assembler); files are
    written by `cfg.writer_threads` threads."""

    def __init__(self, cfg: ShardConfig, layer_ids: list[int], hidden_size: int, dtype: torch.dtype) -> None:
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be positive, got {hidden_size!r}")
        if dtype not in DTYPE_NAMES:
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
        self.columns = layer_stats.column_names(self.layer_ids, cfg.final_state) if cfg.layer_stats else None
        # header bytes besides the index: the fixed part, and room for the statistics
        self.header_fixed = HEADER_FIXED + (layer_stats.header_bytes(len(self.columns)) if self.columns else 0)
        self.header_room = header_room(self.rows_per_shard, self.header_fixed - HEADER_FIXED)
        self._row_sums = threading.local()  # each writer thread's scratch for the statistics
        # one arena being filled + one per writer thread; more only when every other arena
        # waits for a sample still in prefill (chunked prompts), never while one is finishing
        self.max_arenas = cfg.writer_threads + 1
        self._pool = ThreadPoolExecutor(cfg.writer_threads, thread_name_prefix="vllm-hidden-writer")
        self._cv = threading.Condition()
        self._free: list[Buffers] = []
        self._allocated = 0
        self._finishing = 0
        self._futures: list[Future] = []
        self._current: Arena | None = None
        self._open: list[Arena] = []  # not yet handed over to be finished
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
        self._stats_s = 0.0  # of which making the statistics
        self._reserve_wait_s = 0.0  # assembler blocked on a free arena (backpressure)
        self._close_s = 0.0
        self._unwritten = 0  # bytes of committed rows handed to the writer threads, not yet written
        self._close_unwritten = 0  # ...when close() began: what the end of a run had left to write
        self._tail: dict[str, float] = {}  # the slowest phases of the shards finished by close(): the end of a run

    # -- arenas ------------------------------------------------------------------------
    def _new_buffer(self, rows: int) -> Buffers:
        return new_buffers(rows, self.row_shape, self.dtype, bool(self.final_row_bytes), self.columns is not None)

    def _take_buffer(self) -> Buffers:
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

    def _new_arena(self, bufs: Buffers, pooled: bool) -> Arena:
        self._seq += 1
        a = Arena(bufs, pooled, self.dir / f".{self.cfg.prefix}-{os.getpid()}-{self._seq}.tmp")
        if self.columns is not None:
            a.stats = layer_stats.ColumnStats(len(self.columns))
        self._open.append(a)
        return a

    # -- samples -----------------------------------------------------------------------
    def reserve(self, sample_id: Any, token_ids: Any, *, rows: int | None = None, line: int | None = None,
                loss_spans: list[list[int]] | None = None, num_prompt: int | None = None,
                record: bytes | None = None) -> SampleSlot:
        """A slot of one row per token id, in the arena being filled (one of its own if larger
        than a shard). `num_prompt` and `record`: a generated sample's (add_rows)."""
        if rows is not None:
            # A shard's index gives each sample its length when it is reserved, one row per token
            # id; open-ended capture (the server's) only knows it when the request finishes.
            raise ValueError(f"sample {sample_id!r}: rows={rows!r}: the shard writer takes no open-ended capture; "
                             "its samples have one row per token id")
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
        entry = entry_header_bytes(index_entry(sample_id, a.rows if a is not None else 0, n, num_prompt))
        if self.header_fixed + entry > self.header_room:
            raise ValueError(f"sample id {str(sample_id)[:80]!r}... is too long to index ({entry} bytes)")
        if n > self.rows_per_shard:  # larger than a shard: a shard of its own
            big = self._new_arena(self._new_buffer(n), pooled=False)
            slot = big.add(sample_id, tok, entry, line, loss_spans, num_prompt, record)
            big.sealed = True
            return slot
        if (a is None or a.rows + n > self.rows_per_shard
                or self.header_fixed + a.index_bytes + entry > self.header_room):
            self._current = None
            if a is not None:
                self._seal(a)
            a = self._current = self._new_arena(self._take_buffer(), pooled=True)
        return a.add(sample_id, tok, entry, line, loss_spans, num_prompt, record)

    def commit(self, slot: SampleSlot) -> None:
        if self.fp8 and not slot.placed and slot.pending is None:
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
        values = (hidden_states if final_hidden_states is None
                  else torch.cat([hidden_states, final_hidden_states[:, None]], 1))
        slot.place(0, Rows.measured(values, self.fp8))
        self.commit(slot)

    def add_rows(self, sample_id: Any, token_ids: Any, rows: Rows, *, loss_spans: list[list[int]] | None,
                 num_prompt: int, record: str, line: int | None = None,
                 done: Callable[[], None] | None = None) -> None:
        """A generated sample, its rows as the capture ring holds them (the layers, then the
        final state's column if this output stores it), with its generation record."""
        k, shape = self.row_shape[0], tuple(rows.values.shape)
        if shape[1] != k + bool(self.final_row_bytes) or shape[0] != len(token_ids):
            raise ValueError(f"sample {sample_id!r}: rows of shape {shape} for {len(token_ids)} tokens")
        slot = self.reserve(sample_id, token_ids, line=line, loss_spans=loss_spans, num_prompt=num_prompt,
                            record=record.encode())
        # the copy into the arena is the writer threads' (several at once), not the caller's: a
        # wave of responses ending together is GBs, and the caller is what the engine waits on
        slot.pending, slot.pending_done = rows, done
        self.commit(slot)

    def _resolve(self, slot: SampleSlot, state: int) -> None:
        if slot.state != SampleSlot.RESERVED:
            raise RuntimeError(f"sample {slot.sample_id!r} was already committed or dropped")
        slot.state = state
        a = slot.arena
        a.pending -= 1
        if state == SampleSlot.COMMITTED and slot.settled:
            # the stats came with the rows: decided now
            why = slot.not_finite(self.layer_ids)
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

    def _seal(self, a: Arena) -> None:
        a.sealed = True
        if a.pending == 0:
            self._finish(a)

    # -- files -------------------------------------------------------------------------
    def _flush_batch(self, a: Arena) -> None:
        if a.batch:
            batch, size, a.batch, a.batch_bytes = a.batch, a.batch_bytes, [], 0
            with self._cv:
                self._unwritten += size
            a.writes.append(self._pool.submit(self._write_rows, a, batch, size))

    def _sums(self) -> layer_stats.RowSums:
        """This writer thread's scratch for the statistics (kept: a fresh one per batch would
        page-fault its way in each time)."""
        sums = getattr(self._row_sums, "sums", None)
        if sums is None:
            sums = self._row_sums.sums = layer_stats.RowSums(self.row_shape[0] * self.row_shape[1], self.fp8)
        return sums

    def _write_rows(self, a: Arena, batch: list[SampleSlot], size: int) -> None:
        t0 = time.perf_counter()
        stats_s = 0.0
        try:
            nbytes = 0
            cols = self.columns
            acc = layer_stats.ColumnStats(len(cols)) if a.stats is not None and cols is not None else None
            summed: list[SampleSlot] = []  # written, with the device's row sums
            for s in batch:  # copy in, check, checksum, write, accumulate
                if not s.settled:  # its copy-in is this thread's (add_rows, or values written into buf)
                    s.settle()
                    why = s.not_finite(self.layer_ids)
                    if why is not None:
                        self._refuse(s, why)
                        continue
                s.digest = sample_checksum(s, fp8=self.fp8, loss_mask=self.cfg.loss_mask, generate=self.cfg.generate)
                mv = raw(s.buf)
                offset = self.header_room + s.row * self.row_bytes
                pwrite_all(a.fd, mv, offset)
                write_behind(a.fd, offset, len(mv))
                nbytes += len(mv)
                if acc is not None and s.has_row_sums:
                    summed.append(s)
                elif acc is not None:
                    t1 = time.perf_counter()
                    acc.add_sample(self._sums(), s.buf, s.row_scale, s.final, s.final_scale)
                    stats_s += time.perf_counter() - t1
            # the device's row sums of the whole batch at once: a few ops, not a few per sample
            if summed and acc is not None:
                t1 = time.perf_counter()
                acc.add_summed(torch.cat([s.row_sums for s in summed]), torch.cat([s.row_scale for s in summed]),
                               torch.cat([s.final_scale for s in summed]) if self.final_row_bytes else None,
                               self.row_shape[1], self.fp8)
                stats_s += time.perf_counter() - t1
            with self._cv:
                if acc is not None and a.stats is not None:
                    a.stats.merge(acc)
                a.unsynced += nbytes
                sync = a.unsynced >= _SYNC_EVERY
                if sync:
                    a.unsynced = 0
            if sync:
                os.fdatasync(a.fd)
        finally:
            with self._cv:
                self._write_s += time.perf_counter() - t0
                self._stats_s += stats_s
                self._unwritten -= size

    def _refuse(self, s: SampleSlot, why: str) -> None:
        """Never written: its rows stay zeros (file and memory), the index skips it; its
        non-finite rows are counted in the statistics first."""
        with self._cv:
            if s.arena.stats is not None:
                s.arena.stats.add_not_finite(s.row_scale, s.final_scale)
        s.zero()
        s.state = SampleSlot.NOT_FINITE
        with self._cv:
            self._not_finite.append([s.sample_id, s.line, why])
        log.warning("vllm-hidden: sample %r: %s", s.sample_id, why)

    def _finish(self, a: Arena) -> None:
        self._open.remove(a)
        self._flush_batch(a)
        index = -1
        if any(s.state == SampleSlot.COMMITTED for s in a.slots):
            index = self._next_shard  # names follow the order shards are sealed
            self._next_shard += 1
        with self._cv:
            self._finishing += 1
        self._futures.append(self._pool.submit(self._finish_file, a, index))

    def _finish_file(self, a: Arena, index: int) -> None:
        """Runs after the arena's row writes were queued (so they run or are done). The header
        waits for them (they make the samples' checksums)."""
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        try:
            try:
                wait(a.writes)  # all of them, even if one failed: none may still touch fd or buffer below
            finally:
                phases["wait_writes_s"] = time.perf_counter() - t0
            for w in a.writes:
                w.result()
            done = a.committed()
            if index >= 0 and done:  # else nothing to keep (every sample dropped or not finite)
                cols = self.columns
                stats = a.stats.record(cols) if a.stats is not None and cols is not None else None
                head, tail, entries, end = layout(a, done, self.layer_ids, room=self.header_room, fp8=self.fp8,
                                                  loss_mask=self.cfg.loss_mask, generate=self.cfg.generate,
                                                  stats=stats)
                info = commit_shard(a, done, head, tail, entries, end, self.dir, shard_file(index, self.cfg.prefix),
                                    phases)
                info = replace(info, stats=stats)
                t1 = time.perf_counter()
                self._journal.record(info)  # ...durable: its samples count as done
                phases["rename_s"] += time.perf_counter() - t1
                with self._cv:
                    self._shards.append((index, info))
                if self._uploader is not None:
                    self._uploader.submit(self.dir / info.file, info)  # waits while too many are uploading
        except BaseException as e:  # noqa: BLE001 - surfaced to the assembler thread
            log.exception("vllm-hidden: writing a shard failed")
            with self._cv:
                if self._error is None:
                    self._error = e
        finally:
            wait(a.writes)  # on every path: none may still use fd or buffer
            a.close_file()
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

    def counters(self) -> dict[str, Any]:
        with self._cv:
            d = {"writer_threads": self.cfg.writer_threads, "arenas": self._allocated,
                 "writer_busy_s": round(self._write_s, 3), "writer_stats_s": round(self._stats_s, 3),
                 "arena_wait_s": round(self._reserve_wait_s, 3),
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
