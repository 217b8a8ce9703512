"""What every part of storage agrees on about a shard file: the format tag, its name, its
journal/manifest record (`ShardInfo`), its checksum, and how a new file or rename is made
durable. The writer (shards.py), the journal, the S3 uploader, the manifest, `inspect` and
the reader all build on this; it depends on none of them."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import blake3

FORMAT = "vllm-hidden/1"

# Per-sample checksums, so a reader verifies exactly the bytes it returns (once, however many
# processes read): a shard's metadata holds, under SAMPLE_CHECKSUMS, one digest per index entry,
# in index order: BLAKE3 (16 bytes, hex) of the entry as compact JSON, then of the sample's rows
# of each ROW_TENSORS tensor the shard has, in this order (which is also their order in the file).
# Covering the entry covers the header fields a read relies on: a damaged id, offset or count
# reads as a mismatch. The manifest names the rule (SAMPLE_CHECKSUM); older outputs have none.
SAMPLE_CHECKSUMS = "sample_blake3"
SAMPLE_CHECKSUM = "blake3-128(entry, rows)"
ROW_TENSORS = ("hidden_states", "final_hidden_states", "hidden_states_scale", "final_hidden_states_scale",
               "token_ids", "loss_mask")


def sample_digest(entry: list[Any], parts: Iterable[Any]) -> str:
    """The SAMPLE_CHECKSUMS digest of an index entry and its rows' bytes (buffers, in ROW_TENSORS order)."""
    h = blake3.blake3(json.dumps(entry, separators=(",", ":")).encode())
    for p in parts:
        h.update(p)
    return h.hexdigest(length=16)


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    file: str
    bytes: int
    blake3: str
    num_samples: int
    num_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shard_file(index: int, prefix: str = "shard") -> str:
    return f"{prefix}-{index:05d}.safetensors"


def shard_number(name: str, prefix: str = "shard") -> int | None:
    """The index in a shard's file name, or None if `name` is not one."""
    m = re.fullmatch(rf"{re.escape(prefix)}-(\d+)\.safetensors", name)
    return int(m.group(1)) if m else None


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_file_range():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it


def write_behind(fd: int, offset: int, nbytes: int) -> None:
    """Start writing [offset, offset + nbytes) of `fd` to the device now, without waiting
    (Linux `sync_file_range`, as RocksDB's bytes_per_sync does). Durability still comes only
    from fsync; this keeps dirty pages from piling up in the page cache until then (the
    kernel's own writeback may hold them for 30 s), so the fsync at the end of a shard
    waits for the last writes, not for the whole shard. A no-op where it is not available."""
    global _SYNC_FILE_RANGE
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        if _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0 and ctypes.get_errno() != 4:
            _SYNC_FILE_RANGE = None  # not supported here (some FUSE or network file systems): it was a hint;
            # fsync reports real write errors


_POOL_PID: int | None = None  # the process whose hashing started blake3's thread pool


def hasher() -> "blake3.blake3":
    """A BLAKE3 hasher on all cores. Its thread pool does not survive fork: a forked child (a
    DataLoader worker) that hashes with the pool its parent started hangs, so a child hashes
    on one thread."""
    global _POOL_PID
    if _POOL_PID is None:
        _POOL_PID = os.getpid()
    return blake3.blake3(max_threads=blake3.blake3.AUTO if _POOL_PID == os.getpid() else 1)


def file_checksum(path: str | os.PathLike[str]) -> str:
    """BLAKE3 (hex) of a file, as recorded in the manifest (`b3sum` prints the same)."""
    h = hasher()
    h.update_mmap(str(path))
    return h.hexdigest()
