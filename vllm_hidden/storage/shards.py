"""Shard writer: many samples per safetensors file, rolled at a size limit.

Each shard holds `hidden_states` [R, K, H] (the samples' rows back to back), `token_ids`
[R] int64, and in its metadata the per-sample index (id, row offset, token count). The file
is written directly from the sample tensors' memory behind a valid safetensors header (no
concatenation copy, no serialize-to-bytes copy), to a temporary name, fsynced, then renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_hidden.config import ShardConfig

FORMAT = "vllm-hidden/1"
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    file: str
    bytes: int
    sha256: str
    num_samples: int
    num_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _raw(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> tuple[int, str]:
    """Write a safetensors file whose tensor `name` is the row-wise concatenation of the
    listed parts, streaming each part's memory; fsync; returns (bytes, sha256 hex)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, parts in tensors.items():
        if not parts:
            raise ValueError(f"tensor {name!r} has no parts")
        dtype, tail = parts[0].dtype, tuple(parts[0].shape[1:])
        for p in parts:
            if p.dtype != dtype or tuple(p.shape[1:]) != tail:
                raise ValueError(f"tensor {name!r}: part {tuple(p.shape)} {p.dtype} does not match {tail} {dtype}")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: unsupported dtype {dtype}")
        rows = sum(p.shape[0] for p in parts)
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": [rows, *tail], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    h = hashlib.sha256()
    total = 0
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(hbytes)), hbytes):
            f.write(chunk)
            h.update(chunk)
            total += len(chunk)
        for parts in tensors.values():
            for p in parts:
                mv = _raw(p)
                f.write(mv)
                h.update(mv)
                total += len(mv)
        f.flush()
        os.fsync(f.fileno())
    return total, h.hexdigest()


class ShardWriter:
    """Buffers finished samples and writes a shard whenever `max_shard_bytes` is reached."""

    def __init__(self, cfg: ShardConfig, layer_ids: list[int]) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = list(layer_ids)
        self.shards: list[ShardInfo] = []
        self._samples: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        self._bytes = 0

    def add(self, sample_id: Any, token_ids: torch.Tensor, hidden_states: torch.Tensor) -> None:
        if hidden_states.dim() != 3 or hidden_states.shape[1] != len(self.layer_ids):
            raise ValueError(
                f"sample {sample_id!r}: hidden_states shape {tuple(hidden_states.shape)} does not "
                f"match [T, {len(self.layer_ids)}, H]"
            )
        if token_ids.shape != (hidden_states.shape[0],):
            raise ValueError(f"sample {sample_id!r}: {token_ids.shape[0]} token ids for {hidden_states.shape[0]} rows")
        self._samples.append((sample_id, token_ids.to(torch.int64), hidden_states))
        self._bytes += hidden_states.numel() * hidden_states.element_size() + token_ids.numel() * 8
        if self._bytes >= self.cfg.max_shard_bytes:
            self.flush()

    def flush(self) -> ShardInfo | None:
        if not self._samples:
            return None
        name = f"{self.cfg.prefix}-{len(self.shards):05d}.safetensors"
        index, row = [], 0
        for sid, tok, _ in self._samples:
            index.append([sid, row, int(tok.shape[0])])
            row += int(tok.shape[0])
        meta = {"format": FORMAT, "layer_ids": json.dumps(self.layer_ids), "samples": json.dumps(index)}
        tmp = self.dir / f".{name}.tmp"
        nbytes, digest = write_safetensors(
            tmp,
            {"hidden_states": [s[2] for s in self._samples], "token_ids": [s[1] for s in self._samples]},
            meta,
        )
        os.replace(tmp, self.dir / name)
        info = ShardInfo(file=name, bytes=nbytes, sha256=digest, num_samples=len(index), num_tokens=row)
        self.shards.append(info)
        self._samples.clear()
        self._bytes = 0
        return info

    def close(self) -> list[ShardInfo]:
        self.flush()
        return list(self.shards)
