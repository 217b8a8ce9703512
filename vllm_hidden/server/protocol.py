"""The server's request field and response object (pure; no vLLM), and the client helpers.

Request: `"hidden_states": true` (the server's layers, prompt tokens) or
`{"layers": [ids], "tokens": "prompt" | "all", "transfer": "inline" | "fetch"}`. Response,
inline (the default): `"hidden_states": {"format": "safetensors", "encoding": "base64",
"data": ..., "layer_ids": [...], "num_tokens": T, ...}`, the decoded safetensors holding
`hidden_states` [T, K, H] and `token_ids` [T]. With "fetch" the same safetensors bytes are
not in the response but at `"url"`, for one GET with the same API key (`fetch` below).
Both forms carry `"not_finite"`: how many values are NaN or Inf and the first token with one.

With `"tokens": "all"` the rows are the prompt's and then the generated tokens' except the
last one: a sampled token is only run through the model at the next step, and the last one
never is. `token_ids` lists exactly the tokens whose states are returned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pybase64
import torch

from vllm_hidden.format import header as st
from vllm_hidden.format.quant import bad_values

FIELD = "hidden_states"
TOKENS_MODES = ("prompt", "all")
TRANSFERS = ("inline", "fetch")
CONNECTOR = "connector"
FETCH_PATH = "/v1/hidden_states/"


class RequestError(ValueError):
    """A bad request: answered with HTTP `status` and this message."""

    def __init__(self, message: str, status: int = 400, param: str | None = FIELD,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.retry_after = retry_after  # seconds, sent as the Retry-After header (a 503 that will pass)

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestEntityTooLarge", 503: "ServiceUnavailableError"}.get(self.status, "InternalServerError")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True, kw_only=True)
class HiddenStatesSpec:
    """One request's ask, resolved against the server's captured layers."""

    layer_ids: tuple[int, ...]
    columns: tuple[int, ...]  # index of each requested layer among the server's layers
    tokens: str = "prompt"
    transfer: str = "inline"

    @property
    def all_tokens(self) -> bool:
        return self.tokens == "all"

    @property
    def fetch(self) -> bool:
        return self.transfer == "fetch"

    @property
    def connector(self) -> bool:
        """The connector form (server-made, never asked for in a request): a file in the
        connector's storage path, named in the response's kv_transfer_params."""
        return self.transfer == CONNECTOR


def _show(v: Any, most: int = 300) -> str:
    """A bad value for an error message, cut short: a 20 MB value must not come back whole."""
    r = repr(v)
    return r if len(r) <= most else f"{r[:most]}... ({len(r)} characters)"


def parse_field(value: Any, server_layers: tuple[int, ...]) -> HiddenStatesSpec | None:
    """The request's `hidden_states` value -> spec; None/false -> None (not asked)."""
    if value is None or value is False:
        return None
    allowed = list(server_layers)
    if value is True:
        return HiddenStatesSpec(layer_ids=tuple(server_layers), columns=tuple(range(len(server_layers))))
    if not isinstance(value, dict):
        raise RequestError("'hidden_states' must be true or an object like "
                           f"{{\"layers\": {allowed}}}, got {_show(value)}")
    unknown = sorted(set(value) - {"layers", "tokens", "transfer"})
    if unknown:
        raise RequestError(f"'hidden_states' has unknown keys {_show(unknown)}; "
                           "allowed: 'layers', 'tokens', 'transfer'")
    tokens = value.get("tokens", "prompt")
    if tokens not in TOKENS_MODES:
        raise RequestError(f"'hidden_states.tokens' must be one of {list(TOKENS_MODES)}, got {_show(tokens)}")
    transfer = value.get("transfer", "inline")
    if transfer not in TRANSFERS:
        raise RequestError(f"'hidden_states.transfer' must be one of {list(TRANSFERS)}, got {_show(transfer)}")
    layers = value.get("layers")
    if layers is None:
        layers = allowed
    if not isinstance(layers, list) or not layers:
        raise RequestError(f"'hidden_states.layers' must be a non-empty list of layer ids from {allowed}, "
                           f"got {_show(layers)}")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
        raise RequestError(f"'hidden_states.layers' must hold integer layer ids, got {_show(layers)}")
    if len(set(layers)) != len(layers):
        raise RequestError(f"'hidden_states.layers' has duplicate ids: {_show(layers)}")
    bad = [i for i in layers if i not in server_layers]
    if bad:
        raise RequestError(f"layer ids {_show(bad)} are not captured by this server; allowed layer ids: {allowed}")
    return HiddenStatesSpec(layer_ids=tuple(layers), columns=tuple(allowed.index(i) for i in layers), tokens=tokens,
                            transfer=transfer)


def returned_token_ids(spec: HiddenStatesSpec, prompt: list[int], generated: list[int]) -> list[int]:
    """The tokens whose states a response carries (see the module doc for "all")."""
    return list(prompt) + list(generated[:-1]) if spec.all_tokens else list(prompt)


_B64_CHUNK = 3 << 20  # a multiple of 3: chunks encode independently


def _b64_pieces(pieces: list) -> list:
    """base64 of the concatenation of `pieces`, as a list of encoded chunks: no concatenated
    copy of the input or the output, and the encoder (SIMD, GIL released) runs a few MB at a
    time, so the API server's event loop is never held for a whole response."""
    out, carry = [], b""
    for p in pieces:
        mv, i = memoryview(p).cast("B"), 0
        if carry:
            head = carry + bytes(mv[: 3 - len(carry)])
            i = len(head) - len(carry)
            if len(head) < 3:
                carry = head
                continue
            out.append(pybase64.b64encode(head))
            carry = b""
        n = (len(mv) - i) // 3 * 3
        out += [pybase64.b64encode(mv[j : min(j + _B64_CHUNK, i + n)]) for j in range(i, i + n, _B64_CHUNK)]
        carry = bytes(mv[i + n :])
    if carry:
        out.append(pybase64.b64encode(carry))
    return out


def finiteness(hs: torch.Tensor, layer_ids: tuple[int, ...], suspect: bool = True) -> dict[str, Any]:
    """The response's `not_finite` object for states `hs` [T, K, H]: the count of NaN/Inf
    values, of tokens holding one, the first such token (index into `token_ids`) and its
    layers. `suspect=False` (the worker's row statistics say every row is finite) skips the
    pass over the values."""
    bad = bad_values(hs) if suspect else None
    if bad is None:
        return {"count": 0, "tokens": 0, "first_token": None, "layer_ids": []}
    rows = bad.any(dim=(1, 2)).nonzero().flatten()
    return {"count": int(bad.sum()), "tokens": int(rows.numel()), "first_token": int(rows[0]),
            "layer_ids": [layer_ids[k] for k in bad[int(rows[0])].any(dim=1).nonzero().flatten().tolist()]}


@dataclass(kw_only=True)
class Prepared:
    """One response's states, ready to go out: the safetensors pieces and the object's keys
    other than the bytes (or where to fetch them)."""

    pieces: list
    meta: dict[str, Any]


def prepare(spec: HiddenStatesSpec, rows: torch.Tensor, token_ids: list[int], suspect: bool = True) -> Prepared:
    """`rows` [R, K_server, H] holds at least one row per returned token (a worker may have
    computed a row or two past the end)."""
    t = len(token_ids)
    if rows.shape[0] < t:
        raise RequestError(f"hidden states incomplete: {rows.shape[0]} rows captured for {t} tokens", status=500)
    hs = rows[:t]
    if list(spec.columns) != list(range(rows.shape[1])):
        hs = hs.index_select(1, torch.tensor(spec.columns))
    meta = {"layer_ids": list(spec.layer_ids), "num_tokens": t, "tokens": spec.tokens,
            "dtype": str(rows.dtype).replace("torch.", ""), "shape": [t, len(spec.columns), rows.shape[2]],
            "not_finite": finiteness(hs, spec.layer_ids, suspect)}
    # padded to 24 bytes with its length prefix: data stays 8-aligned, and base64 pieces split on whole groups
    pieces = st.pieces({"hidden_states": hs, "token_ids": torch.tensor(token_ids, dtype=torch.int64)}, multiple=24)
    return Prepared(pieces=pieces, meta=meta)


def _tail(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()[1:]


def inline_parts(p: Prepared) -> list:
    """The inline `hidden_states` object as JSON byte pieces (their concatenation is the object)."""
    return [b'{"format":"safetensors","encoding":"base64","transfer":"inline","data":"', *_b64_pieces(p.pieces),
            b'",' + _tail(p.meta)]


def fetch_parts(p: Prepared, url: str, nbytes: int, ttl_s: float) -> list:
    """The fetch `hidden_states` object: where to GET the safetensors bytes, once, within `ttl_s`."""
    head = {"format": "safetensors", "transfer": "fetch", "url": url, "bytes": nbytes, "expires_in": ttl_s}
    return [json.dumps(head, separators=(",", ":")).encode()[:-1] + b"," + _tail(p.meta)]


def encode_parts(spec: HiddenStatesSpec, rows: torch.Tensor, token_ids: list[int]) -> list:
    """The inline `hidden_states` object as JSON byte pieces."""
    return inline_parts(prepare(spec, rows, token_ids))


def encode(spec: HiddenStatesSpec, rows: torch.Tensor, token_ids: list[int]) -> bytes:
    """`encode_parts` joined: the inline `hidden_states` object as JSON bytes."""
    return b"".join(encode_parts(spec, rows, token_ids))


# -- client helpers ------------------------------------------------------------------------
def decode(obj: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An inline `hidden_states` object -> {"hidden_states": [T, K, H], "token_ids": [T]}."""
    if obj.get("transfer") == "fetch":
        raise ValueError("this hidden_states object is the fetch form: get its bytes with "
                         "vllm_hidden.server.fetch(client_or_url, obj)")
    if obj.get("format") != "safetensors" or obj.get("encoding") != "base64":
        raise ValueError(f"not a vllm-hidden hidden_states object: format={obj.get('format')!r} "
                         f"encoding={obj.get('encoding')!r}")
    return st.load(pybase64.b64decode_as_bytearray(obj["data"]))


def fetch(client_or_url: Any, obj: dict[str, Any], *, api_key: str | None = None,
          timeout: float = 600.0) -> dict[str, torch.Tensor]:
    """A fetch-form `hidden_states` object -> {"hidden_states": [T, K, H], "token_ids": [T]}:
    one GET of its `url` on the server that answered. `client_or_url` is an `openai.OpenAI`
    client (its base URL and API key are used) or the server's URL ("http://host:8000", a
    "/v1" suffix is fine) with `api_key`. The server gives the bytes once: a second fetch of
    the same object is a 404, as is one after `expires_in` seconds."""
    import urllib.error
    import urllib.parse
    import urllib.request

    if obj.get("transfer") != "fetch" or not isinstance(obj.get("url"), str):
        raise ValueError(f"not a fetch-form hidden_states object (transfer={obj.get('transfer')!r}); "
                         "inline states are read with vllm_hidden.server.decode(obj)")
    if isinstance(client_or_url, str):
        base = client_or_url
    else:
        base = str(getattr(client_or_url, "base_url", "") or "")
        if api_key is None:
            api_key = getattr(client_or_url, "api_key", None)
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"client_or_url must be an OpenAI client or an http(s) URL, got {client_or_url!r}")
    url = urllib.parse.urljoin(base, obj["url"])
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            n = int(r.headers.get("Content-Length", -1))
            if n < 0:
                raise RuntimeError(f"GET {url}: no Content-Length in the answer")
            buf = bytearray(n)
            view, got = memoryview(buf), 0
            while got < n:
                k = r.readinto(view[got:])
                if not k:
                    raise RuntimeError(f"GET {url}: the connection closed after {got} of {n} bytes")
                got += k
    except urllib.error.HTTPError as e:
        detail = e.read()[:1000].decode(errors="replace")
        raise RuntimeError(f"GET {url}: HTTP {e.code}: {detail}") from None
    if obj.get("bytes") is not None and n != obj["bytes"]:
        raise RuntimeError(f"GET {url}: {n} bytes, the response said {obj['bytes']}")
    return st.load(buf)
