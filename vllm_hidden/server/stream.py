"""The `send` of a streaming (SSE) response with hidden states: vLLM's events pass through, the
last one before `data: [DONE]` gets the `hidden_states` object."""

from __future__ import annotations

import json
from typing import Any

from vllm_hidden.server.asgi import send_body, send_error, splice_parts
from vllm_hidden.server.protocol import FIELD, RequestError
from vllm_hidden.server.registry import Pending


class StreamSplicer:
    """`send` for a streaming response: passes events through one behind, and adds
    `hidden_states` (`mw.stream_value(pending)`) to the last event before `data: [DONE]`."""

    def __init__(self, send, pending: Pending, mw: Any) -> None:
        self.send, self.pending, self.mw = send, pending, mw
        self.start: dict[str, Any] | None = None
        self.started = self.dropped = self.passthrough = False
        self.buf = b""
        self.held: bytes | None = None

    async def _emit(self, data, more: bool = True) -> None:
        await send_body(self.send, [data], more)

    async def __call__(self, msg) -> None:
        if self.dropped:
            return
        if msg["type"] == "http.response.start":
            self.start = msg  # held until the first event: a rejected request gets a 400 instead
            return
        if msg["type"] != "http.response.body":
            return await self.send(msg)
        if not self.started:
            if self.pending.rejected is not None:
                self.dropped = True
                return await send_error(self.send, self.pending.rejection())
            self.started = True
            start = self.start or {"type": "http.response.start", "status": 500, "headers": []}  # always sent first
            await self.send(start)
            self.passthrough = start.get("status") != 200
        if self.passthrough:
            return await self.send(msg)
        self.buf += msg.get("body", b"")
        out: list = []
        while b"\n\n" in self.buf:
            event, self.buf = self.buf.split(b"\n\n", 1)
            event += b"\n\n"
            if event.strip() == b"data: [DONE]":
                if self.held is not None:
                    out += await self._finish(self.held)
                    self.held = None
                out.append(event)
            elif not event.startswith(b"data: {"):
                out.append(event)  # a comment (keep-alive) or anything not a JSON event: as is
            else:
                if self.held is not None:
                    out.append(self.held)
                self.held = event
        more = msg.get("more_body", False)
        if not more:
            out += [self.held or b"", self.buf]
            self.held, self.buf = None, b""
        out = [p for p in out if len(p)]
        for i, p in enumerate(out):
            await self._emit(p, more or i < len(out) - 1)
        if not out and not more:
            await self._emit(b"", False)

    async def _finish(self, event: bytes) -> list:
        head, _, data = event.partition(b"data: ")
        data = data.rstrip(b"\n")
        try:
            if b'"error"' in data and "error" in json.loads(data):
                return [event]  # vLLM reported an error in the stream: no states to add
        except ValueError:
            return [event]
        try:
            value = await self.mw.stream_value(self.pending)
        except RequestError as e:
            value = [json.dumps(e.body()).encode()]
        try:
            return [head + b"data: ", *splice_parts(data, FIELD.encode(), value), b"\n\n"]
        except ValueError:
            return [event]
