"""ASGI middleware that adds hidden states to vLLM's own OpenAI server.

Loaded with vLLM's `--middleware vllm_hidden.server.HiddenStatesMiddleware` (what
`vllm-hidden serve` passes). On POST /v1/completions and /v1/chat/completions:
- a request without the `hidden_states` field goes to vLLM untouched (its body bytes too,
  unless it smuggles one of our reserved `vllm_xargs` keys, which are removed);
- a request with it is checked (vLLM's own --api-key check first), the field is replaced by a
  server-made token in `vllm_xargs`, and vLLM serves it as usual; the engine hook
  (`engine/serving.py`) turns the token into capture settings for the worker. The response
  JSON (or, streaming, the last event before `[DONE]`) gets a `hidden_states` object spliced
  in, built from the rows the worker sent over the channel and the token ids vLLM returned:
  inline (base64 in the JSON) or, for `"transfer": "fetch"`, a URL on this server.
On GET /v1/hidden_states/{id} (behind vLLM's --api-key check like every /v1 path): a fetch-form
response's safetensors bytes, once (`store.FetchStore`), from whichever API server process
the connection reached.
Nothing in a request names a file or socket: each API server process binds its own channel
address and names it to the worker in the request's (keyed) capture settings.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import mmap
import os
import secrets
from typing import Any

from vllm_hidden.config import ServeConfig
from vllm_hidden.engine.serving import RESERVED_PREFIX, TOKEN_KEY, install_generate_hook
from vllm_hidden.server.protocol import (FETCH_PATH, FIELD, RequestError, fetch_parts, inline_parts, parse_field,
                                         prepare, returned_token_ids)
from vllm_hidden.server.registry import REGISTRY, Pending

log = logging.getLogger("vllm_hidden")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
_MARKERS = (FIELD.encode(), RESERVED_PREFIX.encode())


def _path(scope: dict[str, Any]) -> str:
    return scope["path"].removeprefix(scope.get("root_path", "") or "")


async def _read_body(receive, limit: int) -> tuple[bytes, bool]:
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


def _too_large(limit: int) -> RequestError:
    return RequestError(f"a request with hidden_states must be at most {limit} bytes "
                        f"(--max-request-bytes / {ServeConfig.ENV['max_request_bytes']})", status=413, param=None)


class _ScanningReceive:
    """Passes an over-limit body through to vLLM untouched (vLLM decides about it) while
    looking for our field; if it turns up, vLLM is told the client left, and we answer 413."""

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


def _maybe_hidden(body: bytes) -> bool:
    """A body the marker scan cannot clear: JSON may spell a key with \\u escapes, and a
    UTF-16/32 body (NUL bytes) holds no ASCII marker at all; such bodies are parsed."""
    return b"\\u" in body or b"\x00" in body


def _is_json(scope: dict[str, Any]) -> bool:
    ctype = next((v for k, v in scope.get("headers", []) if k.lower() == b"content-type"), b"")
    return b"json" in ctype.lower()


def _replay(body: bytes, receive):
    """A `receive` that hands the (already read) body over once, then the client's events
    (vLLM listens for a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_length(scope: dict[str, Any], n: int) -> dict[str, Any]:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(n).encode()))
    return {**scope, "headers": headers}


def _strip_reserved(req: dict[str, Any]) -> bool:
    xargs = req.get("vllm_xargs")
    if not isinstance(xargs, dict):
        return False
    ours = [k for k in xargs if isinstance(k, str) and k.startswith(RESERVED_PREFIX)]
    for k in ours:
        del xargs[k]
    return bool(ours)


def _check_shape(req: dict[str, Any], path: str) -> None:
    """One engine request per HTTP request: one set of states per response."""
    n = req.get("n")
    if n not in (None, 1):
        raise RequestError(f"hidden_states needs n=1 (one sequence per response), got n={n!r}", param="n")
    if req.get("use_beam_search"):
        raise RequestError("hidden_states cannot be combined with use_beam_search", param="use_beam_search")
    if path == "/v1/completions":
        p = req.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) > 1:
            raise RequestError(f"hidden_states needs a single prompt per request, got a list of {len(p)}", param="prompt")


def _splice_parts(obj_json: bytes, key: bytes, value: list) -> list:
    """Byte pieces of a JSON object's bytes with `"key": <value pieces>` added, without
    re-serializing it or copying the value."""
    end = obj_json.rstrip()
    if not end.endswith(b"}"):
        raise ValueError("response is not a JSON object")
    body = end[:-1].rstrip()
    sep = b"" if body.endswith(b"{") else b","
    return [body, sep + b'"' + key + b'":', *value, b"}"]


_SEND_CHUNK = 1 << 20
SEND_CHUNK_FETCH = 4 << 20


async def _send_body(send, parts: list, more: bool, chunk: int = _SEND_CHUNK) -> None:
    """Send byte pieces as body messages of at most `chunk` bytes: a response of hundreds of
    MB is never joined into one more copy, and the server's write buffer stays small (each
    send waits for the socket to drain)."""
    chunks = [memoryview(p)[i : i + chunk] for p in parts for i in range(0, len(p), chunk)]
    if not chunks:
        chunks = [b""]
    for i, c in enumerate(chunks):
        await send({"type": "http.response.body", "body": c, "more_body": more or i < len(chunks) - 1})


async def _send_json(send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _map(fd: int) -> memoryview:
    """A file's bytes, mapped, not read: the socket sends straight from the (tmpfs) pages, no
    copy here. The mapping lives as long as the transport holds slices of it."""
    size = os.fstat(fd).st_size
    if not size:
        return memoryview(b"")
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # page tables filled here, in a thread
    return memoryview(mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ))


class HiddenStatesMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        self.cfg = ServeConfig.from_env(os.environ)
        self._layers: tuple[int, ...] | None = None
        self._auth: tuple[type, tuple, dict] | None = None
        self._auth_checked = False
        self._receiver = None
        self._address = ""
        self._slots: asyncio.Semaphore | None = None
        self._store = None  # store.FetchStore, made with the first fetch-form request or GET
        self._processes = 1
        install_generate_hook(REGISTRY.get)

    # -- setup (first request; vLLM builds the app's state before serving) --------------
    def _setup(self, scope: dict[str, Any]) -> None:
        if self._layers is not None:
            return
        from vllm_hidden.config import CaptureConfig
        from vllm_hidden.capture.channel import Receiver, channel_key, new_address

        app = scope["app"]
        client = getattr(app.state, "engine_client", None)
        vcfg = client.vllm_config if client else None
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
        self._receiver = Receiver(self._address, REGISTRY.deliver)
        self._receiver.start()
        self._slots = asyncio.Semaphore(self.cfg.max_concurrent)
        mc = vcfg.model_config
        self._hidden, self._itemsize = mc.get_hidden_size(), mc.dtype.itemsize
        self._processes = max(1, int(getattr(vcfg.parallel_config, "_api_process_count", 1) or 1))
        self._layers = tuple(cap.layer_ids)
        log.info("vllm-hidden: serving hidden states of layers %s on %s (API server process %s of %d)",
                 list(cap.layer_ids), ", ".join(ENDPOINTS),
                 getattr(vcfg.parallel_config, "_api_process_rank", 0), self._processes)

    def _fetch_store(self):
        """This process's view of the server's fetch-form directory (made on first use)."""
        if self._store is None:
            from vllm_hidden.capture.channel import DIR_ENV
            from vllm_hidden.server.store import FetchStore

            root = os.environ.get(DIR_ENV)
            if not root:
                raise RequestError(f"the fetch form is not configured ({DIR_ENV} is unset)", status=500)
            self._store = FetchStore(root, max(1, self.cfg.max_unfetched_bytes // self._processes), self.cfg.fetch_ttl_s)
            atexit.register(self._store.close)
            asyncio.get_running_loop().create_task(self._sweep())
        return self._store

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.cfg.fetch_ttl_s / 4))
            try:
                self._store.sweep()
            except OSError:  # the directory was removed under us: nothing left to hold
                log.exception("vllm-hidden: sweeping unfetched hidden states")

    def _find_auth(self, scope: dict[str, Any]) -> None:
        """vLLM's --api-key check (its own middleware, which sits inside ours), to run before
        anything of ours answers."""
        if self._auth_checked:
            return
        for m in getattr(scope.get("app"), "user_middleware", []):
            if getattr(m.cls, "__name__", "") == "AuthenticationMiddleware":
                self._auth = (m.cls, tuple(m.args), dict(m.kwargs))
        self._auth_checked = True

    def _guarded(self, handler):
        if self._auth is None:
            return handler
        cls, args, kwargs = self._auth
        return cls(handler, *args, **kwargs)

    # -- ASGI ------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("method") == "GET" and _path(scope).startswith(FETCH_PATH):
            self._find_auth(scope)
            return await self._guarded(self._fetch)(scope, receive, send)
        if scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        ours = _path(scope) in ENDPOINTS
        if not ours and not _is_json(scope):
            return await self.app(scope, receive, send)
        self._find_auth(scope)
        limit = self.cfg.max_request_bytes
        try:
            body, complete = await _read_body(receive, limit)
        except ConnectionResetError:
            return None
        if not ours:
            return await self._elsewhere(scope, receive, send, body, complete)
        if len(body) > limit:
            if FIELD.encode() in body:
                return await self._guarded(self._error_app(_too_large(limit)))(scope, receive, send)
            if complete:
                return await self.app(scope, _replay(body, receive), send)
            return await self._pass_large(scope, _ScanningReceive(body, receive), send, limit)
        if not any(m in body for m in _MARKERS) and not _maybe_hidden(body):
            return await self.app(scope, _replay(body, receive), send)
        try:
            req = json.loads(body)
        except (ValueError, RecursionError):  # deep nesting too: vLLM answers it (400)
            req = None
        if not isinstance(req, dict):  # vLLM answers malformed JSON itself
            return await self.app(scope, _replay(body, receive), send)
        stripped = _strip_reserved(req)
        if FIELD not in req:
            if stripped:
                body = json.dumps(req).encode()
                scope = _with_length(scope, len(body))
            return await self.app(scope, _replay(body, receive), send)
        value = req.pop(FIELD)

        async def handler(scope, receive_, send_):
            try:
                self._setup(scope)
                spec = parse_field(value, self._layers)
                if spec is not None:
                    _check_shape(req, _path(scope))
            except RequestError as e:
                return await _send_json(send_, e.status, e.body())
            if spec is None:  # "hidden_states": false / null
                b = json.dumps(req).encode()
                return await self.app(_with_length(scope, len(b)), _replay(b, receive), send_)
            async with self._slots:
                await self._serve(scope, receive, send_, req, spec)

        return await self._guarded(handler)(scope, receive, send)

    async def _fetch(self, scope, receive, send) -> None:
        """GET /v1/hidden_states/{id}: the bytes, once; 404 for an unknown, expired or
        already fetched id."""
        entry = _path(scope)[len(FETCH_PATH):]
        try:
            self._setup(scope)
            fd = self._fetch_store().open(entry)
        except RequestError as e:
            return await _send_json(send, e.status, e.body())
        if fd is None:
            err = RequestError(f"no hidden states with id {entry[:64]!r}: unknown, expired (after "
                               f"{self.cfg.fetch_ttl_s:g} s) or already fetched", status=404, param=None)
            return await _send_json(send, 404, err.body())
        try:
            view = await asyncio.to_thread(_map, fd)
        finally:
            os.close(fd)
        size = len(view)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())]})
        await _send_body(send, [view], more=False, chunk=SEND_CHUNK_FETCH)

    async def _elsewhere(self, scope, receive, send, body: bytes, complete: bool) -> None:
        """A JSON POST to another endpoint (/v1/responses, /v1/messages, /invocations, ...):
        vLLM would ignore the field and answer without states, so a request that asks for
        them is refused, naming the endpoints that serve them."""
        if not complete:
            return await self._pass_large(scope, _ScanningReceive(body, receive), send, self.cfg.max_request_bytes)
        if any(m in body for m in _MARKERS) or _maybe_hidden(body):
            try:
                req = json.loads(body)
            except (ValueError, RecursionError):
                req = None
            if isinstance(req, dict) and FIELD in req:
                err = RequestError(f"{_path(scope)} does not return hidden states; send \"{FIELD}\" to "
                                   f"{' or '.join(ENDPOINTS)}")
                return await self._guarded(self._error_app(err))(scope, receive, send)
        return await self.app(scope, _replay(body, receive), send)

    async def _pass_large(self, scope, receive: _ScanningReceive, send, limit: int) -> None:
        started = False

        async def send_(msg):
            nonlocal started
            if receive.found:
                return  # answered below
            started = True
            await send(msg)

        try:
            await self.app(scope, receive, send_)
        except Exception:  # noqa: BLE001 - vLLM saw a "disconnect"; it is our 413 to give
            if not receive.found:
                raise
        if receive.found and not started:
            await self._guarded(self._error_app(_too_large(limit)))(scope, receive, send)

    @staticmethod
    def _error_app(err: RequestError):
        async def app(scope, receive, send):
            await _send_json(send, err.status, err.body())

        return app

    async def _serve(self, scope, receive, send, req: dict[str, Any], spec) -> None:
        token = secrets.token_urlsafe(18)
        admit = None
        if spec.fetch:
            try:
                store = self._fetch_store()
            except (RequestError, OSError) as e:
                err = e if isinstance(e, RequestError) else RequestError(f"the fetch form is unavailable: {e}", status=500)
                return await _send_json(send, err.status, err.body())
            row_bytes = len(spec.columns) * self._hidden * self._itemsize + 8  # the rows and their token ids

            def admit(rows: int) -> str | None:
                want = rows * row_bytes + 4096  # + the safetensors header
                why = store.reserve(want)
                if why is None:
                    pending.reserved = want
                return why

        pending = REGISTRY.add(token, spec, self.cfg.max_hidden_tokens, reply_to=self._address, admit=admit,
                               root_path=scope.get("root_path", "") or "")
        try:
            xargs = req.get("vllm_xargs")
            req["vllm_xargs"] = {**(xargs if isinstance(xargs, dict) else {}), TOKEN_KEY: token}
            body = json.dumps(req).encode()
            scope = _with_length(scope, len(body))
            if req.get("stream"):
                await self.app(scope, _replay(body, receive), _StreamSplicer(send, pending, self))
            else:
                await self._serve_json(scope, _replay(body, receive), send, pending)
        finally:
            REGISTRY.remove(token)
            if pending.reserved:  # never stored (an error, the client left)
                self._store.release(pending.reserved)

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
            err = pending.rejection()
            return await _send_json(send, err.status, err.body())
        body = b"".join(chunks)
        if start is None:
            return None
        parts = [body]
        if start["status"] == 200 and body.lstrip()[:1] == b"{":  # not e.g. `null` after a hang-up
            try:
                parts = _splice_parts(body, FIELD.encode(), await self.hidden_states_json(pending))
            except RequestError as e:
                return await _send_json(send, e.status, e.body())
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(sum(len(p) for p in parts)).encode()))
        await send({**start, "headers": headers})
        await _send_body(send, parts, more=False)

    async def hidden_states_json(self, pending: Pending) -> list:
        """Wait for the worker's rows, then encode them (off the event loop: it is MBs) into
        JSON byte pieces: inline, or stored for one GET and the object saying where."""
        try:
            rows, error, finite = await asyncio.wait_for(asyncio.shield(pending.future), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"hidden states did not arrive within {self.cfg.timeout_s:g} s "
                               f"({ServeConfig.ENV['timeout_s']})", status=500) from None
        if error is not None:
            raise RequestError(f"hidden-state capture failed: {error}", status=500)
        if pending.prompt_ids is None:
            raise RequestError("the engine returned no prompt token ids", status=500)
        ids = returned_token_ids(pending.spec, pending.prompt_ids, pending.generated)
        prepared = await asyncio.to_thread(prepare, pending.spec, rows, ids, not finite)
        bad = prepared.meta["not_finite"]
        if bad["count"]:
            log.warning("vllm-hidden: %d NaN/Inf values in the hidden states of %d tokens of a response (first at "
                        "token %d, layer ids %s); returned as they are", bad["count"], bad["tokens"],
                        bad["first_token"], bad["layer_ids"])
        if not pending.spec.fetch:
            return await asyncio.to_thread(inline_parts, prepared)
        reserved, pending.reserved = pending.reserved, 0
        try:
            entry, size = await self._store.put(prepared.pieces, reserved)
        except OSError as e:
            raise RequestError(f"could not keep the hidden states for fetching: {e}", status=500) from None
        url = pending.root_path + FETCH_PATH + entry
        return fetch_parts(prepared, url, size, self.cfg.fetch_ttl_s)


class _StreamSplicer:
    """`send` for a streaming (SSE) response: passes events through one behind, and adds
    `hidden_states` to the last event before `data: [DONE]`."""

    def __init__(self, send, pending: Pending, mw: HiddenStatesMiddleware) -> None:
        self.send, self.pending, self.mw = send, pending, mw
        self.start: dict[str, Any] | None = None
        self.started = self.dropped = self.passthrough = False
        self.buf = b""
        self.held: bytes | None = None

    async def _emit(self, data, more: bool = True) -> None:
        await _send_body(self.send, [data], more)

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
                err = self.pending.rejection()
                return await _send_json(self.send, err.status, err.body())
            self.started = True
            await self.send(self.start)
            self.passthrough = self.start.get("status") != 200
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
            value = await self.mw.hidden_states_json(self.pending)
        except RequestError as e:
            value = [json.dumps(e.body()).encode()]
        try:
            return [head + b"data: ", *_splice_parts(data, FIELD.encode(), value), b"\n\n"]
        except ValueError:
            return [event]
