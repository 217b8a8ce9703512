"""Where an engine's prompts come from. An engine's loop asks `next(wait)` whenever it has
room; `exhausted` turns true once no prompt will ever come: as soon as the last one is
handed out where the feed can tell (a reader looks one prompt ahead), so that the engine
knows which request ends its run (engine.scheduler tapers the steps after it)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm_hidden.inputs import BadLine, Prompt

QUEUE_PER_ENGINE = 64  # prompts waiting per engine on a shared queue: read ahead of the engines, not the whole file


class ReaderFeed:
    """The prompt file, read in this process: bad lines go to `on_error`, samples an earlier
    attempt made durable are skipped (and counted in `resumed`)."""

    def __init__(self, prompts: Iterable[Prompt | BadLine], done_ids: set[Any],
                 on_error: Callable[[BadLine], None]) -> None:
        self._it = iter(prompts)
        self._done = done_ids
        self._on_error = on_error
        self.exhausted = False
        self.resumed = 0
        self._ahead: Prompt | None = None

    def _read(self) -> Prompt | None:
        for item in self._it:
            if isinstance(item, BadLine):
                self._on_error(item)
            elif item.id in self._done:
                self.resumed += 1
            else:
                return item
        return None

    def next(self, wait: bool = True) -> Prompt | None:
        if self.exhausted:
            return None
        item = self._ahead if self._ahead is not None else self._read()
        self._ahead = self._read() if item is not None else None
        self.exhausted = self._ahead is None
        return item


def pack(p: Prompt) -> tuple[Any, ...]:
    return (p.line, p.id, p.token_ids, p.loss_spans, p.source, p.turns)


class QueueFeed:
    """Prompts from a queue that several engines share (a multiprocessing or Ray queue). Each
    engine takes a prompt only when it has room, so the engines finish together whatever the
    prompt lengths. A None on the queue ends the feed (the coordinator puts one per engine)."""

    def __init__(self, q: Any, poll_s: float = 0.2) -> None:
        self._q = q
        self._poll_s = poll_s
        self.exhausted = False
        self.taken = 0
        self._ahead: tuple | None = None

    def _get(self, wait_s: float) -> Any:
        deadline = time.monotonic() + wait_s
        while True:
            # never a blocking get: a multiprocessing queue's reader holds its lock while it
            # blocks, and an engine killed then would leave the lock held for all the others
            try:
                return self._q.get_nowait()
            except queue.Empty:  # Ray's queue raises a subclass of it
                if time.monotonic() >= deadline:
                    return _EMPTY
                time.sleep(0.005)

    def next(self, wait: bool = True) -> Prompt | None:
        if self.exhausted:
            return None
        if self._ahead is not None:
            item, self._ahead = self._ahead, None
        else:
            item = self._get(self._poll_s if wait else 0.0)
        if item is _EMPTY:
            return None
        if item is None:
            self.exhausted = True
            return None
        # is the end already queued behind it? (only a look: a prompt not there yet is not waited for)
        ahead = self._get(0.0)
        if ahead is None:
            self.exhausted = True
        elif ahead is not _EMPTY:
            self._ahead = ahead
        self.taken += 1
        return Prompt(*item)


_EMPTY = object()
