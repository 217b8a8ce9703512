"""ASGI middleware that adds hidden states to vLLM's own OpenAI server.

Loaded with vLLM's `--middleware vllm_hidden.server.HiddenStatesMiddleware` (what
`vllm-hidden serve` passes). On POST /v1/completions and /v1/chat/completions:
- a request without the `hidden_states` field goes to vLLM untouched (its body bytes too,
  unless it smuggles one of our reserved `vllm_xargs` keys, which are removed);
- a request with it is checked (vLLM's own --api-key check first), the field is replaced by a
  server-made token in `vllm_xargs`, and vLLM serves it as usual; the engine hook
  (`engine/serving.py`) turns the token into capture settings for the worker. The response
  JSON (or, streaming, the last event before `[DONE]`: `stream.StreamSplicer`) gets a
  `hidden_states` object spliced in, built from the rows the worker sent over the channel and
  the token ids vLLM returned: inline (base64 in the JSON) or, for `"transfer": "fetch"`, a
  URL on this server.
On GET /v1/hidden_states/{id} (behind vLLM's --api-key check like every /v1 path): a fetch-form
response's safetensors bytes, once (`fetch_form.FetchForm`), from whichever API server process the
connection reached.
Nothing in a request names a file or socket: each API server process binds its own channel
address and names it to the worker in the request's (keyed) capture settings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from typing import Any

from vllm_hidden.config import ConnectorConfig, ServeConfig
from vllm_hidden.engine.serving import RESERVED_PREFIX, TOKEN_KEY
from vllm_hidden.server.asgi import (
    ScanningReceive,
    is_json,
    parse_json,
    path,
    read_body,
    replay,
    send_body,
    send_error,
    with_length,
)
from vllm_hidden.server.fetch_form import FetchForm
from vllm_hidden.server.forms import open_forms
from vllm_hidden.server.protocol import (
    CONNECTOR,
    FETCH_PATH,
    FIELD,
    HiddenStatesSpec,
    RequestError,
    parse_field,
)
from vllm_hidden.server.registry import REGISTRY, Pending
from vllm_hidden.server.stream import StreamSplicer
from vllm_hidden.server.transport import Answer, Delivery, ServerShape, Transport

log = logging.getLogger("vllm_hidden")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
_MARKERS = (FIELD.encode(), RESERVED_PREFIX.encode())

# what the middleware does with a request (`_route`)
PASS = "pass"  # vLLM's, untouched
FETCH = "fetch"  # GET of a fetch-form response
ENDPOINT = "endpoint"  # POST to an endpoint that serves hidden states
ELSEWHERE = "elsewhere"  # a JSON POST to another endpoint: refused if it asks for hidden states


def _route(scope: dict[str, Any]) -> str:
    """Which of the paths above a request takes, from its scope alone (no body read yet)."""
    if scope["type"] != "http":
        return PASS
    method = scope.get("method")
    if method == "GET" and path(scope).startswith(FETCH_PATH):
        return FETCH
    if method != "POST":
        return PASS
    if path(scope) in ENDPOINTS:
        return ENDPOINT
    return ELSEWHERE if is_json(scope) else PASS


def _too_large(limit: int) -> RequestError:
    return RequestError(f"a request with hidden_states must be at most {limit} bytes "
                        f"(--max-request-bytes / {ServeConfig.ENV['max_request_bytes']})", status=413, param=None)


def _maybe_hidden(body: bytes) -> bool:
    """A body the marker scan cannot clear: JSON may spell a key with \\u escapes, and a
    UTF-16/32 body (NUL bytes) holds no ASCII marker at all; such bodies are parsed."""
    return b"\\u" in body or b"\x00" in body


def _marked_request(body: bytes) -> dict[str, Any] | None:
    """The request's JSON object where the body may carry our field or reserved keys; None
    where the marker scan clears it or it is no JSON object (vLLM answers malformed JSON)."""
    if not any(m in body for m in _MARKERS) and not _maybe_hidden(body):
        return None
    req = parse_json(body)
    return req if isinstance(req, dict) else None


def _strip_reserved(req: dict[str, Any]) -> bool:
    xargs = req.get("vllm_xargs")
    if not isinstance(xargs, dict):
        return False
    ours = [k for k in xargs if isinstance(k, str) and k.startswith(RESERVED_PREFIX)]
    for k in ours:
        del xargs[k]
    return bool(ours)


def _check_shape(req: dict[str, Any], endpoint: str) -> None:
    """One engine request per HTTP request: one set of states per response."""
    n = req.get("n")
    if n not in (None, 1):
        raise RequestError(f"hidden_states needs n=1 (one sequence per response), got n={n!r}", param="n")
    if req.get("use_beam_search"):
        raise RequestError("hidden_states cannot be combined with use_beam_search", param="use_beam_search")
    if endpoint == "/v1/completions":
        p = req.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) > 1:
            raise RequestError(f"hidden_states needs a single prompt per request, got a list of {len(p)}",
                               param="prompt")


class HiddenStatesMiddleware:
    def __init__(self, app) -> None:
        from vllm_hidden.engine.hooks import install_generate_hook

        self.app = app
        self.cfg = ServeConfig.from_env(os.environ)
        self._layers: tuple[int, ...] | None = None
        self._auth: tuple[type, tuple, dict] | None = None
        self._auth_checked = False
        self._receiver: Any = None  # capture.channel.Receiver once set up
        self._address = ""
        self._slots: asyncio.Semaphore | None = None
        self._fetch_form = FetchForm(self.cfg)  # its store is made with the first fetch-form request or GET
        self.connector = ConnectorConfig.from_env(os.environ)  # the connector form, if started with it
        self._forms: dict[str, Transport] = {}  # by spec.transfer: inline, fetch and the connector form (setup)
        install_generate_hook(REGISTRY.get)

    # -- setup (first request; vLLM builds the app's state before serving) --------------
    def _setup(self, scope: dict[str, Any]) -> None:
        if self._layers is not None:
            return
        from vllm_hidden.capture.channel import Receiver, new_address
        from vllm_hidden.capture.server_env import channel_key
        from vllm_hidden.config import CaptureConfig
        from vllm_hidden.engine import compat

        vcfg = compat.served_vllm_config(scope["app"])
        cap = CaptureConfig.from_additional_config(vcfg.additional_config) if vcfg else None
        if cap is None:
            raise RequestError("this server does not capture hidden states: start it with `vllm-hidden serve MODEL "
                               "--layers ...` (or additional_config {\"vllm_hidden\": {\"layer_ids\": [...]}})")
        if channel_key() is None:
            raise RequestError("the hidden-states channel key is not configured (VHIDDEN_CHANNEL_KEY is unset)",
                               status=500)
        if not log.handlers and not logging.getLogger().handlers:  # an API server process vLLM started
            vllm_log = logging.getLogger("vllm")
            for h in vllm_log.handlers:
                log.addHandler(h)
            log.setLevel(vllm_log.level or logging.INFO)
            log.propagate = False
        self._address = new_address()
        receiver = self._receiver = Receiver(self._address, REGISTRY.deliver)
        receiver.start()
        self._slots = asyncio.Semaphore(self.cfg.max_concurrent)
        mc = vcfg.model_config
        self._fetch_form.processes = compat.api_process_count(vcfg)
        self._forms = open_forms(ServerShape(hidden_size=mc.get_hidden_size(), dtype=mc.dtype,
                                             rank=compat.api_process_rank(vcfg), processes=self._fetch_form.processes),
                                 self.cfg, self._fetch_form, self.connector)
        self._layers = tuple(cap.layer_ids)
        log.info("vllm-hidden: serving hidden states of layers %s on %s (API server process %s of %d)",
                 list(cap.layer_ids), ", ".join(ENDPOINTS), compat.api_process_rank(vcfg),
                 self._fetch_form.processes)

    def _find_auth(self, scope: dict[str, Any]) -> None:
        """vLLM's --api-key check (its own middleware, which sits inside ours), to run before
        anything of ours answers."""
        if self._auth_checked:
            return
        from vllm_hidden.engine import compat

        self._auth = compat.api_key_middleware(scope.get("app"))
        self._auth_checked = True

    def _guarded(self, handler):
        if self._auth is None:
            return handler
        cls, args, kwargs = self._auth
        return cls(handler, *args, **kwargs)

    async def _refuse(self, err: RequestError, scope, receive, send) -> None:
        """Answer `err`, behind vLLM's --api-key check."""

        async def app(scope, receive, send):
            await send_error(send, err)

        await self._guarded(app)(scope, receive, send)

    # -- ASGI ------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        route = _route(scope)
        if route == PASS:
            await self.app(scope, receive, send)
            return
        self._find_auth(scope)
        if route == FETCH:
            await self._guarded(self._fetch)(scope, receive, send)
            return
        try:
            body, complete = await read_body(receive, self.cfg.max_request_bytes)
        except ConnectionResetError:  # the client left while sending: nobody to answer
            return
        if route == ELSEWHERE:
            await self._elsewhere(scope, receive, send, body, complete)
        elif len(body) > self.cfg.max_request_bytes:
            await self._over_limit(scope, receive, send, body, complete)
        else:
            await self._endpoint(scope, receive, send, body)

    async def _pass(self, scope, receive, send, body: bytes) -> None:
        """vLLM serves the request, its (already read) body handed over as it is."""
        await self.app(scope, replay(body, receive), send)

    async def _over_limit(self, scope, receive, send, body: bytes, complete: bool) -> None:
        """A body over --max-request-bytes to an endpoint: refused if what was read asks for
        hidden states; otherwise vLLM's (the rest scanned for the field as it streams in)."""
        limit = self.cfg.max_request_bytes
        if FIELD.encode() in body:
            await self._refuse(_too_large(limit), scope, receive, send)
        elif complete:
            await self._pass(scope, receive, send, body)
        else:
            await self._pass_large(scope, ScanningReceive(body, receive), send, limit)

    async def _endpoint(self, scope, receive, send, body: bytes) -> None:
        """A request to an endpoint that serves hidden states, within the size limit: without
        the field, vLLM's (less any reserved key a client sent); with it, captured."""
        req = _marked_request(body)
        if req is None and self.connector is not None:  # every request may be one for a file
            req = parse_json(body)
            req = req if isinstance(req, dict) else None
        if req is None:
            await self._pass(scope, receive, send, body)
            return
        stripped = _strip_reserved(req)
        if FIELD in req:
            await self._guarded(self._capturing(req, req.pop(FIELD), receive))(scope, receive, send)
            return
        if self.connector is not None and not req.get("stream"):
            await self._guarded(self._capturing(req, CONNECTOR, receive))(scope, receive, send)
            return
        if stripped:
            body = json.dumps(req).encode()
            scope = with_length(scope, len(body))
        await self._pass(scope, receive, send, body)

    def _capturing(self, req: dict[str, Any], value: Any, receive):
        """The ASGI app (behind vLLM's --api-key check) for a request with the field `value`
        (popped from `req`): checked, then served with hidden states, or by vLLM alone for
        `"hidden_states": false / null`."""

        async def handler(scope, _receive, send):
            try:
                spec = self._parse(scope, req, value)
            except RequestError as e:
                await send_error(send, e)
                return
            if spec is None:  # "hidden_states": false / null
                b = json.dumps(req).encode()
                await self._pass(with_length(scope, len(b)), receive, send, b)
                return
            async with self._slots:
                await self._serve(scope, receive, send, req, spec)

        return handler

    def _parse(self, scope, req: dict[str, Any], value: Any):
        """The field's spec for this server's layers (None: states not asked for), the request's
        shape checked; the server is set up on its first request."""
        self._setup(scope)
        layers = self._layers
        if layers is None:  # _setup sets them
            raise RuntimeError("the server's layers are not known")
        spec: HiddenStatesSpec | None
        if value is CONNECTOR:
            spec = HiddenStatesSpec(layer_ids=layers, columns=tuple(range(len(layers))), transfer=CONNECTOR)
        else:
            spec = parse_field(value, layers)
        if spec is not None:
            _check_shape(req, path(scope))
        return spec

    async def _fetch(self, scope, receive, send) -> None:
        """GET /v1/hidden_states/{id}."""
        try:
            self._setup(scope)
        except RequestError as e:
            return await send_error(send, e)
        await self._fetch_form.get(path(scope)[len(FETCH_PATH):], send)

    async def _elsewhere(self, scope, receive, send, body: bytes, complete: bool) -> None:
        """A JSON POST to another endpoint (/v1/responses, /v1/messages, /invocations, ...):
        vLLM would ignore the field and answer without states, so a request that asks for
        them is refused, naming the endpoints that serve them."""
        if not complete:
            await self._pass_large(scope, ScanningReceive(body, receive), send, self.cfg.max_request_bytes)
            return
        req = _marked_request(body)
        if req is not None and FIELD in req:
            err = RequestError(f"{path(scope)} does not return hidden states; send \"{FIELD}\" to "
                               f"{' or '.join(ENDPOINTS)}")
            await self._refuse(err, scope, receive, send)
            return
        await self._pass(scope, receive, send, body)

    async def _pass_large(self, scope, receive: ScanningReceive, send, limit: int) -> None:
        started = False

        async def send_(msg):
            nonlocal started
            if receive.found:
                return  # answered below
            started = True
            await send(msg)

        try:
            await self.app(scope, receive, send_)
        except Exception:  # vLLM saw a "disconnect"; it is our 413 to give
            if not receive.found:
                raise
        if receive.found and not started:
            await self._refuse(_too_large(limit), scope, receive, send)

    async def _serve(self, scope, receive, send, req: dict[str, Any], spec) -> None:
        form = self._forms[spec.transfer]
        try:
            form.ready()
        except RequestError as e:
            return await send_error(send, e)
        token = secrets.token_urlsafe(18)
        admit = None
        row_bytes = form.row_bytes(len(spec.columns))
        if row_bytes is not None:  # the form holds the states until they are read: room first

            def admit(rows: int) -> str | None:
                want = rows * row_bytes + 4096  # + the safetensors header
                why = form.reserve(want)
                if why is None:
                    pending.reserved = want
                return why

        pending = REGISTRY.add(token, spec, self.cfg.max_hidden_tokens, reply_to=self._address, admit=admit,
                               root_path=scope.get("root_path", "") or "")
        try:
            xargs = req.get("vllm_xargs")
            req["vllm_xargs"] = {**(xargs if isinstance(xargs, dict) else {}), TOKEN_KEY: token}
            body = json.dumps(req).encode()
            scope = with_length(scope, len(body))
            if req.get("stream"):
                await self.app(scope, replay(body, receive), StreamSplicer(send, pending, self))
            else:
                await self._serve_json(scope, replay(body, receive), send, pending)
        finally:
            REGISTRY.remove(token)
            if pending.reserved:  # never stored (an error, the client left)
                form.release(pending.reserved)

    async def _serve_json(self, scope, receive, send, pending: Pending) -> None:
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []

        async def collect(msg):
            nonlocal start
            if msg["type"] == "http.response.start":
                start = msg
            elif msg["type"] == "http.response.body":
                chunks.append(msg.get("body", b""))
            else:
                await send(msg)

        await self.app(scope, receive, collect)
        if pending.rejected is not None:
            return await send_error(send, pending.rejection())
        body = b"".join(chunks)
        if start is None:
            return None
        parts = [body]
        if start["status"] == 200 and body.lstrip()[:1] == b"{":  # not e.g. `null` after a hang-up
            try:
                answer = await self._answer(body, pending, receive)
            except RequestError as e:
                return await send_error(send, e)
            if answer is None:  # the client left: nothing kept for it, nobody to answer
                return None
            parts = answer.parts
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(sum(len(p) for p in parts)).encode()))
        await send({**start, "headers": headers})
        await send_body(send, parts, more=False)

    async def _answer(self, body: bytes, pending: Pending, receive) -> Answer | None:
        """The request's form's response, or None where the client hung up first: then nothing
        it would have read is kept (before the states came: nothing stored, the reservation goes
        back with the request; while they were stored: what was stored is deleted). The client's
        hang-up is its http.disconnect (the body was read whole: nothing else comes)."""
        form = self._forms[pending.spec.transfer]
        gone = asyncio.ensure_future(receive())
        delivered = asyncio.ensure_future(self._delivered(pending))
        try:
            await asyncio.wait({gone, delivered}, return_when=asyncio.FIRST_COMPLETED)
            if not delivered.done():
                return None
            got, reserved = delivered.result()
            answer = await form.respond(body, got, pending, reserved)  # a write in a thread: not cut short
            if gone.done() and answer.stored is not None:
                await form.discard(answer.stored)
                log.info("vllm-hidden: a client left before its response; its stored hidden states were deleted")
                return None
            return answer
        finally:
            gone.cancel()
            delivered.cancel()

    async def _delivered(self, pending: Pending) -> tuple[Delivery, int]:
        """The worker's rows for this request, and its reservation, which is the form's from here
        on (held by what it stores, or released)."""
        try:
            got: Delivery = await asyncio.wait_for(asyncio.shield(pending.future), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"hidden states did not arrive within {self.cfg.timeout_s:g} s "
                               f"({ServeConfig.ENV['timeout_s']})", status=500) from None
        if got.error is not None:
            raise RequestError(f"hidden-state capture failed: {got.error}", status=500)
        if pending.prompt_ids is None:
            raise RequestError("the engine returned no prompt token ids", status=500)
        reserved, pending.reserved = pending.reserved, 0
        return got, reserved

    async def stream_value(self, pending: Pending) -> list:
        """The `hidden_states` value for a streamed response's last event (stream.StreamSplicer)."""
        got, reserved = await self._delivered(pending)
        return await self._forms[pending.spec.transfer].value(got, pending, reserved)
