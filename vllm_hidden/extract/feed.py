"""Where an engine's prompts come from. An engine's loop asks `next(wait)` whenever it has
room; `exhausted` turns true once no prompt will ever come."""

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

    def next(self, wait: bool = True) -> Prompt | None:
        for item in self._it:
            if isinstance(item, BadLine):
                self._on_error(item)
            elif item.id in self._done:
                self.resumed += 1
            else:
                return item
        self.exhausted = True
        return None


def pack(p: Prompt) -> tuple[Any, ...]:
    return (p.line, p.id, p.token_ids, p.loss_spans, p.source)


class QueueFeed:
    """Prompts from a queue that several engines share (a multiprocessing or Ray queue). Each
    engine takes a prompt only when it has room, so the engines finish together whatever the
    prompt lengths. A None on the queue ends the feed (the coordinator puts one per engine)."""

    def __init__(self, q: Any, poll_s: float = 0.2) -> None:
        self._q = q
        self._poll_s = poll_s
        self.exhausted = False
        self.taken = 0

    def next(self, wait: bool = True) -> Prompt | None:
        if self.exhausted:
            return None
        deadline = time.monotonic() + (self._poll_s if wait else 0.0)
        while True:
            # never a blocking get: a multiprocessing queue's reader holds its lock while it
            # blocks, and an engine killed then would leave the lock held for all the others
            try:
                item = self._q.get_nowait()
                break
            except queue.Empty:  # Ray's queue raises a subclass of it
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.005)
        if item is None:
            self.exhausted = True
            return None
        self.taken += 1
        return Prompt(*item)
