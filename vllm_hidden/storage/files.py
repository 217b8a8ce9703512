"""What every part of storage agrees on about a shard file: the format tag, its name, its
journal/manifest record (`ShardInfo`), its checksum, and how a new file or rename is made
durable. The writer (shards.py), the journal, the S3 uploader, the manifest, `inspect` and
the reader all build on this; it depends on none of them."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import blake3

FORMAT = "vllm-hidden/1"


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


def file_checksum(path: str | os.PathLike[str]) -> str:
    """BLAKE3 (hex) of a file, as recorded in the manifest (`b3sum` prints the same)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(str(path))
    return h.hexdigest()
