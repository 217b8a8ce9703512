"""The safetensors container: dtype names, and the one header parser and builder in the tree.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape and [start, end) offsets into the data section; "__metadata__" -> str -> str),
then the data. The header may be padded with spaces: our shards reserve room for it before
their rows are known, the server pads so the data stays aligned.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                                       torch.int64: "I64", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
METADATA = "__metadata__"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype we store ("BF16", ...)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; stored dtypes are {sorted(map(str, DTYPE_NAMES))}") from None


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported tensor dtype {name!r}; known: {sorted(_DTYPES)}") from None


@dataclass(frozen=True, kw_only=True)
class Tensor:
    """One tensor's entry: its dtype, shape and absolute [start, end) byte range in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one index along the first dimension)."""
        return self.dtype.itemsize * math.prod(self.shape[1:])


@dataclass(frozen=True, kw_only=True)
class Header:
    metadata: dict[str, str]
    tensors: dict[str, Tensor]  # in the header's order
    data_start: int  # file offset of the data section: 8 + the header's length


def parse_header(read: Callable[[int, int], bytes], size: int | None = None) -> Header:
    """The header of a safetensors file whose bytes `read(offset, n)` returns (a local file,
    a ranged GET, a buffer), `size` bytes long if known. Every entry is checked against the
    format: a known dtype, a shape whose bytes are its offsets' span, inside the file.
    ValueError says what is wrong (callers add which file)."""
    head = read(0, 8)
    if len(head) != 8:
        raise ValueError(f"{len(head)} bytes, not a safetensors file")
    n = int.from_bytes(head, "little")
    limit = MAX_HEADER_BYTES if size is None else min(MAX_HEADER_BYTES, size - 8)
    if not 2 <= n <= limit:
        raise ValueError(f"a header length of {n} bytes" + (f" in a file of {size}" if size is not None else ""))
    try:
        raw = json.loads(read(8, n))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"a header that is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"a header that is not a JSON object: {type(raw).__name__}")
    data_start = 8 + n
    meta = raw.pop(METADATA, None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{METADATA} must map names to strings, got {meta!r:.200}")
    tensors = {}
    for name, entry in raw.items():
        try:
            dtype, shape, (lo, hi) = dtype_of(entry["dtype"]), tuple(entry["shape"]), entry["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in (*shape, lo, hi)) or lo > hi:
                raise ValueError(f"shape {list(shape)} / offsets {[lo, hi]} are not valid")
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"tensor {name!r} has a bad entry {entry!r:.200} ({err})") from None
        if hi - lo != dtype.itemsize * math.prod(shape):
            raise ValueError(f"tensor {name!r}: {hi - lo} bytes for shape {list(shape)} of {dtype}")
        if size is not None and data_start + hi > size:
            raise ValueError(f"tensor {name!r} ends at byte {data_start + hi}, past the file's {size}")
        tensors[name] = Tensor(dtype=dtype, shape=shape, start=data_start + lo, end=data_start + hi)
    return Header(metadata=meta, tensors=tensors, data_start=data_start)


def entries(tensors: Iterable[tuple[str, torch.dtype, Iterable[int]]], start: int = 0) -> tuple[dict[str, Any], int]:
    """Header entries for tensors laid out back to back in this order from data offset
    `start`: ({name: {dtype, shape, data_offsets}}, end offset)."""
    out, end = {}, start
    for name, dtype, shape in tensors:
        shape = [int(d) for d in shape]
        n = dtype.itemsize * math.prod(shape)
        out[name] = {"dtype": dtype_name(dtype), "shape": shape, "data_offsets": [end, end + n]}
        end += n
    return out, end


def build_header(entries_: Mapping[str, Any], metadata: Mapping[str, str] | None = None, *, room: int | None = None,
                 multiple: int = 8) -> bytes:
    """The length prefix and JSON header, padded with spaces (valid safetensors) to exactly
    `room` bytes, or else to a multiple of `multiple` bytes, so the data after it is aligned."""
    body = {METADATA: dict(metadata), **entries_} if metadata else dict(entries_)
    header = json.dumps(body, separators=(",", ":")).encode()
    total = room if room is not None else 8 + len(header) + (-(8 + len(header)) % multiple)
    if 8 + len(header) > total:
        raise ValueError(f"a safetensors header of {len(header)} bytes overflows the {total - 8} reserved for it")
    return (total - 8).to_bytes(8, "little") + header + b" " * (total - 8 - len(header))


def pieces(tensors: Mapping[str, torch.Tensor], multiple: int = 8, metadata: Mapping[str, str] | None = None) -> list:
    """A safetensors file as [header, raw bytes of each tensor], the tensors not copied."""
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    ents, _ = entries((name, t.dtype, t.shape) for name, t in tensors.items())
    raws = [t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b"" for t in tensors.values()]
    return [build_header(ents, metadata, multiple=multiple), *raws]


def load(buf: bytearray | bytes) -> dict[str, torch.Tensor]:
    """A safetensors file in memory -> its tensors, viewing `buf` (no copy when it is writable)."""
    view = memoryview(buf)
    try:
        header = parse_header(lambda offset, n: bytes(view[offset : offset + n]), len(buf))
    except ValueError as e:
        raise ValueError(f"not a safetensors file: {e}") from None
    out = {}
    for name, t in header.tensors.items():
        with warnings.catch_warnings():  # bytes are read-only; nothing writes to them
            warnings.simplefilter("ignore")
            raw = torch.frombuffer(buf, dtype=torch.uint8, offset=t.start, count=t.nbytes) if t.nbytes \
                else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(t.dtype).reshape(t.shape)
    return out
