"""Shard writer: many samples per safetensors file, rolled at a size limit, written by a
pool of threads.

Samples are assembled in place: each one gets rows in a preallocated host arena (one arena
per shard being filled or written, reused), the assembler copies its rows there straight
from the pinned ring, and the arena's file is written from that memory (no concatenation,
no serialize-to-bytes) behind a valid safetensors header, to a temporary name, fsynced,
then renamed. The pool of arenas is what bounds host memory: when every arena is full or
being written, `reserve` blocks, the assembler stops taking steps, and the engine waits
on the capture ring (backpressure instead of growth).

Each shard holds `hidden_states` [R, K, H] (samples back to back), `token_ids` [R] int64,
and in its metadata the per-sample index (id, row offset, token count).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_hidden.config import ShardConfig

log = logging.getLogger("vllm_hidden")

FORMAT = "vllm-hidden/1"
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    file: str
    bytes: int
    sha256: str
    num_samples: int
    num_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _raw(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous():
        raise ValueError(f"shard parts must be contiguous, got strides {t.stride()}")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str],
                      hasher: Executor | None = None) -> tuple[int, str]:
    """Write a safetensors file whose tensor `name` is the row-wise concatenation of the
    listed parts, streaming each part's memory; fsync; returns (bytes, sha256 hex). With
    `hasher`, the sha256 runs there while this thread writes (both release the GIL)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, parts in tensors.items():
        if not parts:
            raise ValueError(f"tensor {name!r} has no parts")
        dtype, tail = parts[0].dtype, tuple(parts[0].shape[1:])
        for p in parts:
            if p.dtype != dtype or tuple(p.shape[1:]) != tail:
                raise ValueError(f"tensor {name!r}: part {tuple(p.shape)} {p.dtype} does not match {tail} {dtype}")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: unsupported dtype {dtype}")
        rows = sum(p.shape[0] for p in parts)
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": [rows, *tail], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    chunks = [memoryview(struct.pack("<Q", len(hbytes))), memoryview(hbytes)]
    chunks += [_raw(p) for parts in tensors.values() for p in parts if p.numel()]
    h = hashlib.sha256()

    def digest() -> None:
        for c in chunks:
            h.update(c)

    pending = hasher.submit(digest) if hasher is not None else None
    total = 0
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)
            total += len(c)
        f.flush()
        os.fsync(f.fileno())
    if pending is not None:
        pending.result()
    else:
        digest()
    return total, h.hexdigest()


class SampleSlot:
    """Rows reserved for one sample; the assembler fills `buf` [T, K, H], then commits."""

    __slots__ = ("arena", "sample_id", "token_ids", "row", "buf", "state")
    RESERVED, COMMITTED, DROPPED = 0, 1, 2

    def __init__(self, arena: "_Arena", sample_id: Any, token_ids: torch.Tensor, row: int) -> None:
        self.arena = arena
        self.sample_id = sample_id
        self.token_ids = token_ids
        self.row = row
        self.buf = arena.buf[row : row + token_ids.shape[0]]
        self.state = SampleSlot.RESERVED


class _Arena:
    __slots__ = ("buf", "rows", "slots", "pending", "sealed", "pooled")

    def __init__(self, buf: torch.Tensor, pooled: bool) -> None:
        self.buf = buf
        self.rows = 0
        self.slots: list[SampleSlot] = []
        self.pending = 0
        self.sealed = False
        self.pooled = pooled

    def add(self, sample_id: Any, token_ids: torch.Tensor) -> SampleSlot:
        slot = SampleSlot(self, sample_id, token_ids, self.rows)
        self.rows += token_ids.shape[0]
        self.slots.append(slot)
        self.pending += 1
        return slot


class ShardWriter:
    """reserve() -> fill slot.buf -> commit() (or drop()); close() writes what is left and
    returns every shard written. reserve/commit/drop are called from one thread (the
    assembler); the files are written by `cfg.writer_threads` threads."""

    def __init__(self, cfg: ShardConfig, layer_ids: list[int], hidden_size: int, dtype: torch.dtype) -> None:
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be positive, got {hidden_size!r}")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"unsupported hidden-state dtype {dtype}")
        self.cfg = cfg
        self.dir = Path(cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = list(layer_ids)
        self.dtype = dtype
        self.row_shape = (len(self.layer_ids), hidden_size)
        row_bytes = len(self.layer_ids) * hidden_size * dtype.itemsize + 8  # + the token id
        self.rows_per_shard = max(1, cfg.max_shard_bytes // row_bytes)
        # one arena being filled + one per writer thread; more only when every other arena
        # waits for a sample still in prefill (chunked prompts), never while one is writing
        self.max_arenas = cfg.writer_threads + 1
        self._pool = ThreadPoolExecutor(cfg.writer_threads, thread_name_prefix="vllm-hidden-writer")
        self._hasher = ThreadPoolExecutor(cfg.writer_threads, thread_name_prefix="vllm-hidden-sha")
        self._cv = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._writing = 0
        self._futures: list[Future] = []
        self._current: _Arena | None = None
        self._open: list[_Arena] = []  # not yet handed to a writer
        self._next_shard = 0
        self._shards: list[tuple[int, ShardInfo]] = []
        self._error: BaseException | None = None
        self._closed = False
        self._write_s = 0.0  # summed over writer threads
        self._reserve_wait_s = 0.0  # assembler blocked on a free arena (backpressure)

    # -- arenas ------------------------------------------------------------------------
    def _new_buffer(self, rows: int) -> torch.Tensor:
        # untouched until rows are filled: a small run costs only what it writes; arenas
        # are reused, so the first-touch page faults are paid once per arena
        return torch.empty((rows, *self.row_shape), dtype=self.dtype)

    def _take_buffer(self) -> torch.Tensor:
        t0 = time.perf_counter()
        with self._cv:
            while True:
                self._raise_error()
                if self._free:
                    self._reserve_wait_s += time.perf_counter() - t0
                    return self._free.pop()
                if self._allocated < self.max_arenas or self._writing == 0:
                    if self._allocated >= self.max_arenas:
                        log.warning("vllm-hidden: every shard arena waits on a prompt still in prefill; "
                                    "allocating arena %d", self._allocated + 1)
                    self._allocated += 1
                    break
                self._cv.wait()  # backpressure: a writer will hand an arena back
            self._reserve_wait_s += time.perf_counter() - t0
        return self._new_buffer(self.rows_per_shard)

    # -- samples -----------------------------------------------------------------------
    def reserve(self, sample_id: Any, token_ids: Any) -> SampleSlot:
        self._raise_error()
        if self._closed:
            raise RuntimeError("the shard writer is closed")
        tok = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        n = tok.shape[0]
        if n < 1:
            raise ValueError(f"sample {sample_id!r} has no tokens")
        if n > self.rows_per_shard:  # larger than a shard: a shard of its own
            arena = _Arena(self._new_buffer(n), pooled=False)
            self._open.append(arena)
            slot = arena.add(sample_id, tok)
            arena.sealed = True
            return slot
        a = self._current
        if a is None or a.rows + n > self.rows_per_shard:
            if a is not None:
                self._seal(a)
            a = self._current = _Arena(self._take_buffer(), pooled=True)
            self._open.append(a)
        return a.add(sample_id, tok)

    def commit(self, slot: SampleSlot) -> None:
        self._resolve(slot, SampleSlot.COMMITTED)

    def drop(self, slot: SampleSlot) -> None:
        self._resolve(slot, SampleSlot.DROPPED)

    def add(self, sample_id: Any, token_ids: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """A whole sample at once (one copy into its shard's arena)."""
        if tuple(hidden_states.shape[1:]) != self.row_shape or hidden_states.shape[0] != len(token_ids):
            raise ValueError(f"sample {sample_id!r}: hidden_states shape {tuple(hidden_states.shape)} does not "
                             f"match [{len(token_ids)}, {self.row_shape[0]}, {self.row_shape[1]}]")
        slot = self.reserve(sample_id, token_ids)
        slot.buf.copy_(hidden_states)
        self.commit(slot)

    def _resolve(self, slot: SampleSlot, state: int) -> None:
        if slot.state != SampleSlot.RESERVED:
            raise RuntimeError(f"sample {slot.sample_id!r} was already committed or dropped")
        slot.state = state
        a = slot.arena
        a.pending -= 1
        if a.sealed and a.pending == 0:
            self._submit(a)
        self._raise_error()

    def _seal(self, a: _Arena) -> None:
        a.sealed = True
        if a.pending == 0:
            self._submit(a)

    def _submit(self, a: _Arena) -> None:
        self._open.remove(a)
        done = [s for s in a.slots if s.state == SampleSlot.COMMITTED]
        if not done:
            self._give_back(a)
            return
        index = self._next_shard
        self._next_shard += 1
        with self._cv:
            self._writing += 1
        self._futures.append(self._pool.submit(self._write, a, done, index))

    def _give_back(self, a: _Arena) -> None:
        with self._cv:
            if a.pooled:
                self._free.append(a.buf)
            self._cv.notify_all()

    # -- files -------------------------------------------------------------------------
    def _write(self, a: _Arena, done: list[SampleSlot], index: int) -> None:
        t0 = time.perf_counter()
        try:
            name = f"{self.cfg.prefix}-{index:05d}.safetensors"
            entries, row = [], 0
            for s in done:
                n = s.token_ids.shape[0]
                entries.append([s.sample_id, row, n])
                row += n
            meta = {"format": FORMAT, "layer_ids": json.dumps(self.layer_ids), "samples": json.dumps(entries)}
            tmp = self.dir / f".{name}.tmp"
            nbytes, digest = write_safetensors(
                tmp, {"hidden_states": [s.buf for s in done], "token_ids": [s.token_ids for s in done]}, meta,
                hasher=self._hasher)
            os.replace(tmp, self.dir / name)
            info = ShardInfo(file=name, bytes=nbytes, sha256=digest, num_samples=len(done), num_tokens=row)
            with self._cv:
                self._shards.append((index, info))
        except BaseException as e:  # noqa: BLE001 - surfaced to the assembler thread
            log.exception("vllm-hidden: writing shard %d failed", index)
            with self._cv:
                if self._error is None:
                    self._error = e
        finally:
            with self._cv:
                self._writing -= 1
                self._write_s += time.perf_counter() - t0
            self._give_back(a)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise OSError(f"writing a shard to {str(self.dir)!r} failed: {self._error!r}") from self._error

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {"writer_threads": self.cfg.writer_threads, "arenas": self._allocated,
                    "writer_busy_s": round(self._write_s, 3), "arena_wait_s": round(self._reserve_wait_s, 3)}

    @property
    def shards(self) -> list[ShardInfo]:
        with self._cv:
            return [info for _, info in sorted(self._shards, key=lambda x: x[0])]

    def close(self) -> list[ShardInfo]:
        """Write the shard being filled, wait for every write, return all shards in order.
        Samples still reserved (never completed) are left out."""
        if not self._closed:
            self._closed = True
            self._current = None
            for a in list(self._open):
                for s in a.slots:
                    if s.state == SampleSlot.RESERVED:
                        s.state = SampleSlot.DROPPED
                        a.pending -= 1
                self._seal(a)
            for f in list(self._futures):
                f.exception()  # wait; errors were recorded by _write
            self._pool.shutdown(wait=True)
            self._hasher.shutdown(wait=True)
        self._raise_error()
        return self.shards
