"""Staging memory for `extract --generate`: a generating request's rows wait in a range of a
large host slab until the driver says where its response ends (capture.assembler). The pool
keeps slabs for the next requests, up to a cap, so that a decode step places its rows with a
few copies per slab and fresh pages are not faulted in on the assembler's thread."""

from __future__ import annotations

import threading

import torch

from vllm_hidden.capture.records import Rows


class Slab:
    """One allocation that staging buffers are ranges of: values [S, C, H], statistics [S, C]
    and, when the ring has them, row sums [S, 2, C]. A decode step's rows of every generating
    request in the slab are placed with one scatter per tensor (`Assembler._place_generated`)."""

    __slots__ = ("buf", "row_scale", "row_sums", "words", "rows", "used", "live", "nbytes")

    def __init__(self, rows: int, host: torch.Tensor, host_row_scale: torch.Tensor,
                 row_sums: torch.Tensor | None) -> None:
        self.buf = torch.empty((rows, *host.shape[1:]), dtype=host.dtype)
        self.row_scale = torch.empty((rows, host_row_scale.shape[1]), dtype=host_row_scale.dtype)
        self.row_sums = None if row_sums is None else torch.empty((rows, *row_sums.shape[1:]), dtype=row_sums.dtype)
        self.words = words(self.buf)
        self.rows = rows
        self.used = 0  # rows [0, used) were cut into ranges since the slab was last empty
        self.live = 0  # ranges handed out and not given back
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.buf, self.row_scale, self.row_sums)
                          if t is not None)


def words(values: torch.Tensor) -> torch.Tensor:
    """Rows of values [n, C, H] (a view, also of the ring's strided rows) as 4-byte words
    [n, C*H*size/4]: the scatter copies element by element, and wider elements are fewer (the
    ring keeps each row's values a multiple of 4 bytes)."""
    return values.view(values.shape[0], -1).view(torch.int32)


class Staged:
    """A generating request's rows [rows, C, H], statistics [rows, C] and, when the ring has
    them, row sums [rows, 2, C] (C: the ring's columns, the final state's included, as
    `Sink.add_rows` takes them), until its end is known: rows [offset, offset + rows) of a slab."""

    __slots__ = ("slab", "offset", "rows", "buf", "row_scale", "row_sums")

    def __init__(self, slab: Slab, offset: int, rows: int) -> None:
        self.slab, self.offset, self.rows = slab, offset, rows
        sel = slice(offset, offset + rows)
        self.buf = slab.buf[sel]
        self.row_scale = slab.row_scale[sel]
        self.row_sums = None if slab.row_sums is None else slab.row_sums[sel]

    def place(self, pos: int, rows: Rows) -> None:
        n = len(rows)
        self.buf[pos : pos + n].copy_(rows.values)
        self.row_scale[pos : pos + n].copy_(rows.row_scale)
        if self.row_sums is not None:
            self.row_sums[pos : pos + n].copy_(rows.row_sums)

    def first(self, n: int) -> Rows:
        """Its first `n` rows (views of the slab)."""
        return Rows(self.buf, self.row_scale, self.row_sums)[:n]


class StagePool:
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
        self._slabs: list[Slab] = []
        self._cur: Slab | None = None  # where new ranges are cut from
        self._free: dict[int, list[Staged]] = {}  # ranges given back, by size, in slabs still in use
        self._bytes = 0  # of the slabs held
        self._lock = threading.Lock()

    def take(self, rows: int, host: torch.Tensor, host_row_scale: torch.Tensor,
             row_sums: torch.Tensor | None) -> Staged:
        n = -(-rows // self.GRAIN) * self.GRAIN
        with self._lock:
            kept = self._free.get(n)
            s = kept.pop() if kept else self._cut(n, host, host_row_scale, row_sums)
            s.slab.live += 1
            return s

    def _cut(self, n: int, host: torch.Tensor, host_row_scale: torch.Tensor, row_sums: torch.Tensor | None) -> Staged:
        cur = self._cur
        if cur is None or cur.used + n > cur.rows:  # the rest of the current slab is left until it is empty
            cur = next((s for s in self._slabs if s.live == 0 and s.rows >= n), None)
            if cur is None:
                larger = [k for k, kept in self._free.items() if k > n and kept]
                if larger:  # memory held anyway, rather than more
                    return self._free[min(larger)].pop()
                row_bytes = sum(t[0].numel() * t.element_size() for t in (host, host_row_scale, row_sums)
                                if t is not None)
                per_slab = -(-self.slab_bytes // row_bytes // self.GRAIN) * self.GRAIN
                cur = Slab(max(per_slab, n), host, host_row_scale, row_sums)
                self._slabs.append(cur)
                self._bytes += cur.nbytes
            self._cur = cur
        s = Staged(cur, cur.used, n)
        cur.used += n
        return s

    def give(self, s: Staged) -> None:
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
