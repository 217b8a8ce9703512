"""Token-budget batches: drafters train on batches of a fixed number of tokens, not samples.

`token_batches` groups samples, in the order given, into batches within a token budget:
- "packed": samples laid end to end, [N, ...] with N = sum of lengths <= budget; `cu_seqlens`
  [B + 1] int32 and `position_ids` [N] (restarting at 0 per sample), as varlen attention takes them;
- "padded": [B, T, ...] with B * T <= budget (T the longest; padding counts, since it is
  memory and compute), `attention_mask` [B, T] bool; padding rows are zeros, token id 0, loss mask False.
Both carry `lengths` [B] int64 and `ids` (list), and `num_prompt_tokens` [B] in an `extract
--generate` output. Every token of every sample is kept; a sample longer than the budget is
refused with a ValueError naming it.

`collate_tokens` builds one such batch from sample dicts (a DataLoader `collate_fn` over a
`batch_sampler` of `token_batches`); `ShardedStream(token_budget=...)` builds them without
the copy, reading each sample's rows straight into its place in the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_hidden.format.shard import ROW_TENSORS

LAYOUTS = ("packed", "padded")


def check_layout(budget: int, layout: str) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"token_budget must be a positive int, got {budget!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


class BudgetPacker:
    """Greedy, in order: a sample joins the open batch if the batch stays within the budget,
    else the batch is closed and the sample opens the next one."""

    def __init__(self, budget: int, layout: str = "packed") -> None:
        check_layout(budget, layout)
        self.budget, self.padded = budget, layout == "padded"
        self.items: list[Any] = []
        self.total = self.longest = 0

    def add(self, item: Any, length: int, name: Any = None) -> list[Any] | None:
        """Adds one sample; returns the batch it closed, if any."""
        if length > self.budget:
            raise ValueError(f"sample {item if name is None else name!r} has {length} tokens, more than the token "
                             f"budget {self.budget}: raise token_budget (every token is kept, so it cannot be split)")
        longest = max(self.longest, length)
        fits = (len(self.items) + 1) * longest <= self.budget if self.padded else self.total + length <= self.budget
        closed = None
        if not fits:
            closed = self.flush()
            longest = length
        self.items.append(item)
        self.total += length
        self.longest = longest
        return closed

    def flush(self) -> list[Any] | None:
        out, self.items, self.total, self.longest = self.items or None, [], 0, 0
        return out


def token_batches(lengths: Sequence[int], budget: int, layout: str = "packed") -> list[list[int]]:
    """Positions 0..len(lengths)-1 grouped, in order, into batches within `budget` tokens."""
    packer, out = BudgetPacker(budget, layout), []
    for i, n in enumerate(lengths):
        closed = packer.add(i, int(n))
        if closed:
            out.append(closed)
    last = packer.flush()
    return out + ([last] if last else [])


_ALIGN = 64  # bytes: where each tensor carved from one buffer starts


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def returned_dtype(name: str, stored: torch.dtype) -> torch.dtype:
    """The dtype a tensor is returned in: as stored, but the loss mask (uint8 0/1) as bool."""
    return torch.bool if name == "loss_mask" else stored


def alloc_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """In a DataLoader worker, in shared memory: what the worker returns then crosses to the
    training process without the copy its pickling would otherwise make."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(max(1, _nbytes(shape, dtype)))
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class BufferPool:
    """Host buffers reused from one yielded item to the next, in the process that consumes
    them: new memory costs a page fault per 4 KiB (about half the speed of a read into memory
    already mapped). A buffer is reused only once nothing outside the pool refers to its
    memory (the consumer dropped every tensor viewing it), so reuse never overwrites what a
    consumer still holds; a consumer that keeps items just makes the pool allocate. (A tensor,
    view, numpy array or memoryview of an item keeps its buffer; its bare storage object,
    `t.untyped_storage()`, alone does not: keep a tensor.)"""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.bufs: list[torch.Tensor] = []
        self.largest = 0

    @staticmethod
    def _free(buf: torch.Tensor) -> bool:
        # the pool's tensor and the temporary storage object: nobody else
        return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2

    def take(self, nbytes: int) -> torch.Tensor:
        for buf in self.bufs:
            if buf.numel() >= nbytes and self._free(buf):
                return buf[:nbytes]
        self.largest = max(self.largest, nbytes)
        buf = torch.empty(self.largest, dtype=torch.uint8)  # the largest yet: later items fit
        self.bufs.append(buf)
        if len(self.bufs) > self.keep:  # forget one (its memory lives on while a consumer holds it)
            idle = [k for k, b in enumerate(self.bufs) if self._free(b)]
            del self.bufs[min(idle, key=lambda k: self.bufs[k].numel()) if idle else 0]
        return buf[:nbytes]


def alloc_tensors(specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  pool: BufferPool | None = None) -> dict[str, torch.Tensor]:
    """One yielded item's tensors: in a DataLoader worker each in shared memory; else carved
    from one buffer of `pool` (or newly allocated without one)."""
    if pool is None or torch.utils.data.get_worker_info() is not None or not hasattr(torch._C, "_storage_Use_Count"):
        return {name: alloc_tensor(shape, dtype) for name, (shape, dtype) in specs.items()}
    offsets, end = {}, 0
    for name, (shape, dtype) in specs.items():
        offsets[name] = end
        end += -(-_nbytes(shape, dtype) // _ALIGN) * _ALIGN
    flat = pool.take(end)
    return {name: flat[offsets[name] : offsets[name] + _nbytes(shape, dtype)].view(dtype).view(shape)
            for name, (shape, dtype) in specs.items()}


class BatchBuilder:
    """One batch's tensors, allocated once (see `alloc_tensors`); sample b's rows of tensor
    `name` go to `view(b, name)`."""

    def __init__(self, lengths: Sequence[int], specs: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                 layout: str = "packed", pool: BufferPool | None = None) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.lengths = [int(n) for n in lengths]
        self.padded = layout == "padded"
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        rows = (len(self.lengths), max(self.lengths)) if self.padded else (self.offsets[-1],)
        self.tensors = alloc_tensors({name: ((*rows, *tail), returned_dtype(name, dtype))
                                      for name, (dtype, tail) in specs.items()}, pool)

    def view(self, b: int, name: str) -> torch.Tensor:
        t, n = self.tensors[name], self.lengths[b]
        return t[b, :n] if self.padded else t[self.offsets[b] : self.offsets[b] + n]

    def finish(self, ids: list[Any], num_prompt: list[int] | None = None) -> dict[str, Any]:
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        out: dict[str, Any] = dict(self.tensors)
        if self.padded:
            for b, n in enumerate(self.lengths):  # padding: zeros (token id 0, loss mask False)
                for t in self.tensors.values():
                    t[b, n:].zero_()
            out["attention_mask"] = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
        else:
            out["cu_seqlens"] = torch.tensor(self.offsets, dtype=torch.int32)
            out["position_ids"] = torch.cat([torch.arange(n) for n in self.lengths])
        out["lengths"] = lengths
        out["ids"] = ids
        if num_prompt is not None:
            out["num_prompt_tokens"] = torch.tensor(num_prompt, dtype=torch.int64)
        return out


def collate_tokens(samples: list[dict[str, Any]], layout: str = "packed") -> dict[str, Any]:
    """Samples (as `HiddenStatesDataset` returns them) -> one packed or padded batch."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    names = [n for n in ROW_TENSORS if n in samples[0]]
    specs = {n: (samples[0][n].dtype, tuple(samples[0][n].shape[1:])) for n in names}
    b = BatchBuilder([s["token_ids"].shape[0] for s in samples], specs, layout)
    for i, s in enumerate(samples):
        for n in names:
            b.view(i, n).copy_(s[n])
    prompts = [s["num_prompt_tokens"] for s in samples] if "num_prompt_tokens" in samples[0] else None
    return b.finish([s["id"] for s in samples], prompts)
