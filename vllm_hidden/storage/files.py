"""What storage does with files: make them durable (fsync of a file's directory, write-behind
of written ranges), hash them (BLAKE3 of whole files: the manifest's shard checksums), and
read a shard's header wherever it is. What a shard file holds is `vllm_hidden.format`."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from vllm_hidden.format.shard import ShardHeader, ShardInfo

if TYPE_CHECKING:
    from vllm_hidden.storage.s3 import S3Location


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


def shard_header(where: "Path | S3Location", info: ShardInfo) -> ShardHeader:
    """A shard's parsed header, from a local output directory or an S3 location (two ranged
    GETs); a ValueError names the shard."""
    if isinstance(where, Path):
        path = where / info.file
        with open(path, "rb") as f:
            return ShardHeader.read(lambda offset, n: os.pread(f.fileno(), n, offset), os.fstat(f.fileno()).st_size,
                                    str(path))
    return where.shard_header(info)
