"""One shard in the making: its rows in a preallocated host arena laid out as the shard's
tensors, the slots samples fill, its temporary file, and the file's layout around the rows.

The assembler copies each sample's rows from the pinned ring straight into its slot (no
concatenation, no serialize-to-bytes); writer threads `pwrite` completed slots to their final
offsets behind room reserved for the header (`format.shard.header_room`). Only `hidden_states`
is streamed out as samples complete; the smaller tensors after it, whose offsets depend on
the shard's final row count, are laid out (`Arena.layout`) and written when it is finished
(`commit.commit_shard`).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from vllm_hidden.capture.records import Rows
from vllm_hidden.format import header as st
from vllm_hidden.format import quant
from vllm_hidden.format.shard import (
    FINAL,
    FINAL_SCALE,
    GENERATIONS,
    HIDDEN,
    HIDDEN_SCALE,
    LOSS_MASK,
    TOKENS,
    index_entry,
    sample_digest,
    shard_metadata,
)
from vllm_hidden.format.stats import ColumnStats

# an arena's tensors: values [R, K, H], final state [R, H] | None, their statistics [R, K] and [R] | None,
# and the rows' sums as the ring brings them [R, 2, K (+1 with the final state)] | None (not stored)
Buffers = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


def new_buffers(rows: int, row_shape: tuple[int, int], dtype: torch.dtype, final: bool,
                row_sums: bool = False) -> Buffers:
    """An arena's tensors for `rows` rows. Untouched until rows are filled: a small run costs
    only what it writes; arenas are reused, so the first-touch page faults are paid once."""
    k, h = row_shape
    return (torch.empty((rows, k, h), dtype=dtype), torch.empty((rows, h), dtype=dtype) if final else None,
            torch.empty((rows, k), dtype=torch.float32), torch.empty(rows, dtype=torch.float32) if final else None,
            torch.empty((rows, 2, k + final), dtype=torch.float32) if row_sums else None)


def raw(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without a copy."""
    if not t.is_contiguous():
        raise ValueError(f"shard parts must be contiguous, got strides {t.stride()}")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class SampleSlot:
    """Rows reserved for one sample; the assembler fills them (`place`), then commits: `buf`
    [T, K, H], `final` [T, H] (--final-state), and their per-row statistics `row_scale` [T, K] and
    `final_scale` [T] (float32: the amax, or with fp8 values the scale; see format.quant), and
    when the ring brings them the rows' sums `row_sums` [T, 2, C] (`has_row_sums`)."""

    __slots__ = ("arena", "sample_id", "token_ids", "row", "buf", "final", "row_scale", "final_scale", "state", "line",
                 "loss_spans", "num_prompt", "record", "pending", "pending_done", "placed", "digest", "row_sums",
                 "has_row_sums")
    # NOT_FINITE: committed, then refused by its writer thread (NaN/Inf); left out like DROPPED
    RESERVED, COMMITTED, DROPPED, NOT_FINITE = 0, 1, 2, 3

    def __init__(self, arena: "Arena", sample_id: Any, token_ids: torch.Tensor, row: int,
                 line: int | None = None, loss_spans: list[list[int]] | None = None,
                 num_prompt: int | None = None, record: bytes | None = None) -> None:
        self.arena = arena
        self.num_prompt = num_prompt
        self.record = record
        self.pending: Rows | None = None  # rows its writer thread places (add_rows)
        self.pending_done: Any = None  # called once `pending` is copied in (add_rows' `done`)
        self.sample_id = sample_id
        self.token_ids = token_ids
        self.row = row
        n = token_ids.shape[0]
        self.buf = arena.buf[row : row + n]
        self.final = arena.final[row : row + n] if arena.final is not None else None
        self.row_scale = arena.row_scale[row : row + n]
        self.final_scale = arena.final_scale[row : row + n] if arena.final_scale is not None else None
        self.row_sums = arena.row_sums[row : row + n] if arena.row_sums is not None else None
        self.has_row_sums = False  # every placed row came with its sums
        self.state = SampleSlot.RESERVED
        self.placed = False  # rows came through `place`, with their statistics
        self.line = line
        self.loss_spans = loss_spans
        self.digest: str | None = None  # its per-sample checksum, made by the writer thread that writes it

    def entry(self, generate: bool) -> list[Any]:
        """Its shard index entry."""
        return index_entry(self.sample_id, self.row, int(self.token_ids.shape[0]),
                           self.num_prompt if generate else None)

    def checksum(self) -> str:
        """Its per-sample checksum, which its writer thread made before the shard's header is."""
        if self.digest is None:
            raise RuntimeError(f"sample {self.sample_id!r} reached its shard's header without its checksum")
        return self.digest

    def mask(self) -> torch.Tensor:
        """Its loss mask rows, uint8 [T], from its spans."""
        m = torch.zeros(self.token_ids.shape[0], dtype=torch.uint8)
        for lo, hi in self.loss_spans or ():
            m[lo:hi] = 1
        return m

    def place(self, pos: int, rows: Rows) -> None:
        """Rows [pos, pos + n) as the ring holds them, the last column the final state's when
        this output stores it (kept apart); their sums kept only where this arena has room."""
        n, values, row_scale, sums = len(rows), rows.values, rows.row_scale, rows.row_sums
        # the first placement decides; a later one without sums means the host reduces them all
        self.has_row_sums = (sums is not None and self.row_sums is not None
                             and (self.has_row_sums or not self.placed))
        if sums is not None and self.row_sums is not None and self.has_row_sums:
            self.row_sums[pos : pos + n].copy_(sums)
        self.placed = True
        final, final_scale = self.final, self.final_scale  # (both or neither)
        if final is None or final_scale is None:
            self.buf[pos : pos + n].copy_(values)
            self.row_scale[pos : pos + n].copy_(row_scale)
        else:
            self.buf[pos : pos + n].copy_(values[:, :-1])
            final[pos : pos + n].copy_(values[:, -1])
            self.row_scale[pos : pos + n].copy_(row_scale[:, :-1])
            final_scale[pos : pos + n].copy_(row_scale[:, -1])

    @property
    def settled(self) -> bool:
        """Its rows are in the arena with their row_scale (placed, nothing pending)."""
        return self.placed and self.pending is None

    def settle(self) -> None:
        """A writer thread's copy-in: the rows `add_rows` left pending placed (then the caller's
        buffer given back), or, for values the caller wrote into `buf`, their row_scale made."""
        if self.pending is not None:
            rows, done, self.pending, self.pending_done = self.pending, self.pending_done, None, None
            self.place(0, rows)
            if done is not None:
                done()  # the caller's buffer is free: it is not read again
        elif not self.placed:
            quant.row_amax(self.buf, self.row_scale)
            if self.final is not None and self.final_scale is not None:
                quant.row_amax(self.final[:, None], self.final_scale[:, None])

    def zero(self) -> None:
        for t in (self.buf, self.final, self.row_scale, self.final_scale):
            if t is not None:
                t.zero_()

    def not_finite(self, layer_ids: list[int]) -> str | None:
        """From the rows' statistics ([T, K] floats, computed beside the gather): the states
        themselves are read only for a sample that has a non-finite row, to say where."""
        final = self.final_scale
        if bool(torch.isfinite(self.row_scale).all()) and (final is None or bool(torch.isfinite(final).all())):
            return None
        if self.buf.dtype == quant.FP8:  # the values are the quantized ones: the scales say where
            scales = self.row_scale if final is None else torch.cat([self.row_scale, final[:, None]], dim=1)
            return quant.not_finite(scales[:, :, None], [*layer_ids, *(["final"] if final is not None else [])],
                                    what="(token, layer) rows")
        why = quant.not_finite(self.buf, layer_ids)
        if why is None and self.final is not None:
            why = quant.not_finite(self.final[:, None], ["final"])
        return why


class Arena:
    """One shard in the making: its rows in memory, its temporary file, its pending writes."""

    __slots__ = ("bufs", "buf", "final", "row_scale", "final_scale", "row_sums", "rows", "slots", "pending", "sealed",
                 "pooled", "tmp", "fd", "index_bytes", "batch", "batch_bytes", "writes", "unsynced", "stats")

    def __init__(self, bufs: Buffers, pooled: bool, tmp: Path) -> None:
        self.bufs = bufs
        self.buf, self.final, self.row_scale, self.final_scale, self.row_sums = bufs
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
        self.stats: ColumnStats | None = None  # its written rows' statistics, summed by the writer threads

    def add(self, sample_id: Any, token_ids: torch.Tensor, entry_bytes: int, line: int | None = None,
            loss_spans: list[list[int]] | None = None, num_prompt: int | None = None,
            record: bytes | None = None) -> SampleSlot:
        slot = SampleSlot(self, sample_id, token_ids, self.rows, line, loss_spans, num_prompt, record)
        self.rows += token_ids.shape[0]
        self.slots.append(slot)
        self.pending += 1
        self.index_bytes += entry_bytes
        return slot

    def committed(self) -> list[SampleSlot]:
        return [s for s in self.slots if s.state == SampleSlot.COMMITTED]

    def close_file(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def sample_checksum(s: SampleSlot, *, fp8: bool, loss_mask: bool, generate: bool) -> str:
    """A slot's per-sample checksum (format.shard.SAMPLE_CHECKSUMS): its entry, then the bytes
    `layout` puts in the file, in file order."""
    parts = [s.buf, s.final, *((s.row_scale, s.final_scale) if fp8 else ()), s.token_ids.contiguous(),
             s.mask() if loss_mask else None]
    return sample_digest(s.entry(generate), (raw(t) for t in parts if t is not None))


def layout(a: Arena, done: list[SampleSlot], layer_ids: list[int], *, room: int, fp8: bool, loss_mask: bool,
           generate: bool, stats: dict[str, Any] | None = None) -> tuple[bytes, list[tuple[str, torch.Tensor]],
                                                                           dict[str, Any], int]:
    """The file around the streamed-out rows of `done` (the committed slots): the padded
    header (`room` bytes, with the shard's statistics `stats` if any), the tensors after
    `hidden_states` in file order, their header entries, and the tensor data's size."""
    rows = a.rows
    tokens = torch.zeros(rows, dtype=torch.int64)
    mask = torch.zeros(rows, dtype=torch.uint8) if loss_mask else None
    for s in done:
        tokens[s.row : s.row + s.token_ids.shape[0]] = s.token_ids
        if mask is not None:
            mask[s.row : s.row + s.token_ids.shape[0]] = s.mask()
    gens = torch.frombuffer(bytearray(b"".join(s.record or b"" for s in done)), dtype=torch.uint8) if generate else None
    scales = [(HIDDEN_SCALE, a.row_scale[:rows]),
              (FINAL_SCALE, a.final_scale[:rows] if a.final_scale is not None else None)]
    tail = [(FINAL, a.final[:rows] if a.final is not None else None), *(scales if fp8 else []), (TOKENS, tokens),
            (LOSS_MASK, mask), (GENERATIONS, gens)]
    tail = [(name, t) for name, t in tail if t is not None]
    entries, end = st.entries([(HIDDEN, a.buf.dtype, [rows, *a.buf.shape[1:]]),
                               *((name, t.dtype, t.shape) for name, t in tail)])
    meta = shard_metadata(layer_ids, [s.entry(generate) for s in done], [s.checksum() for s in done], stats)
    return st.build_header(entries, meta, room=room), tail, entries, end
