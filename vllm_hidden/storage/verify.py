"""Check an extract output: every shard present with its recorded size and BLAKE3, a valid
safetensors header, and an index that agrees with the manifest (`vllm-hidden inspect`)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hidden.format.shard import ShardInfo
from vllm_hidden.storage.files import file_checksum, hasher, shard_header
from vllm_hidden.storage.journal import JOURNAL, RUN
from vllm_hidden.storage.manifest import MANIFEST, Manifest
from vllm_hidden.storage.output import durable_shards, uploaded_shards


@dataclass
class Report:
    path: str
    complete: bool  # manifest.json present (the run finished)
    summary: dict[str, Any]
    shards: list[ShardInfo]
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _from_manifest(m: Manifest) -> tuple[dict[str, Any], list[ShardInfo], int]:
    summary = {"model": m.model, "layer_ids": m.layer_ids, "hidden_size": m.hidden_size, "dtype": m.dtype,
               "samples": m.num_samples, "tokens": m.num_tokens, "shards": len(m.shards),
               "bytes": sum(s.bytes for s in m.shards), "errors": m.num_errors,
               "storage_dtype": (m.storage or {}).get("dtype", m.dtype), "layers_run": m.layers_run}
    if m.num_tokens:
        summary["bytes_per_token"] = round(summary["bytes"] / m.num_tokens, 1)
    return summary, m.shards, len(m.layer_ids)


def _from_run(run: dict[str, Any], shards: list[ShardInfo]) -> tuple[dict[str, Any], list[ShardInfo], int | None]:
    """An interrupted run: what run.json says, and the shards recorded as durable so far."""
    summary = {"model": run.get("model"), "layer_ids": run.get("layer_ids"), "hidden_size": run.get("hidden_size"),
               "samples": sum(s.num_samples for s in shards), "tokens": sum(s.num_tokens for s in shards),
               "shards": len(shards), "bytes": sum(s.bytes for s in shards),
               "storage_dtype": run.get("storage_dtype", "auto")}
    return summary, shards, len(run["layer_ids"]) if run.get("layer_ids") else None


def _check_shard(root: Path, s: ShardInfo, layers: int | None) -> list[str]:
    p = root / s.file
    if not p.is_file():
        return [f"{s.file}: missing"]
    size = p.stat().st_size
    if size != s.bytes:
        return [f"{s.file}: {size} bytes, recorded {s.bytes}"]
    out = []
    if file_checksum(p) != s.blake3:
        out.append(f"{s.file}: BLAKE3 does not match the recorded {s.blake3[:16]}... (corrupted)")
    return out + _header_problems(root, s, layers)


def _check_s3_shard(loc, s: ShardInfo, layers: int | None) -> list[str]:
    try:
        obj = loc.client.get_object(Bucket=loc.bucket, Key=loc.key(s.file))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return [f"{s.file}: cannot read it ({e})"]
    h, size = hasher(), 0
    for chunk in obj["Body"].iter_chunks(8 << 20):
        h.update(chunk)
        size += len(chunk)
    if size != s.bytes:
        return [f"{s.file}: {size} bytes, recorded {s.bytes}"]
    out = ([] if h.hexdigest() == s.blake3
           else [f"{s.file}: BLAKE3 does not match the recorded {s.blake3[:16]}... (corrupted)"])
    return out + _header_problems(loc, s, layers)


def _header_problems(where, s: ShardInfo, layers: int | None) -> list[str]:
    """What its header says that disagrees with its record or with itself (format.shard)."""
    try:
        header = shard_header(where, s)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return [f"{s.file}: not a readable shard ({e})"]
    return header.problems(s, layers)


def _verify_s3(uri: str, endpoint_url: str | None, threads: int) -> Report:
    from vllm_hidden.storage.s3 import S3Location

    loc = S3Location(uri, endpoint_url)
    names = set(loc.names())
    if MANIFEST in names:
        summary, shards, layers = _from_manifest(Manifest.from_dict(loc.get_json(MANIFEST)))
        complete = True
    elif RUN in names:
        summary, shards, layers = _from_run(loc.get_json(RUN), uploaded_shards(loc))
        complete = False
    else:
        raise ValueError(f"{uri!r} has neither {MANIFEST} nor {RUN}: not a vllm-hidden output")
    return _report(loc.uri, complete, summary, shards, lambda s: _check_s3_shard(loc, s, layers), threads,
                   f"{len(shards)} shards uploaded")


def verify_output(path: str | os.PathLike[str], threads: int = 8, s3_endpoint_url: str | None = None) -> Report:
    if str(path).startswith("s3://"):
        return _verify_s3(str(path), s3_endpoint_url, threads)
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"no such output directory {str(path)!r}")
    if (root / MANIFEST).is_file():
        summary, shards, layers = _from_manifest(Manifest.read(root))
        complete = True
    elif (root / RUN).is_file():
        summary, shards, layers = _from_run(json.loads((root / RUN).read_text()), durable_shards(root))
        complete = False
    else:
        raise ValueError(f"{str(path)!r} has neither {MANIFEST} nor {RUN}: not a vllm-hidden output")
    return _report(str(root), complete, summary, shards, lambda s: _check_shard(root, s, layers), threads,
                   f"the run stopped; {JOURNAL} lists {len(shards)} durable shards")


def _report(path: str, complete: bool, summary: dict[str, Any], shards: list[ShardInfo], check, threads: int,
            where: str) -> Report:
    report = Report(path=path, complete=complete, summary=summary, shards=shards)
    with ThreadPoolExecutor(threads) as pool:
        for probs in pool.map(check, shards):
            report.problems.extend(probs)
    if not complete:
        report.problems.append(f"incomplete: no {MANIFEST} ({where}); `vllm-hidden extract --resume` finishes it")
    return report
