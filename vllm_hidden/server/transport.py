"""Where a response's states go: one class per form, behind one small interface. The middleware
makes the forms this server has once, at its setup (`server.forms.open_forms`): inline and fetch,
which a request picks with its `hidden_states` field, and the connector form it was started with
(files or Mooncake), which every completion and chat request without the field gets.

A form is asked, in order, for each request: `ready` (it can serve now), `row_bytes` (what one token
will hold until it is read; None: nothing held), `reserve` (room for them, before the engine runs
the request: a refusal is the HTTP 503 with Retry-After), `respond` (the worker's rows are in:
store or encode them, and return the response body; a reservation becomes the stored bytes'
hold), and where the request ended without `respond` taking its reservation (an error, a client
that left), `release`. A form that can go in a streamed response gives its `value` (the JSON
`hidden_states` object) for the last event. `sweep` runs now and then on the event loop; `close`
at exit.

- `InlineTransport` (server.fields): base64 safetensors inside the response;
- `FetchTransport` (server.fields, over fetch_form's store): the bytes kept for one GET;
- `FileTransport` (server.connector): a safetensors file in `shared_storage_path`, named in
  `kv_transfer_params.hidden_states_path` (vLLM's ExampleHiddenStatesConnector, hs_connectors'
  FP8HiddenStatesConnector);
- `MooncakeTransport` (server.mooncake): one object in a Mooncake store, the response's
  `kv_transfer_params` its manifest (hs_connectors' MooncakeHiddenStatesConnector).
"""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hidden.config import ConnectorConfig, ServeConfig
from vllm_hidden.server.protocol import RequestError

log = logging.getLogger("vllm_hidden")


@dataclass(frozen=True)
class Delivery:
    """The worker's rows for one request, as the API server process gets them: `rows` [R, K, H]
    (None on failure), the failure's message, whether every value is finite, and with float8
    rows their scales [R, K]."""

    rows: torch.Tensor | None
    error: str | None
    finite: bool = False
    scale: torch.Tensor | None = None


@dataclass(frozen=True)
class Answer:
    """A response with its states: the body's byte pieces, and the key of what the form stored
    for it (a file's path, an object's key, a fetch entry; None: nothing), which `discard`
    deletes when the client left before the response reached it."""

    parts: list
    stored: str | None = None


@dataclass(frozen=True)
class Stored:
    """What a connector form stored: the response's kv_transfer_params and the key to discard."""

    params: dict
    key: str


@dataclass(frozen=True)
class ServerShape:
    """What a transport needs of the server it runs in (set up on the first request)."""

    hidden_size: int
    dtype: torch.dtype  # the model's
    rank: int  # this API server process's
    processes: int  # API server processes sharing the budget

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


class Transport(ABC):
    """One way a response carries its states (see the module doc for the order of the calls)."""

    streams = False  # whether it can go in a streamed response (`value`)

    def ready(self) -> None:
        """Raise RequestError where this form cannot serve now (answered before anything runs)."""
        return None

    def row_bytes(self, columns: int) -> int | None:
        """Bytes one token of a response holds until it is read; None: nothing is held."""
        return None

    def reserve(self, nbytes: int) -> str | None:
        """Room for a response's states: None when granted, else why not (HTTP 503)."""
        return None

    def release(self, nbytes: int) -> None:
        """Give back a reservation nothing was stored under."""
        return None

    @abstractmethod
    async def respond(self, body: bytes, got: Delivery, pending: Any, reserved: int) -> Answer:
        """The response for vLLM's `body`, with the states stored or encoded (whole before this
        returns); `reserved` (from `reserve`) is the form's from here on: held by what it stored
        or released. Raises RequestError (answered as is)."""

    async def discard(self, stored: str) -> None:
        """Delete what `respond` stored (the client left: nobody will read it); its bytes go
        back to the budget."""
        return None

    async def value(self, got: Delivery, pending: Any, reserved: int) -> list:
        """The `hidden_states` JSON value (byte pieces) for a streamed response's last event."""
        raise RequestError(f"{type(self).__name__} cannot go in a streamed response", status=500)

    def sweep(self) -> None:
        """Forget what was read, delete what expired (the event loop calls it now and then)."""
        return None

    def close(self) -> None:
        """At exit."""
        return None

    def describe(self) -> str:
        """For the start log: where the states go."""
        return type(self).__name__


class ConnectorTransport(Transport):
    """A connector form: started with speculators' launch arguments, it stores a prompt's states
    where the trainer reads them and names them in `kv_transfer_params`."""

    def __init__(self, cfg: ConnectorConfig, serve: ServeConfig, shape: ServerShape) -> None:
        self.cfg, self.serve, self.shape = cfg, serve, shape
        self.sweeper: asyncio.Task | None = None  # its expiry sweep (server.forms starts it on the server's loop)

    async def respond(self, body: bytes, got: Delivery, pending: Any, reserved: int) -> Answer:
        ids = pending.prompt_ids
        if got.rows is None:  # a failure: the middleware answers it before any form sees it
            raise RuntimeError(f"no rows to store: {got.error}")
        if got.rows.shape[0] < len(ids):
            self.release(reserved)
            raise missing_rows(got.rows.shape[0], len(ids))
        kept = await self.keep(got, ids, reserved)
        return Answer([with_params(body, kept.params)], kept.key)

    @abstractmethod
    async def keep(self, got: Delivery, token_ids: list[int], reserved: int) -> Stored:
        """Store the prompt's states (rows [:T]): the response's kv_transfer_params, and the key."""


def with_params(body: bytes, params: dict) -> bytes:
    """vLLM's response with its `kv_transfer_params` set (what a connector puts there)."""
    obj = json.loads(body)
    obj["kv_transfer_params"] = params
    return json.dumps(obj).encode()


def missing_rows(rows: int, tokens: int) -> RequestError:
    return RequestError(f"hidden states incomplete: {rows} rows captured for {tokens} tokens", status=500)
