"""A rank's prompts in batches under a token budget, in input order, with a position that a
checkpoint can hold. Pure: no engine (`HiddenStatesStream` runs the batches through one)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from vllm_hidden.inputs.reader import BadLine, Prompt, PromptReader, duplicate
from vllm_hidden.inputs.sources import records

log = logging.getLogger("vllm_hidden")


class PromptBatcher:
    """Input record i belongs to rank i % world_size (bad records too, so that the split does
    not depend on which records are good); a batch is the rank's next prompts while their
    tokens fit `token_budget`. `cursor` is the first record not in a batch handed over."""

    def __init__(self, reader: PromptReader, rank: int, world_size: int, token_budget: int,
                 cost: Callable[[Prompt], int] | None = None, duplicates: dict[int, Any] | None = None) -> None:
        self.reader = reader
        # the up-front scan's duplicate ids (line -> id): skipped wherever the reading starts,
        # so a resumed stream skips what an uninterrupted one does
        self.duplicates = dict(duplicates or {})
        self.rank, self.world_size, self.token_budget = rank, world_size, token_budget
        # the rows a prompt's sample may have (its tokens; under generation, with its responses)
        self.cost: Callable[[Prompt], int] = cost or (lambda p: len(p.token_ids))
        self.cursor = 0
        self.errors: list[BadLine] = []  # this rank's skipped records
        self._records: Iterator[tuple[int, Any]] | None = None
        self._held: Prompt | None = None  # read, but over what was left of the last batch's budget

    def seek(self, cursor: int) -> None:
        """Go on from record `cursor` (read again from the input)."""
        if not isinstance(cursor, int) or cursor < 0:
            raise ValueError(f"cursor must be a non-negative int, got {cursor!r}")
        self.cursor, self._records, self._held = cursor, None, None
        self.reader.forget_ids()  # the records from `cursor` on are read again: their ids are not duplicates
        self.errors = [e for e in self.errors if e.line < cursor]  # (and their errors found again)

    def _lines(self) -> Iterator[tuple[int, Any]]:
        if self._records is None:
            cursor, rank, world = self.cursor, self.rank, self.world_size
            self._records = ((i, obj) for i, obj in records(self.reader.path, self.reader.columns)
                             if i >= cursor and i % world == rank)
        return self._records

    def next_batch(self) -> list[Prompt]:
        """The next batch ([] at the end of the input); `done` moves the cursor past it."""
        batch: list[Prompt] = []
        used = 0
        while True:
            p, self._held = self._held, None
            if p is None:
                nxt = next(self._lines(), None)
                if nxt is None:
                    return batch
                i, obj = nxt
                rec = (BadLine(i, self.duplicates[i], duplicate(self.duplicates[i])) if i in self.duplicates
                       else self.reader.prompt(i, obj))
                if isinstance(rec, BadLine):
                    self.errors.append(rec)
                    log.warning("vllm-hidden: input line %d (id %r) skipped: %s", rec.line, rec.id, rec.reason)
                    continue
                p = rec
            n = self.cost(p)
            if n > self.token_budget:
                what = f"{n} tokens" if n == len(p.token_ids) else f"up to {n} tokens with its responses"
                raise ValueError(f"input line {p.line} (id {p.id!r}) has {what}, more than token_budget "
                                 f"{self.token_budget}: raise token_budget to at least {n}, or drop the record")
            if used + n > self.token_budget:
                self._held = p
                return batch
            batch.append(p)
            used += n

    def done(self, batch: list[Prompt]) -> None:
        """`batch` was handed over: the cursor moves past it."""
        if batch:
            self.cursor = self._held.line if self._held is not None else batch[-1].line + 1
