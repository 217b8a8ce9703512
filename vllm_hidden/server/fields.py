"""The forms a request picks with its `hidden_states` field (server.transport): the states in the
response itself (`InlineTransport`), or kept for one GET (`FetchTransport`). Both put a
`hidden_states` object into vLLM's response JSON, or a streamed response's last event."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import torch

from vllm_hidden.format.quant import dequantize
from vllm_hidden.server.asgi import splice_parts
from vllm_hidden.server.fetch_form import FetchForm
from vllm_hidden.server.protocol import (
    FETCH_PATH,
    FIELD,
    Prepared,
    RequestError,
    fetch_parts,
    inline_parts,
    prepare,
    returned_token_ids,
)
from vllm_hidden.server.transport import Answer, Delivery, Transport

log = logging.getLogger("vllm_hidden")


class FieldTransport(Transport):
    streams = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the model's: float8 rows (a server of the FP8 connector form) go back to it

    async def respond(self, body: bytes, got: Delivery, pending: Any, reserved: int) -> Answer:
        parts, stored = await self._value(got, pending, reserved)
        return Answer(splice_parts(body, FIELD.encode(), parts), stored)

    async def value(self, got: Delivery, pending: Any, reserved: int) -> list:
        return (await self._value(got, pending, reserved))[0]

    async def _value(self, got: Delivery, pending: Any, reserved: int) -> tuple[list, str | None]:
        """The `hidden_states` JSON value's byte pieces, and the key of what was stored for it."""
        raise NotImplementedError

    async def _prepared(self, got: Delivery, pending: Any) -> Prepared:
        """The rows this response returns, checked and laid out (off the event loop: it is MBs)."""
        rows = got.rows
        if got.scale is not None:
            rows = await asyncio.to_thread(dequantize, rows, got.scale, self.dtype)
        ids = returned_token_ids(pending.spec, pending.prompt_ids, pending.generated)
        prepared = await asyncio.to_thread(prepare, pending.spec, rows, ids, not got.finite)
        bad = prepared.meta["not_finite"]
        if bad["count"]:
            log.warning("vllm-hidden: %d NaN/Inf values in the hidden states of %d tokens of a response (first at "
                        "token %d, layer ids %s); returned as they are", bad["count"], bad["tokens"],
                        bad["first_token"], bad["layer_ids"])
        return prepared


class InlineTransport(FieldTransport):
    """Base64 safetensors inside the response: nothing held."""

    async def _value(self, got: Delivery, pending: Any, reserved: int) -> tuple[list, str | None]:
        return await asyncio.to_thread(inline_parts, await self._prepared(got, pending)), None

    def describe(self) -> str:
        return "the response (inline)"


class FetchTransport(FieldTransport):
    """The safetensors bytes kept in this server's fetch store for one GET within --fetch-ttl; the
    response says where (fetch_form: the store, its budget and the GET)."""

    def __init__(self, dtype: torch.dtype, hidden_size: int, form: FetchForm) -> None:
        super().__init__(dtype)
        self.hidden_size, self.form = hidden_size, form

    def ready(self) -> None:
        try:
            self.form.open_store()
        except OSError as e:
            raise RequestError(f"the fetch form is unavailable: {e}", status=500) from None

    def row_bytes(self, columns: int) -> int | None:
        return columns * self.hidden_size * self.dtype.itemsize + 8  # the rows and their token ids

    def reserve(self, nbytes: int) -> str | None:
        return self.form.open_store().reserve(nbytes)

    def release(self, nbytes: int) -> None:
        self.form.open_store().release(nbytes)

    async def _value(self, got: Delivery, pending: Any, reserved: int) -> tuple[list, str | None]:
        try:
            prepared = await self._prepared(got, pending)
        except BaseException:
            self.release(reserved)
            raise
        try:
            entry, size = await self.form.open_store().put(prepared.pieces, reserved)
        except OSError as e:
            raise RequestError(f"could not keep the hidden states for fetching: {e}", status=500) from None
        url = pending.root_path + FETCH_PATH + entry
        return fetch_parts(prepared, url, size, self.form.cfg.fetch_ttl_s), entry

    async def discard(self, stored: str) -> None:
        fd = self.form.open_store().open(stored)  # claimed as a GET would: gone from the store
        if fd is not None:
            os.close(fd)
        self.form.open_store().sweep()

    def describe(self) -> str:
        return "the fetch store"
