"""The result channel: worker (capture writer rank) -> API server process, ZMQ PUSH/PULL.

A finished sample travels as two frames, a small JSON header and the raw rows (sent
without a copy). Each API server process binds its own IPC socket (vLLM may run several,
`--api-server-count`) and names it in each request it sends to the engine, so every sample
goes back to the process that holds its HTTP request; a writer rank (one per engine, so also
each data-parallel engine) keeps one PUSH socket per API server process. The worker connects
only where a request carrying the server's key says (capture.server_env).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch

from vllm_hidden.format.header import dtype_name, dtype_of

log = logging.getLogger("vllm_hidden")

# A full 27B sample of a few thousand tokens is hundreds of MB: few in flight per sender.
SEND_HWM = 16
SEND_TIMEOUT_MS = 120_000
MAX_ROUTES = 256  # API server processes one writer rank keeps a socket to


def new_address() -> str:
    # ZMQ makes the socket file with the umask's mode: other users cannot connect by default
    return f"ipc://{tempfile.gettempdir()}/vllm-hidden-{os.getpid()}-{secrets.token_hex(6)}.sock"


def routed_id(address: str, token: str) -> str:
    """A served sample's id on the worker: where it goes and the API server's token."""
    return f"{address}#{token}"


class Publisher:
    """Worker side (the assembler thread only: a ZMQ socket is not thread-safe): each sample
    to the API server process its id names (`routed_id`). Never raises: a lost sample fails
    its one request (the API server times out on it), not the engine."""

    def __init__(self) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context(1)
        self._socks: dict[str, Any] = {}

    def _sock(self, address: str):
        sock = self._socks.pop(address, None)
        if sock is None:
            if len(self._socks) >= MAX_ROUTES:  # the least recently used goes (a server's processes are few)
                self._socks.pop(next(iter(self._socks))).close(0)
            sock = self._ctx.socket(self._zmq.PUSH)
            sock.setsockopt(self._zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(self._zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # backpressure, but bounded
            sock.setsockopt(self._zmq.LINGER, 0)
            sock.connect(address)
        self._socks[address] = sock
        return sock

    def _send(self, sample_id: str, header: dict[str, Any], *payload: Any) -> None:
        address, _, token = str(sample_id).rpartition("#")
        header["id"] = token
        try:
            self._sock(address).send_multipart([json.dumps(header).encode(), *(payload or (b"",))], copy=False)
        except self._zmq.ZMQError as e:
            log.error("vllm-hidden: could not send hidden states for request %s to %s: %s", token, address, e)

    def send_sample(self, sample: Any) -> None:
        hs = sample.hidden_states.contiguous()
        header = {"shape": list(hs.shape), "dtype": dtype_name(hs.dtype),
                  "finite": sample.finite}
        frames = [hs.view(torch.uint8).numpy()]  # zmq keeps a reference until sent
        if sample.scale is not None:  # float8 rows: their float32 scales [T, K] ride as a third frame
            frames.append(sample.scale.contiguous().view(torch.uint8).numpy())
        self._send(sample.sample_id, header, *frames)

    def send_failure(self, sample_id: Any, message: str) -> None:
        self._send(sample_id, {"error": message})


class Receiver:
    """API-server side: an asyncio task pulling samples and handing each to `deliver(id,
    rows or None, error or None, finite, scale)` (`finite`: the worker's row statistics found
    no NaN/Inf; `scale`: float8 rows' float32 scales [T, K], else None)."""

    def __init__(self, address: str, deliver: Callable[..., None]) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context(1)
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            raise RuntimeError(f"cannot bind the hidden-states channel {address!r} ({e})") from None
        self.address = address
        self._deliver = deliver
        self._task: Any = None  # its asyncio task once started

    def start(self) -> None:
        import asyncio

        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                header = json.loads(bytes(frames[0].buffer))
                if header.get("error") is not None:
                    self._deliver(str(header["id"]), None, str(header["error"]), True, None)
                    continue
                dtype = dtype_of(header["dtype"])
                with warnings.catch_warnings():  # a read-only buffer; nothing writes to it
                    warnings.simplefilter("ignore")
                    raw = torch.frombuffer(frames[1].buffer, dtype=torch.uint8) if len(frames[1].buffer) \
                        else torch.empty(0, dtype=torch.uint8)
                    rows = raw.view(dtype).reshape(header["shape"])
                    scale = torch.frombuffer(frames[2].buffer, dtype=torch.float32).reshape(header["shape"][:2]) \
                        if len(frames) > 2 else None
                self._deliver(str(header["id"]), rows, None, bool(header.get("finite", False)), scale)
            except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                log.exception("vllm-hidden: bad message on the hidden-states channel")
