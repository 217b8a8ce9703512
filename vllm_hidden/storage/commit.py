"""A shard's commit: the finished arena becomes a durable file under its final name.

After its row writes: the tensors after `hidden_states` and the header are written, the file
fsynced, renamed to its final name, and the directory fsynced; the file's BLAKE3 is computed
from memory (multi-threaded), beside the fsync rather than after it. Only then is the shard
durable (the writer journals it, and its samples count as done).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from vllm_hidden.format.shard import ShardInfo
from vllm_hidden.storage.arena import Arena, SampleSlot, pwrite_all, raw
from vllm_hidden.storage.files import fsync_dir, hasher


def commit_shard(a: Arena, done: list[SampleSlot], head: bytes, tail: list, entries: dict, end: int, directory: Path,
                 name: str, phases: dict[str, float]) -> ShardInfo:
    """Write `a`'s file around its rows (`arena.layout`'s header and tail), make it durable as
    `directory/name`, and return its record; `phases` gets the seconds each step took."""
    h = hasher()
    failed: list[BaseException] = []

    def digest() -> None:
        t = time.perf_counter()
        try:
            for part in (memoryview(head), raw(a.buf[: a.rows]), *(raw(x) for _, x in tail)):
                h.update(part)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            failed.append(e)
        phases["hash_s"] = time.perf_counter() - t

    hashing = threading.Thread(target=digest, name="vllm-hidden-hash")
    hashing.start()
    try:
        room = len(head)
        for tname, t in tail:
            pwrite_all(a.fd, raw(t), room + entries[tname]["data_offsets"][0])
        pwrite_all(a.fd, memoryview(head), 0)
        t1 = time.perf_counter()
        os.fsync(a.fd)
        phases["fsync_s"] = time.perf_counter() - t1
    finally:
        hashing.join()  # it reads the arena, which goes back to the pool after this
    if failed:
        raise failed[0]
    t1 = time.perf_counter()
    a.close_file()
    os.replace(a.tmp, directory / name)
    fsync_dir(directory)  # the rename is durable
    phases["rename_s"] = time.perf_counter() - t1
    return ShardInfo(file=name, bytes=room + end, blake3=h.hexdigest(), num_samples=len(done),
                     num_tokens=sum(int(s.token_ids.shape[0]) for s in done))

