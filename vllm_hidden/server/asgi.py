"""ASGI plumbing the middleware is built from: reading a request body (whole or up to a limit),
handing it on again, and sending JSON or byte pieces back, with no copy of a large body."""

from __future__ import annotations

import json
from typing import Any

from vllm_hidden.server.protocol import FIELD

SEND_CHUNK = 1 << 20


def path(scope: dict[str, Any]) -> str:
    """The request path below the app's root path."""
    return scope["path"].removeprefix(scope.get("root_path", "") or "")


def is_json(scope: dict[str, Any]) -> bool:
    ctype = next((v for k, v in scope.get("headers", []) if k.lower() == b"content-type"), b"")
    return b"json" in ctype.lower()


def with_length(scope: dict[str, Any], n: int) -> dict[str, Any]:
    """The scope with its content-length header saying `n` (the body was rewritten)."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(n).encode()))
    return {**scope, "headers": headers}


def parse_json(body: bytes) -> Any:
    """The body's JSON, or None where it is not JSON (vLLM answers that itself); deep nesting
    too, which vLLM answers with a 400."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


async def read_body(receive, limit: int) -> tuple[bytes, bool]:
    """The body, read up to `limit` bytes: (bytes, complete)."""
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected while sending the request")
        chunk = msg.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks), True
        if size > limit:
            return b"".join(chunks), False


def replay(body: bytes, receive):
    """A `receive` that hands the (already read) body over once, then the client's events
    (vLLM listens for a disconnect)."""
    sent = False

    async def replay_():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_


class ScanningReceive:
    """Passes an over-limit body through to vLLM untouched (vLLM decides about it) while
    looking for our field; if it turns up, vLLM is told the client left (`found`), and the
    middleware answers 413."""

    _MARK = b'"' + FIELD.encode() + b'"'

    def __init__(self, head: bytes, receive) -> None:
        self.head, self.receive, self.found = head, receive, False
        self.tail = head[-len(self._MARK):]

    async def __call__(self):
        if self.head is not None:
            head, self.head = self.head, None
            return {"type": "http.request", "body": head, "more_body": True}
        msg = await self.receive()
        if msg["type"] == "http.request" and not self.found:
            chunk = msg.get("body", b"")
            if self._MARK in self.tail + chunk:
                self.found = True
                return {"type": "http.disconnect"}
            self.tail = (self.tail + chunk)[-len(self._MARK):]
        return msg


def splice_parts(obj_json: bytes, key: bytes, value: list) -> list:
    """Byte pieces of a JSON object's bytes with `"key": <value pieces>` added, without
    re-serializing it or copying the value."""
    end = obj_json.rstrip()
    if not end.endswith(b"}"):
        raise ValueError("response is not a JSON object")
    body = end[:-1].rstrip()
    sep = b"" if body.endswith(b"{") else b","
    return [body, sep + b'"' + key + b'":', *value, b"}"]


async def send_body(send, parts: list, more: bool, chunk: int = SEND_CHUNK) -> None:
    """Send byte pieces as body messages of at most `chunk` bytes: a response of hundreds of
    MB is never joined into one more copy, and the server's write buffer stays small (each
    send waits for the socket to drain)."""
    chunks = [memoryview(p)[i : i + chunk] for p in parts for i in range(0, len(p), chunk)]
    if not chunks:
        chunks = [memoryview(b"")]
    for i, c in enumerate(chunks):
        await send({"type": "http.response.body", "body": c, "more_body": more or i < len(chunks) - 1})


async def send_json(send, status: int, payload: dict[str, Any], headers: tuple = ()) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send, err) -> None:
    """A protocol.RequestError as vLLM's error JSON, with its status (and Retry-After)."""
    retry = getattr(err, "retry_after", None)
    await send_json(send, err.status, err.body(), ((b"retry-after", str(retry).encode()),) if retry else ())
