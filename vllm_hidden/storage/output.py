"""One extract output as a whole, local directory or s3://bucket/prefix, however many engines
write it.

    run.json                    written first (what the output is; checked by --resume)
    shard-00000.safetensors     shards of a one-engine run (+ shards.jsonl)
    rank-001/shard-00000...     shards of data-parallel rank 1 (+ its own shards.jsonl)
    errors.jsonl                bad lines
    manifest.json               written last: every shard of every part

Each part (the top level, each rank-NNN/) is written by one engine and resumed on its own:
its journal (or, on S3, its uploaded objects) says what is durable. A resume reads every
part, whatever the number of engines was before, so a run can go on with more or fewer.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from vllm_hidden.config import DEFAULT_S3_RETRY_S, ShardConfig
from vllm_hidden.format.shard import GENERATIONS as GENERATIONS_TENSOR
from vllm_hidden.format.shard import ShardInfo, shard_number
from vllm_hidden.format.stats import aggregate
from vllm_hidden.storage.files import shard_header
from vllm_hidden.storage.journal import RUN, ResumeState, prepare_resume, read_journal, write_json_atomic
from vllm_hidden.storage.manifest import ERRORS, GENERATIONS, MANIFEST, Manifest
from vllm_hidden.storage.s3 import S3Location, is_s3, read_uploaded

log = logging.getLogger("vllm_hidden")

_RANK = re.compile(r"rank-(\d{3,})")


def rank_part(rank: int | None) -> str:
    """The sub-path rank `rank` writes its shards under ("" for a one-engine run)."""
    if rank is None:
        return ""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    return f"rank-{rank:03d}"


def _in_part(part: str, s: ShardInfo) -> ShardInfo:
    return replace(s, file=f"{part}/{s.file}") if part else s


def local_parts(root: Path) -> list[str]:
    """"" (the top level) and every rank-NNN sub-directory, in order."""
    ranks = sorted(p.name for p in root.iterdir() if p.is_dir() and _RANK.fullmatch(p.name)) if root.is_dir() else []
    return ["", *ranks]


def durable_shards(root: str | Path) -> list[ShardInfo]:
    """Every shard some part's journal records as durable (paths relative to the root)."""
    root = Path(root)
    return [_in_part(part, s) for part in local_parts(root) for s in read_journal(root / part)]


def s3_parts(loc: S3Location) -> list[str]:
    return ["", *sorted(p for p in loc.subdirs() if _RANK.fullmatch(p))]


def uploaded_shards(loc: S3Location) -> list[ShardInfo]:
    return [_in_part(part, s) for part in s3_parts(loc) for s in loc.sub(part).shard_infos()]


@dataclass
class OutputState:
    """What earlier attempts made durable, over all parts."""

    shards: list[ShardInfo] = field(default_factory=list)  # paths relative to the output root
    done_ids: set[Any] = field(default_factory=set)
    next_index: dict[str, int] = field(default_factory=dict)  # part -> its next shard number
    removed: list[str] = field(default_factory=list)

    def add(self, part: str, state: ResumeState, where: str) -> None:
        clash = state.done_ids & self.done_ids
        if clash:
            raise ValueError(f"sample id {next(iter(clash))!r} is in shards of two parts of {where!r}; "
                             "the output is damaged")
        self.done_ids |= state.done_ids
        self.shards += [_in_part(part, s) for s in state.shards]
        self.next_index[part] = state.next_index
        self.removed += [f"{part}/{n}" if part else n for n in state.removed]


class Output:
    """Where an extract writes: prepares (run.json or resume), hands each engine the shard
    config of its part, records bad lines, and writes the manifest last."""

    def __init__(self, uri: str, identity: dict[str, Any], *, s3_endpoint_url: str | None = None,
                 staging_dir: str | None = None, s3_retry_s: float = DEFAULT_S3_RETRY_S) -> None:
        self.uri = uri
        self.identity = identity
        self.s3_endpoint_url = s3_endpoint_url
        self.loc = S3Location(uri, s3_endpoint_url, s3_retry_s) if is_s3(uri) else None
        if self.loc is not None:  # shards are written here, then uploaded and evicted
            self.local = Path(staging_dir) if staging_dir else (
                Path(tempfile.gettempdir()) / "vllm-hidden-staging" / self.loc.bucket / (self.loc.prefix or "_"))
        else:
            self.local = Path(uri)
        self.state = OutputState()
        self.num_errors = 0
        self._errors: TextIO | None = None

    @property
    def where(self) -> str:
        return self.loc.uri if self.loc is not None else str(self.local)

    def begin(self, resume: bool) -> OutputState:
        if self.loc is not None:
            self._begin_s3(self.loc, resume)
        else:
            self._begin_local(resume)
        if self.state.removed:
            log.info("vllm-hidden: resume removed %d unfinished files: %s", len(self.state.removed),
                     self.state.removed[:5])
        return self.state

    # what an output written before these were recorded was extracted with
    _IDENTITY_DEFAULTS = {"final_state": "none", "loss_mask": "none", "generate": None, "storage_dtype": "auto"}

    def _check_identity(self, prev: dict[str, Any]) -> None:
        for k in ("format", "model", "layer_ids", "hidden_size", "final_state", "loss_mask", "generate",
                  "storage_dtype"):
            was = prev.get(k, self._IDENTITY_DEFAULTS.get(k))
            now = self.identity.get(k, self._IDENTITY_DEFAULTS.get(k))
            if was != now:
                raise ValueError(f"--resume: {self.where!r} was written with {k}={was!r}, this run has {k}={now!r}")

    def _begin_local(self, resume: bool) -> None:
        out = self.local
        if resume and (out / RUN).is_file():
            self._check_identity(json.loads((out / RUN).read_text()))
            for part in local_parts(out):
                self.state.add(part, prepare_resume(out / part), str(out))
            return
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / RUN, self.identity)

    def _begin_s3(self, loc: S3Location, resume: bool) -> None:
        """The shard objects under the prefix are what is done (an object exists only once its
        upload completed); the staging directory starts empty."""
        names = loc.names()
        if names and resume:
            self._check_identity(loc.get_json(RUN))
            aborted = loc.abort_stale_uploads()  # every part: the listing is by key prefix
            for part in s3_parts(loc):
                sub = loc.sub(part)
                shards, done_ids = read_uploaded(sub, sub.shard_infos())
                state = ResumeState(shards=shards, done_ids=done_ids)
                numbers = (shard_number(s.file) for s in shards)
                state.next_index = max((n for n in numbers if n is not None), default=-1) + 1
                self.state.add(part, state, loc.uri)
            for name in (MANIFEST, ERRORS):  # rewritten by this run
                if name in names:
                    loc.client.delete_object(Bucket=loc.bucket, Key=loc.key(name))
            if aborted:
                log.info("vllm-hidden: resume aborted %d unfinished multipart uploads under %s", aborted, loc.uri)
        elif not names:
            loc.put_json(RUN, self.identity)
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True)

    def shard_config(self, rank: int | None, **kw: Any) -> ShardConfig:
        """The ShardConfig of the engine writing part `rank` (None: the top level)."""
        part = rank_part(rank)
        local = self.local / part
        if self.loc is None:
            local.mkdir(parents=True, exist_ok=True)
        return ShardConfig(output_dir=str(local), first_index=self.state.next_index.get(part, 0),
                           upload_uri=(f"{self.loc.uri}/{part}" if part else self.loc.uri) if self.loc else None,
                           s3_endpoint_url=self.s3_endpoint_url, **kw)

    def record_error(self, bad: Any) -> None:
        if self._errors is None:  # this run's file: new at the first error, appended to after a close
            self.local.mkdir(parents=True, exist_ok=True)
            self._errors = open(self.local / ERRORS, "a" if self.num_errors else "w")
        self._errors.write(json.dumps(bad.to_dict()) + "\n")
        self._errors.flush()
        self.num_errors += 1

    def close_errors(self) -> None:
        if self._errors is not None:
            self._errors.close()
            self._errors = None

    def finish(self, new_shards: list[ShardInfo], **manifest: Any) -> Manifest:
        """Every shard is durable (uploaded): the manifest goes last. `new_shards` carry paths
        relative to the output root."""
        self.close_errors()
        shards = sorted([*self.state.shards, *new_shards], key=lambda s: s.file)
        # the samples an earlier attempt refused as non-finite were tried again by this one:
        # only this attempt's count of them stands
        earlier = {s.file for s in self.state.shards}
        stats, covered = aggregate([s.stats for s in shards], manifest["hidden_size"],
                                   stale=[s.file in earlier for s in shards])
        manifest.setdefault("layer_stats", stats)
        manifest.setdefault("layer_stats_shards", covered if 0 < covered < len(shards) else None)
        gens = manifest.get("generate") is not None
        if gens:  # every sample's record, from its shard: durable with it, gathered once all are
            write_generations(self.local / GENERATIONS, shards, self.local if self.loc is None else self.loc)
        m = Manifest(shards=shards, num_errors=self.num_errors, errors_file=ERRORS if self.num_errors else None,
                     generations_file=GENERATIONS if gens else None, **manifest)
        m.write(self.local)
        if self.loc is not None:  # errors, then the manifest last; then the staging directory goes
            if self.num_errors:
                self.loc.put_file(self.local / ERRORS, ERRORS)
            if gens:
                self.loc.put_file(self.local / GENERATIONS, GENERATIONS)
            self.loc.put_file(self.local / MANIFEST, MANIFEST)
            shutil.rmtree(self.local, ignore_errors=True)
        return m


def shard_generations(where: "Path | S3Location", s: ShardInfo) -> bytes:
    """The generations.jsonl lines a shard holds (its `generations` tensor)."""
    t = shard_header(where, s).tensors[GENERATIONS_TENSOR]
    if isinstance(where, Path):
        with open(where / s.file, "rb") as f:
            return os.pread(f.fileno(), t.nbytes, t.start)
    return where.read_range(s.file, t.start, t.end)


def write_generations(path: Path, shards: list[ShardInfo], where: "Path | S3Location") -> None:
    """generations.jsonl: every shard's lines in shard order (and so in each shard's index
    order), written to a temporary name, fsynced and renamed."""
    from concurrent.futures import ThreadPoolExecutor

    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f, ThreadPoolExecutor(1 if isinstance(where, Path) else 8) as pool:  # S3: GETs at once
        for lines in pool.map(lambda s: shard_generations(where, s), shards):
            f.write(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def in_part(rank: int | None, shards: list[ShardInfo]) -> list[ShardInfo]:
    """A part's shards (paths relative to the part) with paths relative to the output root."""
    part = rank_part(rank)
    return [_in_part(part, s) for s in shards]
