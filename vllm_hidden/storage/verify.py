"""Check an extract output: every shard present with its recorded size and BLAKE3, a valid
safetensors header, and an index that agrees with the manifest (`vllm-hidden inspect`); and
its per-layer statistics, with what looks wrong in them (`format.stats.flags`)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hidden.format.shard import ShardInfo
from vllm_hidden.format.stats import aggregate, flags
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
    # the manifest's layer_stats (or, for a run that stopped, summed over the shards recorded so
    # far); None: written without statistics
    layer_stats: dict[str, dict[str, Any]] | None = None
    layer_stats_shards: int | None = None  # shards they cover, when some have none
    flags: list[dict[str, str]] = field(default_factory=list)  # warnings: `inspect --strict` fails on them

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """`inspect --json`."""
        return {"path": self.path, "complete": self.complete, "ok": self.ok, **self.summary, "problems": self.problems,
                "layer_stats": self.layer_stats, "layer_stats_shards": self.layer_stats_shards, "flags": self.flags}

    def headline(self) -> str:
        """`inspect`'s first line: what the output holds."""
        s = self.summary
        q = s.get("quantization")
        return (f"{self.path}: {'complete' if self.complete else 'INCOMPLETE'} — {s['samples']} samples, "
                f"{s['tokens']} tokens in {s['shards']} shards ({s['bytes'] / 1e9:.2f} GB); model {s['model']}; "
                f"layers {s['layer_ids']}; hidden {s['hidden_size']}"
                + (f"; {q['method']} weights ({q['source']})" if q else "")
                + (f"; {s['errors']} bad input lines" if s.get("errors") else ""))

    def flag_lines(self) -> list[str]:
        return [f"  flag: {'final state' if f['layer'] == 'final' else 'layer ' + f['layer']}: {f['flag']}: "
                f"{f['detail']}" for f in self.flags]


def _from_manifest(m: Manifest) -> tuple[dict[str, Any], list[ShardInfo], int]:
    summary = {"model": m.model, "layer_ids": m.layer_ids, "hidden_size": m.hidden_size, "dtype": m.dtype,
               "samples": m.num_samples, "tokens": m.num_tokens, "shards": len(m.shards),
               "bytes": sum(s.bytes for s in m.shards), "errors": m.num_errors,
               "storage_dtype": (m.storage or {}).get("dtype", m.dtype), "layers_run": m.layers_run,
               "quantization": m.quantization}
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


# a shard's check: its problems, and the statistics its header holds (None: none, or unreadable)
Checked = tuple[list[str], "dict[str, Any] | None"]


def _check_shard(root: Path, s: ShardInfo, layers: int | None) -> Checked:
    p = root / s.file
    if not p.is_file():
        return [f"{s.file}: missing"], None
    size = p.stat().st_size
    if size != s.bytes:
        return [f"{s.file}: {size} bytes, recorded {s.bytes}"], None
    out = []
    if file_checksum(p) != s.blake3:
        out.append(f"{s.file}: BLAKE3 does not match the recorded {s.blake3[:16]}... (corrupted)")
    probs, stats = _header_problems(root, s, layers)
    return out + probs, stats


def _check_s3_shard(loc, s: ShardInfo, layers: int | None) -> Checked:
    try:
        obj = loc.client.get_object(Bucket=loc.bucket, Key=loc.key(s.file))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return [f"{s.file}: cannot read it ({e})"], None
    h, size = hasher(), 0
    for chunk in obj["Body"].iter_chunks(8 << 20):
        h.update(chunk)
        size += len(chunk)
    if size != s.bytes:
        return [f"{s.file}: {size} bytes, recorded {s.bytes}"], None
    out = ([] if h.hexdigest() == s.blake3
           else [f"{s.file}: BLAKE3 does not match the recorded {s.blake3[:16]}... (corrupted)"])
    probs, stats = _header_problems(loc, s, layers)
    return out + probs, stats


def _header_problems(where, s: ShardInfo, layers: int | None) -> Checked:
    """What its header says that disagrees with its record or with itself (format.shard), and
    the statistics it holds."""
    try:
        header = shard_header(where, s)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return [f"{s.file}: not a readable shard ({e})"], None
    return header.problems(s, layers), header.stats


def _verify_s3(uri: str, endpoint_url: str | None, threads: int) -> Report:
    from vllm_hidden.storage.s3 import S3Location

    loc = S3Location(uri, endpoint_url)
    names = set(loc.names())
    layers: int | None  # the output's layer count; None where an interrupted run's record has none
    if MANIFEST in names:
        m = Manifest.from_dict(loc.get_json(MANIFEST))
        summary, shards, layers = _from_manifest(m)
        complete = True
    elif RUN in names:
        m = None
        summary, shards, layers = _from_run(loc.get_json(RUN), uploaded_shards(loc))
        complete = False
    else:
        raise ValueError(f"{uri!r} has neither {MANIFEST} nor {RUN}: not a vllm-hidden output")
    return _report(loc.uri, complete, summary, shards, lambda s: _check_s3_shard(loc, s, layers), threads,
                   f"{len(shards)} shards uploaded", m)


def verify_output(path: str | os.PathLike[str], threads: int = 8, s3_endpoint_url: str | None = None) -> Report:
    if str(path).startswith("s3://"):
        return _verify_s3(str(path), s3_endpoint_url, threads)
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"no such output directory {str(path)!r}")
    layers: int | None
    if (root / MANIFEST).is_file():
        m = Manifest.read(root)
        summary, shards, layers = _from_manifest(m)
        complete = True
    elif (root / RUN).is_file():
        m = None
        summary, shards, layers = _from_run(json.loads((root / RUN).read_text()), durable_shards(root))
        complete = False
    else:
        raise ValueError(f"{str(path)!r} has neither {MANIFEST} nor {RUN}: not a vllm-hidden output")
    return _report(str(root), complete, summary, shards, lambda s: _check_shard(root, s, layers), threads,
                   f"the run stopped; {JOURNAL} lists {len(shards)} durable shards", m)


def _report(path: str, complete: bool, summary: dict[str, Any], shards: list[ShardInfo], check, threads: int,
            where: str, manifest: Manifest | None) -> Report:
    report = Report(path=path, complete=complete, summary=summary, shards=shards)
    in_headers = []
    with ThreadPoolExecutor(threads) as pool:
        for probs, stats in pool.map(check, shards):
            report.problems.extend(probs)
            in_headers.append(stats)
    if manifest is not None:
        report.layer_stats, report.layer_stats_shards = manifest.layer_stats, manifest.layer_stats_shards
    elif summary.get("hidden_size"):  # a run that stopped: the shards so far (their records, or on S3 headers)
        stats, covered = aggregate([s.stats if s.stats is not None else h for s, h in zip(shards, in_headers)],
                                   summary["hidden_size"])
        report.layer_stats, report.layer_stats_shards = stats, covered if 0 < covered < len(shards) else None
    report.flags = flags(report.layer_stats)
    if not complete:
        report.problems.append(f"incomplete: no {MANIFEST} ({where}); `vllm-hidden extract --resume` finishes it")
    return report


def stats_table(r: Report) -> list[str]:
    """`inspect`'s lines for the statistics: a row per stored layer (and the final state)."""
    if r.layer_stats is None:
        return ["no statistics (written without per-layer statistics)"]

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    lines = [f"{'layer':>6} {'rows':>12} {'mean':>11} {'std':>11} {'absmax':>11} {'zero rows':>10} "
             f"{'non-finite rows':>16}"]
    for name, v in r.layer_stats.items():
        lines.append(f"{name:>6} {v['rows']:>12} {num(v['mean']):>11} {num(v['std']):>11} {num(v['absmax']):>11} "
                     f"{v['zero_rows']:>10} {v['nonfinite_rows']:>16}")
    if r.layer_stats_shards is not None:
        lines.append(f"(statistics of {r.layer_stats_shards} of {len(r.shards)} shards: the others were written "
                     "without them)")
    return lines
