"""The server's request field and response object (pure; no vLLM).

Request: `"hidden_states": true` (the server's layers, prompt tokens) or
`{"layers": [ids], "tokens": "prompt" | "all"}`. Response: `"hidden_states": {"format":
"safetensors", "encoding": "base64", "data": ..., "layer_ids": [...], "num_tokens": T, ...}`,
the decoded safetensors holding `hidden_states` [T, K, H] and `token_ids` [T].

With `"tokens": "all"` the rows are the prompt's and then the generated tokens' except the
last one: a sampled token is only run through the model at the next step, and the last one
never is. `token_ids` lists exactly the tokens whose states are returned.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

import torch

FIELD = "hidden_states"
TOKENS_MODES = ("prompt", "all")


class RequestError(ValueError):
    """A bad request: answered with HTTP `status` and this message."""

    def __init__(self, message: str, status: int = 400, param: str | None = FIELD) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 413: "RequestEntityTooLarge"}.get(self.status, "InternalServerError")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True, kw_only=True)
class HiddenStatesSpec:
    """One request's ask, resolved against the server's captured layers."""

    layer_ids: tuple[int, ...]
    columns: tuple[int, ...]  # index of each requested layer among the server's layers
    tokens: str = "prompt"

    @property
    def all_tokens(self) -> bool:
        return self.tokens == "all"


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
        raise RequestError(f"'hidden_states' must be true or an object like {{\"layers\": {allowed}}}, got {_show(value)}")
    unknown = sorted(set(value) - {"layers", "tokens"})
    if unknown:
        raise RequestError(f"'hidden_states' has unknown keys {_show(unknown)}; allowed: 'layers', 'tokens'")
    tokens = value.get("tokens", "prompt")
    if tokens not in TOKENS_MODES:
        raise RequestError(f"'hidden_states.tokens' must be one of {list(TOKENS_MODES)}, got {_show(tokens)}")
    layers = value.get("layers")
    if layers is None:
        layers = allowed
    if not isinstance(layers, list) or not layers:
        raise RequestError(f"'hidden_states.layers' must be a non-empty list of layer ids from {allowed}, got {_show(layers)}")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
        raise RequestError(f"'hidden_states.layers' must hold integer layer ids, got {_show(layers)}")
    if len(set(layers)) != len(layers):
        raise RequestError(f"'hidden_states.layers' has duplicate ids: {_show(layers)}")
    bad = [i for i in layers if i not in server_layers]
    if bad:
        raise RequestError(f"layer ids {_show(bad)} are not captured by this server; allowed layer ids: {allowed}")
    return HiddenStatesSpec(layer_ids=tuple(layers), columns=tuple(allowed.index(i) for i in layers), tokens=tokens)


def returned_token_ids(spec: HiddenStatesSpec, prompt: list[int], generated: list[int]) -> list[int]:
    """The tokens whose states a response carries (see the module doc for "all")."""
    return list(prompt) + list(generated[:-1]) if spec.all_tokens else list(prompt)


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}
_B64_CHUNK = 3 << 20  # a multiple of 3: chunks encode independently


def _b64_into(pieces: list) -> bytearray:
    """base64 of the concatenation of `pieces`, written into one preallocated buffer (no
    concatenated copy of the input, no growing output: fresh host pages are slow to touch)."""
    total = sum(len(p) for p in pieces)
    out = bytearray(4 * ((total + 2) // 3))
    o, carry = 0, b""
    for p in pieces:
        mv, i = memoryview(p).cast("B"), 0
        if carry:
            head = carry + bytes(mv[: 3 - len(carry)])
            i = len(head) - len(carry)
            if len(head) < 3:
                carry = head
                continue
            out[o : o + 4] = binascii.b2a_base64(head, newline=False)
            o, carry = o + 4, b""
        n = (len(mv) - i) // 3 * 3
        for j in range(i, i + n, _B64_CHUNK):
            e = binascii.b2a_base64(mv[j : min(j + _B64_CHUNK, i + n)], newline=False)
            out[o : o + len(e)] = e
            o += len(e)
        carry = bytes(mv[i + n :])
    if carry:
        e = binascii.b2a_base64(carry, newline=False)
        out[o : o + len(e)] = e
        o += len(e)
    if o != len(out):
        raise RuntimeError(f"base64 wrote {o} of {len(out)} bytes")
    return out


def _safetensors_pieces(tensors: dict[str, torch.Tensor]) -> list:
    """A safetensors file as [header, raw bytes of each tensor] without copying the tensors.
    The header is padded with spaces (allowed by the format) to a multiple of 24 bytes
    with its length prefix: data stays 8-aligned, and base64 pieces split on whole groups."""
    meta, offset, raws = {}, 0, []
    for name, t in tensors.items():
        t = t.contiguous()
        n = t.numel() * t.element_size()
        meta[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        raws.append(t.view(torch.uint8).reshape(-1).numpy() if n else b"")
        offset += n
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % 24)
    return [len(header).to_bytes(8, "little") + header, *raws]


def encode_parts(spec: HiddenStatesSpec, rows: torch.Tensor, token_ids: list[int]) -> list:
    """The response's `hidden_states` object as JSON byte pieces (send them in order; their
    concatenation is the object). `rows` [R, K_server, H] holds at least one row per returned
    token (a worker may have computed a row or two past the end)."""
    t = len(token_ids)
    if rows.shape[0] < t:
        raise RequestError(f"hidden states incomplete: {rows.shape[0]} rows captured for {t} tokens", status=500)
    hs = rows[:t]
    if list(spec.columns) != list(range(rows.shape[1])):
        hs = hs.index_select(1, torch.tensor(spec.columns))
    data = _b64_into(_safetensors_pieces({"hidden_states": hs, "token_ids": torch.tensor(token_ids, dtype=torch.int64)}))
    tail = {"layer_ids": list(spec.layer_ids), "num_tokens": t, "tokens": spec.tokens,
            "dtype": str(rows.dtype).replace("torch.", ""), "shape": [t, len(spec.columns), rows.shape[2]]}
    return [b'{"format":"safetensors","encoding":"base64","data":"', data,
            b'",' + json.dumps(tail, separators=(",", ":")).encode()[1:]]


def encode(spec: HiddenStatesSpec, rows: torch.Tensor, token_ids: list[int]) -> bytes:
    """`encode_parts` joined: the `hidden_states` object as JSON bytes."""
    return b"".join(encode_parts(spec, rows, token_ids))


def decode(obj: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A response's `hidden_states` object -> {"hidden_states": [T, K, H], "token_ids": [T]}."""
    from safetensors.torch import load

    if obj.get("format") != "safetensors" or obj.get("encoding") != "base64":
        raise ValueError(f"not a vllm-hidden hidden_states object: format={obj.get('format')!r} "
                         f"encoding={obj.get('encoding')!r}")
    return load(base64.b64decode(obj["data"]))
