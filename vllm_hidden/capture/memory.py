"""The server's sink: each sample in its own host tensor, handed on when complete."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_hidden.capture.records import Sample


class _MemSlot:
    __slots__ = ("sample_id", "token_ids", "buf", "finite")

    def __init__(self, sample_id: Any, token_ids: list[int], buf: torch.Tensor) -> None:
        self.sample_id, self.token_ids, self.buf = sample_id, token_ids, buf
        self.finite = True

    def place(self, pos: int, rows: torch.Tensor, stat: torch.Tensor) -> None:
        self.buf[pos : pos + rows.shape[0]].copy_(rows)
        if self.finite and not bool(torch.isfinite(stat).all()):  # [n, C] floats: cheap
            self.finite = False


class MemorySink:
    """Each sample in its own host tensor, handed to `on_sample` when complete. With
    `on_failure`, a request whose rows cannot be assembled is reported there and the others
    go on (a server must not stop for one request); without it the failure is raised."""

    def __init__(self, row_shape: tuple[int, int], dtype: torch.dtype, on_sample: Callable[[Sample], None],
                 on_failure: Callable[[Any, str], None] | None = None) -> None:
        self.row_shape, self.dtype, self.on_sample = tuple(row_shape), dtype, on_sample
        self.on_failure = on_failure

    def reserve(self, sample_id: Any, token_ids: list[int], rows: int | None = None, *,
                line: int | None = None, loss_spans: list[list[int]] | None = None) -> _MemSlot:
        n = len(token_ids) if rows is None else rows
        return _MemSlot(sample_id, token_ids, torch.empty((n, *self.row_shape), dtype=self.dtype))

    def commit(self, slot: _MemSlot) -> None:
        self.on_sample(Sample(slot.sample_id, torch.tensor(slot.token_ids, dtype=torch.int64), slot.buf, slot.finite))

    def drop(self, slot: _MemSlot) -> None:
        pass
