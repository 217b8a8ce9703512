"""The forms an API server process serves (server.transport), made once at its setup: inline and
fetch always, and the connector form it was started with (`ConnectorConfig.transport`: files or
Mooncake)."""

from __future__ import annotations

import asyncio
import atexit
import logging

from vllm_hidden.config import ConnectorConfig, ServeConfig
from vllm_hidden.server.connector import FileTransport
from vllm_hidden.server.fetch_form import FetchForm
from vllm_hidden.server.fields import FetchTransport, InlineTransport
from vllm_hidden.server.mooncake import MooncakeTransport
from vllm_hidden.server.protocol import CONNECTOR
from vllm_hidden.server.transport import ConnectorTransport, ServerShape, Transport

log = logging.getLogger("vllm_hidden")

FORMS: dict[str, type[ConnectorTransport]] = {"file": FileTransport, "mooncake": MooncakeTransport}


def open_connector(cfg: ConnectorConfig, serve: ServeConfig, shape: ServerShape) -> ConnectorTransport:
    """This API server process's transport for the connector form it was started with; its
    sweep runs in the background on the running event loop."""
    transport = FORMS[cfg.transport](cfg, serve, shape)

    async def sweep() -> None:
        while True:
            await asyncio.sleep(min(5.0, serve.unread_ttl_s / 4))
            try:
                transport.sweep()
            except (OSError, RuntimeError):
                log.exception("vllm-hidden: sweeping the connector form's unread states")

    transport.sweeper = asyncio.get_running_loop().create_task(sweep())
    log.info("vllm-hidden: connector form (%s): every completion and chat request's prompt states go to %s",
             cfg.connector, transport.describe())
    return transport


def open_forms(shape: ServerShape, serve: ServeConfig, fetch: FetchForm,
               connector: ConnectorConfig | None) -> dict[str, Transport]:
    """By the request's `spec.transfer`: "inline", "fetch" and, for a server started with a
    connector config, `protocol.CONNECTOR` (every request without the field)."""
    forms: dict[str, Transport] = {"inline": InlineTransport(shape.dtype),
                                   "fetch": FetchTransport(shape.dtype, shape.hidden_size, fetch)}
    if connector is not None:
        forms[CONNECTOR] = open_connector(connector, serve, shape)
        atexit.register(forms[CONNECTOR].close)
    return forms
