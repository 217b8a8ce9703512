"""One export: an extract output (local or s3://) read sample by sample, each sample written
as the trainer's own file by a pool of writer threads, and a completion marker last.

The destination's life: `export.partial.json` (what is being exported: kind, source, layers)
is written first; each sample's file appears under its final name only once whole (written
under a temporary name, fsynced, renamed); `export.json` (the same, plus the counts and the
trainer settings) is written last and the partial record removed. A destination without
`export.json` is an unfinished export: running the same export again skips the files already
there and finishes it; a different export into it is refused.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_hidden.layers import positions
from vllm_hidden.storage.files import fsync_dir
from vllm_hidden.storage.journal import write_json_atomic

if TYPE_CHECKING:
    from vllm_hidden.data.dataset import HiddenStatesDataset

DONE = "export.json"
PARTIAL = "export.partial.json"
_READ_AHEAD = 4
_WRITERS = 4


def columns(layer_ids: Sequence[int], use: Sequence[int] | None,
            hint: str | None = None) -> tuple[list[int], list[int]]:
    """(layer ids written, their positions among the output's `layer_ids`); `use` None: all, in order."""
    ids = list(layer_ids) if use is None else list(use)
    if len(set(ids)) != len(ids):
        raise ValueError(f"--layers: a layer id is repeated in {ids}")
    hint = f"; extract with it, e.g. --layers {','.join(map(str, ids))}" if hint is None else hint
    return ids, positions(layer_ids, ids, "--layers", hint)


def open_source(src: str, s3_endpoint_url: str | None) -> "HiddenStatesDataset":
    from vllm_hidden.data.dataset import HiddenStatesDataset

    return HiddenStatesDataset(src, s3_endpoint_url)


def source_identity(src: str, ds: "HiddenStatesDataset") -> dict[str, Any]:
    m = ds.manifest
    where = src if src.startswith("s3://") else str(Path(src).resolve())
    return {"source": where, "model": m.model, "samples": m.num_samples, "tokens": m.num_tokens,
            "source_layer_ids": list(m.layer_ids)}


def start(dest: Path, identity: dict[str, Any]) -> bool:
    """Make `dest` ready for the export `identity`; True when it resumes an unfinished one."""
    if (dest / DONE).is_file():
        raise ValueError(f"export: {str(dest)!r} already holds a finished export ({DONE}); give a new directory")
    partial = dest / PARTIAL
    if partial.is_file():
        before = json.loads(partial.read_text())
        changed = [k for k in sorted({*before, *identity}) if before.get(k) != identity.get(k)]
        if changed:
            k = changed[0]
            raise ValueError(f"export: {str(dest)!r} holds an unfinished export with {k} {before.get(k)!r}, "
                             f"this one has {identity.get(k)!r}; rerun that export to finish it, or give a new "
                             "directory")
        return True
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"export: {str(dest)!r} exists and is not an empty directory (nor an unfinished export)")
    dest.mkdir(parents=True, exist_ok=True)
    write_json_atomic(partial, identity)
    return False


def finish(dest: Path, record: dict[str, Any]) -> None:
    write_json_atomic(dest / DONE, record)
    (dest / PARTIAL).unlink(missing_ok=True)
    fsync_dir(dest)


def save_atomic(obj: Any, path: Path, save: Callable[[Any, str], None]) -> None:
    """`save(obj, tmp)`, fsync, rename: the file exists under its name only whole. The
    temporary name does not end like a sample file, so no trainer picks it up."""
    tmp = path.with_name(f".{path.name}.part")
    save(obj, str(tmp))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def own(t: torch.Tensor) -> torch.Tensor:
    """A copy with storage of its own: torch.save writes the whole storage of a view."""
    return t.clone(memory_format=torch.contiguous_format)


@dataclass(kw_only=True)
class Tally:
    samples: int = 0
    tokens: int = 0
    written: int = 0  # files written by this run (the rest were there: a resumed export)
    skipped: list[Any] = field(default_factory=list)


def samples(ds: "HiddenStatesDataset", progress: bool, what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, sample) in order, read ahead in threads (a ranged GET each on S3)."""
    n = len(ds)
    bar = None
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                       TimeRemainingColumn(), transient=False, console=Console(stderr=True))
        task = bar.add_task(what, total=n)
        bar.start()
    try:
        with ThreadPoolExecutor(_READ_AHEAD, thread_name_prefix="export-read") as pool:
            ahead: deque[Future] = deque()
            nxt = 0
            for i in range(n):
                while nxt < n and len(ahead) < 2 * _READ_AHEAD:
                    ahead.append(pool.submit(ds.__getitem__, nxt))
                    nxt += 1
                yield i, ahead.popleft().result()
                if bar is not None:
                    bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()


class Writers:
    """A bounded pool of file writers: `submit` blocks while too many writes are pending (so
    memory holds a few samples, not the export); the first failure is raised."""

    def __init__(self, threads: int = _WRITERS) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="export-write")
        self.pending: deque[Future] = deque()
        self.limit = 2 * threads

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        while len(self.pending) >= self.limit or (self.pending and self.pending[0].done()):
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(fn, *args))

    def __enter__(self) -> "Writers":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            while self.pending:
                f = self.pending.popleft()
                if exc[0] is None:
                    f.result()
                else:
                    f.cancel()
        finally:
            self.pool.shutdown(wait=True)
