"""The result channel: worker (capture writer rank) -> API server, one ZMQ PUSH/PULL pair.

A finished sample travels as two frames, a small JSON header and the raw rows (sent
without a copy). The API server binds; every writer rank (one per engine, so also each
data-parallel engine) connects. The address is an IPC socket in a private directory, set
in the environment before vLLM starts its engine processes, which inherit it (by the plugin's
registration, which vLLM runs while parsing its arguments, or by `vllm-hidden serve`).
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

log = logging.getLogger("vllm_hidden")

CHANNEL_ENV = "VHIDDEN_CHANNEL"
KEY_ENV = "VHIDDEN_CHANNEL_KEY"
# A full 27B sample of a few thousand tokens is hundreds of MB: few in flight per sender.
SEND_HWM = 16
SEND_TIMEOUT_MS = 120_000


def new_address() -> str:
    # ZMQ makes the socket file with the umask's mode: other users cannot connect by default
    return f"ipc://{tempfile.gettempdir()}/vllm-hidden-{os.getpid()}-{secrets.token_hex(6)}.sock"


def channel_address() -> str | None:
    return os.environ.get(CHANNEL_ENV) or None


def channel_key() -> str | None:
    """A secret the API server's engine hook puts in each capture request and the worker
    checks: a client cannot reach the worker's capture through other endpoints' extra args."""
    return os.environ.get(KEY_ENV) or None


def ensure_address(fresh: bool = False) -> str:
    """The address (and key) for this server's processes, set in the environment so that
    the engine processes vLLM starts next inherit them."""
    addr = None if fresh else channel_address()
    if addr is None or channel_key() is None:
        addr = os.environ[CHANNEL_ENV] = new_address()
        os.environ[KEY_ENV] = secrets.token_hex(16)
    return addr


_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.bfloat16, torch.float16, torch.float32)}


class Publisher:
    """Worker side (the assembler thread only: a ZMQ socket is not thread-safe). Never
    raises: a lost sample fails its one request (the API server times out on it), not the
    engine."""

    def __init__(self, address: str) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context(1)
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # backpressure, but bounded
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self.address = address

    def _send(self, header: dict[str, Any], payload: Any = b"") -> None:
        try:
            self._sock.send_multipart([json.dumps(header).encode(), payload], copy=False)
        except self._zmq.ZMQError as e:
            log.error("vllm-hidden: could not send hidden states for request %s to %s: %s",
                      header.get("id"), self.address, e)

    def send_sample(self, sample: Any) -> None:
        hs = sample.hidden_states.contiguous()
        header = {"id": sample.sample_id, "shape": list(hs.shape), "dtype": str(hs.dtype).replace("torch.", "")}
        self._send(header, hs.view(torch.uint8).numpy())  # zmq keeps a reference until sent

    def send_failure(self, sample_id: Any, message: str) -> None:
        self._send({"id": sample_id, "error": message})


class Receiver:
    """API-server side: an asyncio task pulling samples and handing each to `deliver(id,
    rows or None, error or None)`."""

    def __init__(self, address: str, deliver: Callable[[str, torch.Tensor | None, str | None], None]) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context(1)
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            raise RuntimeError(f"cannot bind the hidden-states channel {address!r} ({e}); one API server process "
                               f"per address: leave {CHANNEL_ENV} unset and --api-server-count at 1") from None
        self.address = address
        self._deliver = deliver
        self._task = None

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
                    self._deliver(str(header["id"]), None, str(header["error"]))
                    continue
                dtype = _DTYPES[header["dtype"]]
                with warnings.catch_warnings():  # a read-only buffer; nothing writes to it
                    warnings.simplefilter("ignore")
                    raw = torch.frombuffer(frames[1].buffer, dtype=torch.uint8) if len(frames[1].buffer) \
                        else torch.empty(0, dtype=torch.uint8)
                self._deliver(str(header["id"]), raw.view(dtype).reshape(header["shape"]), None)
            except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                log.exception("vllm-hidden: bad message on the hidden-states channel")
