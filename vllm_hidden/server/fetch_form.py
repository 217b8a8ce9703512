"""The fetch form in one API server process: its share of the server's store of unfetched
states (`store.FetchStore`, made on first use, swept in the background) and the GET
/v1/hidden_states/{id} that hands a response's safetensors bytes out, once."""

from __future__ import annotations

import asyncio
import atexit
import logging
import mmap
import os

from vllm_hidden.config import ServeConfig
from vllm_hidden.server.asgi import send_body, send_error
from vllm_hidden.server.protocol import RequestError
from vllm_hidden.server.store import FetchStore

log = logging.getLogger("vllm_hidden")

SEND_CHUNK_FETCH = 4 << 20


def map_file(fd: int) -> memoryview:
    """A file's bytes, mapped, not read: the socket sends straight from the (tmpfs) pages, no
    copy here. The mapping lives as long as the transport holds slices of it."""
    size = os.fstat(fd).st_size
    if not size:
        return memoryview(b"")
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # page tables filled here, in a thread
    return memoryview(mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ))


class FetchForm:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.processes = 1  # API server processes sharing the budget (set by the middleware's setup)
        self.store: FetchStore | None = None

    def open_store(self) -> FetchStore:
        """This process's view of the server's fetch-form directory (made on first use)."""
        if self.store is None:
            import vllm_hidden.envs as envs

            root = os.environ.get(envs.FETCH_DIR)
            if not root:
                raise RequestError(f"the fetch form is not configured ({envs.FETCH_DIR} is unset)", status=500)
            self.store = FetchStore(root, max(1, self.cfg.max_unfetched_bytes // self.processes), self.cfg.fetch_ttl_s)
            atexit.register(self.store.close)
            asyncio.get_running_loop().create_task(self._sweep(self.store))
        return self.store

    async def _sweep(self, store: FetchStore) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.cfg.fetch_ttl_s / 4))
            try:
                store.sweep()
            except OSError:  # the directory was removed under us: nothing left to hold
                log.exception("vllm-hidden: sweeping unfetched hidden states")

    async def get(self, entry: str, send) -> None:
        """GET /v1/hidden_states/{entry}: the bytes, once; 404 for an unknown, expired or
        already fetched id."""
        try:
            fd = self.open_store().open(entry)
        except RequestError as e:
            return await send_error(send, e)
        if fd is None:
            return await send_error(send, RequestError(
                f"no hidden states with id {entry[:64]!r}: unknown, expired (after {self.cfg.fetch_ttl_s:g} s) or "
                "already fetched", status=404, param=None))
        try:
            view = await asyncio.to_thread(map_file, fd)
        finally:
            os.close(fd)
        size = len(view)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"),
                                (b"content-length", str(size).encode())]})
        await send_body(send, [view], more=False, chunk=SEND_CHUNK_FETCH)
