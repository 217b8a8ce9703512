"""Shard-aware shuffling: an IterableDataset over an extract output that reads each sample
once per epoch across every torch.distributed rank and DataLoader worker, close to sequentially.

Each epoch (seed, epoch):
1. the shard order is shuffled;
2. the samples, in that shard order, are cut into `world_size * num_workers` contiguous
   spans of equal size (+-1 sample): partition p = rank * num_workers + worker reads span p, so
   no sample is read twice or skipped, and a shard is opened by at most the few processes
   whose spans touch it;
3. within its span, a process takes `window` shards at a time and reads their samples in a
   shuffled order (seeded by seed, epoch, partition and window).
Given the same seed, epoch, ranks and workers, the order is the same. Reads run ahead of the
consumer in `read_ahead` threads (ranged GETs on S3), each sample verified as it is read.

Where to read: iterating the stream in the training process itself (no DataLoader workers,
or `num_workers=0`) is the fastest way, as preadv, the checksum and S3 reads all run without
the GIL in the read-ahead threads, and yielded items reuse the memory of items the consumer
let go of. A DataLoader worker must put each item in new shared memory (a page fault per 4 KiB)
for it to cross to the training process.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from vllm_hidden.data.batches import (
    LAYOUTS,
    BatchBuilder,
    BudgetPacker,
    BufferPool,
    alloc_tensors,
    check_layout,
    returned_dtype,
)
from vllm_hidden.data.dataset import HiddenStatesDataset
from vllm_hidden.format.quant import dequantize
from vllm_hidden.format.shard import SCALES

_MAX_WINDOW = 32  # shards mixed at once (a process keeps up to dataset._OPEN_SHARDS open)
_READ_AHEAD = 4  # the default read-ahead threads: in the consuming process, and on S3


def _int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an int in {lo}..{hi if hi is not None else ''}, got {value!r}")
    return value


class ShardedStream(torch.utils.data.IterableDataset):
    """Iterate it, or hand it to `DataLoader(stream, batch_size=None, num_workers=N)`. Yields
    samples as `HiddenStatesDataset` returns them or, with `token_budget`, batches of up to
    that many tokens (`layout` "packed" or "padded"; see `batches.py`), each sample's rows read
    straight into its place in the batch.
    `read_ahead`: threads reading ahead of the consumer (default 4 in the consuming process
    and on S3; 0 in a DataLoader worker reading local files, where workers are the parallelism).

    Call `set_epoch(epoch)` before each epoch, as with DistributedSampler: the order follows
    it. Workers kept alive across epochs (`persistent_workers=True`) do not see set_epoch; they
    count epochs themselves, from the epoch set when they started, which matches as long as
    epochs are run in order from there. `rank`/`world_size` default to torch.distributed's, if it is
    initialized when the stream is made, iterated, or sent to workers; else one process.
    Ranks may get a different number of batches (spans are equal in samples, not tokens): a
    DDP loop must allow for it (e.g. `torch.distributed.algorithms.join.Join`)."""

    def __init__(self, dataset: HiddenStatesDataset | str, *, seed: int = 0, shuffle: bool = True, window: int = 4,
                 token_budget: int | None = None, layout: str = "packed", read_ahead: int | None = None,
                 rank: int | None = None, world_size: int | None = None) -> None:
        self.ds = dataset if isinstance(dataset, HiddenStatesDataset) else HiddenStatesDataset(dataset)
        self.seed = _int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.window = _int("window", window, 1, _MAX_WINDOW)
        self.read_ahead = None if read_ahead is None else _int("read_ahead", read_ahead, 0, 64)
        if token_budget is not None:
            check_layout(token_budget, layout)
        elif layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.token_budget, self.layout = token_budget, layout
        if (rank is None) != (world_size is None):
            raise ValueError(f"give both rank and world_size or neither, got rank={rank!r} world_size={world_size!r}")
        if world_size is not None:
            _int("world_size", world_size, 1)
            _int("rank", rank, 0, world_size - 1)
        self.rank, self.world_size = rank, world_size
        self._topology()
        self.epoch = 0
        self._iterated = 0  # iterations of this copy since set_epoch (persistent workers count on their own)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = _int("epoch", epoch, 0)
        self._iterated = 0
        self._topology()

    def _topology(self) -> tuple[int, int]:
        if self.rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        return (self.rank, self.world_size or 1) if self.rank is not None else (0, 1)

    def __getstate__(self) -> dict[str, Any]:
        self._topology()  # in the training process, where torch.distributed is set up: workers get its rank
        return self.__dict__.copy()

    def partition(self) -> tuple[int, int]:
        """(this process's partition, partitions): rank * num_workers + worker, world_size * num_workers."""
        rank, world = self._topology()
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank * workers + worker, world * workers

    def windows(self, epoch: int, part: int, parts: int) -> Iterator[list[int]]:
        """The sample indices partition `part` of `parts` reads in `epoch`, window by window, in order."""
        shards = self.ds.manifest.shards
        order = np.random.default_rng([self.seed, epoch]).permutation(len(shards)) if self.shuffle \
            else np.arange(len(shards))
        total = len(self.ds)
        lo, hi = total * part // parts, total * (part + 1) // parts
        pieces, at = [], 0  # (shard, first entry, end entry) of the span, in shard order
        for k in order.tolist():
            n = shards[k].num_samples
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                pieces.append((k, a - at, b - at))
            at += n
        for w in range(0, len(pieces), self.window):
            idx = np.concatenate([np.arange(self.ds.starts[k] + a, self.ds.starts[k] + b)
                                  for k, a, b in pieces[w : w + self.window]])
            if self.shuffle:
                idx = np.random.default_rng([self.seed, epoch, part, w]).permutation(idx)
            yield idx.tolist()

    def order(self, epoch: int, part: int = 0, parts: int = 1) -> list[int]:
        """Every sample index partition `part` of `parts` reads in `epoch`, in order."""
        return [i for w in self.windows(epoch, part, parts) for i in w]

    def _units(self, epoch: int, part: int, parts: int) -> Iterator[list[int]]:
        """What is yielded, in order: one sample, or the samples of one batch."""
        if self.token_budget is None:
            for w in self.windows(epoch, part, parts):
                yield from ([i] for i in w)
            return
        packer = BudgetPacker(self.token_budget, self.layout)
        for w in self.windows(epoch, part, parts):
            for i in w:
                k, j = self.ds.locate(i)
                shard = self.ds.shard(k)
                closed = packer.add(i, shard.lengths[j], shard.index[j][0])
                if closed:
                    yield closed
        last = packer.flush()
        if last:
            yield last

    def _read_ahead(self) -> int:
        if self.read_ahead is not None:
            return self.read_ahead
        # DataLoader workers already read in parallel, and more threads per worker only contend
        # for cores; on S3 each read waits on the network, so read ahead everywhere
        in_worker = torch.utils.data.get_worker_info() is not None
        return _READ_AHEAD if self.ds._s3 is not None or not in_worker else 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        part, parts = self.partition()
        epoch = self.epoch + self._iterated
        self._iterated += 1
        units = self._units(epoch, part, parts)
        read_ahead = self._read_ahead()
        # in the consuming process (no DataLoader workers) items reuse buffers the consumer let go
        buffers = BufferPool(read_ahead + 2) if torch.utils.data.get_worker_info() is None else None
        if read_ahead == 0:
            for u in units:
                unit = _Unit(self, u, buffers)
                for b in range(len(u)):
                    unit.read(b)
                yield unit.result()
            return
        pool = ThreadPoolExecutor(read_ahead, thread_name_prefix="vllm-hidden-read")
        pending: deque[tuple[_Unit, list[Future]]] = deque()
        try:
            for u in units:
                unit = _Unit(self, u, buffers)
                pending.append((unit, [pool.submit(unit.read, b) for b in range(len(u))]))
                # the oldest unit is handed over once `read_ahead` samples after it are queued
                while len(pending) > 1 and sum(len(f) for _, f in pending) - len(pending[0][1]) >= read_ahead:
                    yield _done(pending.popleft())
            while pending:
                yield _done(pending.popleft())
        finally:
            for _, futures in pending:
                for f in futures:
                    f.cancel()
            pool.shutdown(wait=True)


def _done(item: tuple["_Unit", list[Future]]) -> dict[str, Any]:
    unit, futures = item
    for f in futures:
        f.result()  # a read's error (a checksum mismatch, a missing shard) surfaces here, in order
    return unit.result()


class _Unit:
    """One thing to yield: a sample, or a batch being filled (its tensors allocated up front)."""

    def __init__(self, stream: ShardedStream, indices: list[int], pool: BufferPool | None) -> None:
        self.ds = stream.ds
        self.indices = indices
        self.samples: list[dict[str, Any] | None] = [None] * len(indices)
        self.builder: BatchBuilder | None = None
        self.tensors: dict[str, torch.Tensor] | None = None
        if stream.token_budget is None and pool is not None:  # one sample, carved from one pooled buffer
            k, j = self.ds.locate(indices[0])
            shard = self.ds.shard(k)
            count = shard.lengths[j]
            self.tensors = alloc_tensors({n: ((count, *t[1]), returned_dtype(n, t[0]))
                                          for n, t in shard.tensors.items()}, pool)
        elif stream.token_budget is not None:
            located = [self.ds.locate(i) for i in indices]
            shards = [self.ds.shard(k) for k, _ in located]
            self.scaled = {v: s for v, s in SCALES.items() if s in shards[0].tensors} if self.ds.dequantize else {}
            specs = {n: (torch.bfloat16 if n in self.scaled else t[0], t[1]) for n, t in shards[0].tensors.items()
                     if n not in self.scaled.values()}
            self.builder = BatchBuilder([s.lengths[j] for s, (_, j) in zip(shards, located)], specs, stream.layout,
                                        pool)

    def read(self, b: int) -> None:
        if self.builder is None:
            tensors = self.tensors
            self.samples[b] = self.ds.item(self.indices[b], None if tensors is None else lambda n, d, s: tensors[n])
            return
        builder, scaled = self.builder, self.scaled

        def alloc(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            if name in scaled or name in scaled.values():  # fp8 values and scales: dequantized into place below
                return torch.empty(shape, dtype=dtype)
            return builder.view(b, name)

        sample = self.ds.read(self.indices[b], alloc)
        for name, scale in scaled.items():
            builder.view(b, name).copy_(dequantize(sample[name], sample[scale]))
        self.samples[b] = {"id": sample["id"], "num_prompt_tokens": sample.get("num_prompt_tokens")}

    def result(self) -> dict[str, Any]:
        samples = [s for s in self.samples if s is not None]
        if len(samples) != len(self.samples):
            raise RuntimeError(f"{len(self.samples) - len(samples)} of the batch's samples were not read")
        if self.builder is None:
            return samples[0]
        prompts = [s["num_prompt_tokens"] for s in samples]
        return self.builder.finish([s["id"] for s in samples], prompts if prompts[0] is not None else None)
