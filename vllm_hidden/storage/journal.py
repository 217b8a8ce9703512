"""Durable progress of a run, for crash safety and exactly-once resume.

- `run.json` (written first): what the output is (model, layer ids, hidden size), so a resume
  with other settings is refused instead of mixing shards.
- `shards.jsonl`: one line per shard, appended and fsynced after the shard file is durable
  under its final name. A sample is done exactly when its shard has a line here; a shard file
  without a line (a crash between rename and append) is not done, and is removed on resume.
- `manifest.json` is written last, from the journal, when a run completes.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hidden.format.shard import ShardInfo, shard_number
from vllm_hidden.storage.files import fsync_dir, shard_header

JOURNAL = "shards.jsonl"
RUN = "run.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class Journal:
    """Appends one fsynced line per durable shard (thread-safe: writer threads call it)."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.path = Path(out_dir) / JOURNAL
        self._lock = threading.Lock()
        self._f = open(self.path, "a")

    def record(self, info: ShardInfo) -> None:
        line = json.dumps(info.to_dict(), separators=(",", ":")) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_journal(out_dir: str | os.PathLike[str]) -> list[ShardInfo]:
    """Shards recorded as durable. A last line cut short by a crash is ignored; anything else
    that does not parse is an error naming the line."""
    path = Path(out_dir) / JOURNAL
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")
    shards = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            shards.append(ShardInfo.from_dict(d))
        except (ValueError, KeyError, TypeError) as e:
            if i == len(lines) - 1:  # torn final append: that shard was never reported done
                break
            raise ValueError(f"{path}: line {i + 1} is not a shard record ({e}): {line[:120]!r}") from None
    return shards


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line a crash left unfinished (read_journal skips it), so that this run's
    appends do not follow it on the same line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())


@dataclass
class ResumeState:
    shards: list[ShardInfo]  # durable shards of earlier attempts
    done_ids: set[Any] = field(default_factory=set)
    next_index: int = 0
    removed: list[str] = field(default_factory=list)  # leftovers of the crashed attempt


def prepare_resume(out_dir: str | os.PathLike[str], prefix: str = "shard") -> ResumeState:
    """Read what earlier attempts made durable, check it is all there, and remove what they
    left half-done (temporary files, shards never journaled, the manifest and error records,
    which the resumed run writes again)."""
    out = Path(out_dir)
    shards = read_journal(out)
    _drop_torn_tail(out / JOURNAL)
    state = ResumeState(shards=shards)
    names = set()
    for s in shards:
        p = out / s.file
        if not p.is_file() or p.stat().st_size != s.bytes:
            have = p.stat().st_size if p.is_file() else "missing"
            raise ValueError(f"{p}: recorded as done with {s.bytes} bytes, found {have}; the output is damaged")
        for entry in shard_header(out, s).index:
            sid = entry[0]
            if sid in state.done_ids:
                raise ValueError(f"sample id {sid!r} is in two shards of {str(out)!r}; the output is damaged")
            state.done_ids.add(sid)
        names.add(s.file)
    for p in sorted(out.iterdir()):
        if shard_number(p.name, prefix) is not None and p.name not in names:
            state.removed.append(p.name)  # renamed but never journaled: not done
            p.unlink()
        elif p.name.startswith(f".{prefix}-") and p.name.endswith(".tmp"):
            state.removed.append(p.name)
            p.unlink()
    for name in ("manifest.json", "errors.jsonl"):
        if (out / name).exists():
            (out / name).unlink()
    state.next_index = max((shard_number(s.file, prefix) or 0 for s in shards), default=-1) + 1
    return state
