"""Requests waiting for hidden states, in the API server process (one event loop).

The middleware adds an entry under a fresh token before the request reaches vLLM and
removes it when the response is done (or the client left); the engine hook fills in the
token ids and a rejection; the channel delivers the rows. A delivery for a token that is
not here (aborted request, forged id) is dropped, so nothing accumulates."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from vllm_hidden.server.protocol import HiddenStatesSpec


@dataclass(eq=False, kw_only=True)
class Pending:
    token: str
    spec: HiddenStatesSpec
    max_tokens: int  # most rows one response may carry
    future: asyncio.Future  # -> (rows [R, K, H] | None, error | None)
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    rejected: str | None = None  # set by the engine hook: answer 400 with this


class Registry:
    def __init__(self) -> None:
        self._pending: dict[str, Pending] = {}

    def add(self, token: str, spec: HiddenStatesSpec, max_tokens: int) -> Pending:
        if token in self._pending:
            raise RuntimeError(f"hidden-states token {token!r} is already in use")
        p = Pending(token=token, spec=spec, max_tokens=max_tokens, future=asyncio.get_running_loop().create_future())
        self._pending[token] = p
        return p

    def get(self, token: object) -> Pending | None:
        return self._pending.get(token) if isinstance(token, str) else None

    def remove(self, token: str) -> None:
        p = self._pending.pop(token, None)
        if p is not None and not p.future.done():
            p.future.cancel()

    def deliver(self, token: str, rows: torch.Tensor | None, error: str | None) -> None:
        p = self._pending.get(token)
        if p is not None and not p.future.done():
            p.future.set_result((rows, error))

    def __len__(self) -> int:
        return len(self._pending)


REGISTRY = Registry()
