"""The server's sink: each sample in its own host tensor, handed on when complete."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_hidden.capture.records import Rows, Sample, Sink


class _MemSlot:
    __slots__ = ("sample_id", "token_ids", "buf", "finite", "scale")

    def __init__(self, sample_id: Any, token_ids: Sequence[int] | torch.Tensor, buf: torch.Tensor,
                 scale: torch.Tensor | None) -> None:
        self.sample_id, self.token_ids, self.buf, self.scale = sample_id, token_ids, buf, scale
        self.finite = True

    def place(self, pos: int, rows: Rows) -> None:
        n = len(rows)
        self.buf[pos : pos + n].copy_(rows.values)
        if self.scale is not None:  # float8 rows: their row_scale is the scale they need
            self.scale[pos : pos + n].copy_(rows.row_scale)
        if self.finite and not bool(torch.isfinite(rows.row_scale).all()):  # [n, C] floats: cheap
            self.finite = False


class MemorySink(Sink):
    """Each sample in its own host tensor of `row_shape` rows (the ring's columns), handed to
    `on_sample` when complete. With `on_failure`, a request whose rows cannot be assembled is
    reported there and the others go on (a server must not stop for one request); without it
    the failure is raised.

    A `Sample` holds token ids and rows only: the final state's column, if the ring has one,
    stays the last column of its hidden states, and `line`, `loss_spans`, `num_prompt` and
    `record` are accepted and not kept. Float8 rows (`dtype`) keep their scales (`Sample.scale`)."""

    def __init__(self, row_shape: tuple[int, int], dtype: torch.dtype, on_sample: Callable[[Sample], None],
                 on_failure: Callable[[Any, str], None] | None = None) -> None:
        self.row_shape, self.dtype, self.on_sample = tuple(row_shape), dtype, on_sample
        self._report_failure = on_failure

    def reserve(self, sample_id: Any, token_ids: Sequence[int] | torch.Tensor, *, rows: int | None = None,
                line: int | None = None, loss_spans: list[list[int]] | None = None) -> _MemSlot:
        n = len(token_ids) if rows is None else rows
        return _MemSlot(sample_id, token_ids, torch.empty((n, *self.row_shape), dtype=self.dtype), self._scales(n))

    def _scales(self, n: int) -> torch.Tensor | None:
        return torch.empty((n, self.row_shape[0]), dtype=torch.float32) if self.dtype.itemsize == 1 else None

    def add_rows(self, sample_id: Any, token_ids: Sequence[int] | torch.Tensor, rows: Rows, *,
                 loss_spans: list[list[int]] | None, num_prompt: int, record: str, line: int | None = None,
                 done: Callable[[], None] | None = None) -> None:
        """A whole sample, handed on as one Sample (no per-layer statistics here: `row_sums` is
        not kept); copied before this returns."""
        tok = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        n = tok.shape[0]
        if tuple(rows.values.shape) != (n, *self.row_shape):
            raise ValueError(f"sample {sample_id!r}: rows of shape {tuple(rows.values.shape)} for {n} tokens of "
                             f"{list(self.row_shape)} rows")
        if tuple(rows.row_scale.shape) != (n, self.row_shape[0]):
            raise ValueError(f"sample {sample_id!r}: row_scale of shape {tuple(rows.row_scale.shape)} for rows of "
                             f"shape {tuple(rows.values.shape)}")
        # its own tensor, as a reserved sample has: the rows given may be a view of a larger buffer
        slot = _MemSlot(sample_id, tok, torch.empty((n, *self.row_shape), dtype=self.dtype), self._scales(n))
        slot.place(0, rows)
        if done is not None:
            done()
        self.on_sample(Sample(sample_id, tok, slot.buf, slot.finite, slot.scale))

    def commit(self, slot: _MemSlot) -> None:
        self.on_sample(Sample(slot.sample_id, torch.tensor(slot.token_ids, dtype=torch.int64), slot.buf, slot.finite,
                              slot.scale))

    def drop(self, slot: _MemSlot) -> None:
        pass  # nothing outside the slot holds its rows

    def on_failure(self, sample_id: Any, reason: str) -> bool:
        if self._report_failure is None:
            return False
        self._report_failure(sample_id, reason)
        return True
