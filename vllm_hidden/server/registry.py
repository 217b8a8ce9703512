"""Requests waiting for hidden states, in the API server process (one event loop).

The middleware adds an entry under a fresh token before the request reaches vLLM and
removes it when the response is done (or the client left); the engine hook fills in the
token ids and a rejection; the channel delivers the rows. A delivery for a token that is
not here (aborted request, forged id) is dropped, so nothing accumulates."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_hidden.server.protocol import HiddenStatesSpec, RequestError
from vllm_hidden.server.transport import Delivery

RETRY_AFTER_S = 1  # a 503 for want of room: files are read and deleted within seconds


@dataclass(eq=False, kw_only=True)
class Pending:
    token: str
    spec: HiddenStatesSpec
    max_tokens: int  # most rows one response may carry
    future: asyncio.Future  # -> transport.Delivery
    reply_to: str = ""  # this process's result channel address, for the worker
    root_path: str = ""  # the server's ASGI root path: the fetch URL starts with it
    # fetch form: room for `rows` rows' bytes, asked by the engine hook before the engine runs;
    # the reason when there is none (HTTP 503)
    admit: Callable[[int], str | None] | None = None
    reserved: int = 0  # bytes granted by `admit`, until the states are stored or the request ends
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    rejected: str | None = None  # set by the engine hook: answer `rejected_status` with this
    rejected_status: int = 400

    def rejection(self) -> RequestError:
        return RequestError(self.rejected or "", status=self.rejected_status,
                            param="max_tokens" if self.rejected_status == 400 else None,
                            retry_after=RETRY_AFTER_S if self.rejected_status == 503 else None)


class Registry:
    def __init__(self) -> None:
        self._pending: dict[str, Pending] = {}

    def add(self, token: str, spec: HiddenStatesSpec, max_tokens: int, **kw) -> Pending:
        if token in self._pending:
            raise RuntimeError(f"hidden-states token {token!r} is already in use")
        p = Pending(token=token, spec=spec, max_tokens=max_tokens, future=asyncio.get_running_loop().create_future(),
                    **kw)
        self._pending[token] = p
        return p

    def get(self, token: object) -> Pending | None:
        return self._pending.get(token) if isinstance(token, str) else None

    def remove(self, token: str) -> None:
        p = self._pending.pop(token, None)
        if p is not None and not p.future.done():
            p.future.cancel()

    def deliver(self, token: str, rows: torch.Tensor | None, error: str | None, finite: bool = False,
                scale: torch.Tensor | None = None) -> None:
        p = self._pending.get(token)
        if p is not None and not p.future.done():
            p.future.set_result(Delivery(rows, error, finite, scale))

    def __len__(self) -> int:
        return len(self._pending)


REGISTRY = Registry()
