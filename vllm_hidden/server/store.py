"""States waiting to be fetched (`"transfer": "fetch"`): one file each in a directory that
every API server process of one server shares.

vLLM's API server processes all accept on one socket, so the GET for a response's states may
reach any of them: the bytes live in a shared directory (tmpfs, /dev/shm, by default: memory,
never a disk write) and any process can serve them. The process that answered the request
wrote the file and owns its memory budget (`--max-unfetched-bytes` split evenly over the API
processes) and its expiry (also the file's mtime, so any process can tell). A GET claims a
file by renaming it (atomic: exactly one GET gets the bytes), unlinks it and sends it from
the open descriptor. Ids are 192-bit random tokens; nothing in a request names a path. The
directory is named (`capture.server_env.ensure_dir_env`) by the process that starts the server.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("vllm_hidden")
_ID = re.compile(r"[A-Za-z0-9_-]{32}")

def new_id() -> str:
    return secrets.token_urlsafe(24)


@dataclass(slots=True)
class _Entry:
    size: int
    expires: float  # time.time(); also the file's mtime, so that any process can tell


class HeldBytes:
    """Bytes one API server process lets clients' states take until they are fetched or read:
    `reserved` for requests in flight, `held` by what was stored, at most `budget`. A subclass
    says how to give back what clients took (`sweep`) and what a refusal says (`full`)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = int(budget_bytes)
        self.reserved = 0  # for requests in flight
        self.held = 0  # stored, not yet taken or expired

    def sweep(self) -> None:
        raise NotImplementedError

    def full(self, nbytes: int) -> str:
        raise NotImplementedError

    def reserve(self, nbytes: int) -> str | None:
        """Room for a response's states; None if granted, else why not (HTTP 503)."""
        if self.reserved + self.held + nbytes > self.budget:
            self.sweep()
        if self.reserved + self.held + nbytes > self.budget:
            return self.full(nbytes)
        self.reserved += nbytes
        return None

    def release(self, nbytes: int) -> None:
        self.reserved = max(0, self.reserved - nbytes)


class FetchStore(HeldBytes):
    """One API server process's view: `reserve` before a request reaches the engine, `put`
    when its states are in, `open` for any GET. Call `sweep` now and then (the middleware's
    background task does)."""

    BUDGET_FLAG = "--max-unfetched-bytes"

    def __init__(self, root: str, budget_bytes: int, ttl_s: float) -> None:
        if budget_bytes < 1:
            raise ValueError(f"the unfetched-states budget must be positive, got {budget_bytes!r} bytes")
        super().__init__(budget_bytes)
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.ttl = float(ttl_s)
        self._own: dict[str, _Entry] = {}
        free = shutil.disk_usage(self.root).free
        if free < self.budget:
            log.warning("vllm-hidden: %s has %.1f GB free, less than this process's budget of %.1f GB (%s / API "
                        "processes)", self.root, free / 1e9, self.budget / 1e9, self.BUDGET_FLAG)

    # -- the owner's side --------------------------------------------------------------
    def full(self, nbytes: int) -> str:
        return (f"unfetched hidden states on this server hold {self.held + self.reserved} of "
                f"{self.budget} bytes, no room for {nbytes} more (--max-unfetched-bytes); fetch "
                f"earlier responses' states or wait up to {self.ttl:g} s for them to expire")

    async def put(self, pieces: list, reserved: int) -> tuple[str, int]:
        """Write one response's bytes (a thread writes; the event loop goes on): (id, size).
        The reservation becomes the file's hold."""
        entry, expires = new_id(), time.time() + self.ttl
        try:
            size = await asyncio.to_thread(_write, self.root, entry, pieces, expires)
        finally:
            self.release(reserved)
        self.held += size
        self._own[entry] = _Entry(size, expires)
        return entry, size

    def sweep(self) -> None:
        """Forget what was fetched (by any process) and delete what expired."""
        now = time.time()
        for entry, e in list(self._own.items()):
            path = self.root / entry
            if e.expires <= now:
                _unlink(path)
            elif path.exists():
                continue
            del self._own[entry]
            self.held -= e.size

    def close(self) -> None:
        for entry in list(self._own):
            _unlink(self.root / entry)
        self._own.clear()
        self.held = 0

    # -- any process: GET --------------------------------------------------------------
    def open(self, entry: str) -> int | None:
        """Claim an entry: an open descriptor of its bytes (the file is gone from the
        directory; the caller closes it), or None if unknown, expired or already fetched."""
        if not _ID.fullmatch(entry):
            return None
        claimed = self.root / f".{entry}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.rename(self.root / entry, claimed)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return None
            raise
        try:
            fd = os.open(claimed, os.O_RDONLY)
        finally:
            _unlink(claimed)
        if os.fstat(fd).st_mtime <= time.time():  # expired (its owner's sweep has not come yet)
            os.close(fd)
            return None
        return fd


def write_part(part: Path, pieces: list, mode: int = 0o600, expires: float | None = None) -> int:
    """The pieces into a new file `part` (removed again on any failure): its size. `expires`:
    its mtime."""
    size = 0
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        for p in pieces:
            mv = memoryview(p).cast("B")
            while mv:
                n = os.write(fd, mv)
                size += n
                mv = mv[n:]
        if expires is not None:
            os.utime(fd, (expires, expires))
    except BaseException:
        os.close(fd)
        _unlink(part)
        raise
    os.close(fd)
    return size


def _write(root: Path, entry: str, pieces: list, expires: float) -> int:
    """The pieces into `root/entry`, visible only once whole; its mtime is its expiry."""
    part = root / f".{entry}.part"
    size = write_part(part, pieces, expires=expires)
    os.rename(part, root / entry)
    return size


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
