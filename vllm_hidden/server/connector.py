"""The connector form: the files vLLM's hidden-states connectors write, written by this server.

Started with speculators' launch arguments (`config.ConnectorConfig`), the server gives every
completion and chat request (without a `hidden_states` field, not streamed) its prompt's states
as one safetensors file in the connector's `shared_storage_path`, in the layout that connector
writes:
- ExampleHiddenStatesConnector: `hidden_states` [T, K, H] in the model's dtype, `token_ids`
  int64 [T];
- hs_connectors' FP8HiddenStatesConnector: `hidden_states` float8 e4m3 [T, K, H] quantized on
  the device, `hidden_states_scales` float32 [T, 1, 1] (one per token, amax over its layers /
  448; value = fp8 * scale), `token_ids`.
K runs over the aux ids in ascending order, as vLLM's model emits them; the header's metadata
names them. The response carries `kv_transfer_params: {"hidden_states_path": PATH}`.

Unlike vLLM's connector, the file is whole before the response is sent: it is written under a
hidden name and renamed into place. Its `.lock` companion (vLLM's protocol: readers flock it,
speculators' then delete it) is made before the rename and never held, so a reader that waits
on it goes straight on.

The storage path is bounded (`ConnectorStore`): the files this server wrote that no client has
deleted or moved yet, plus those being written, hold at most `--max-unread-bytes`; a request
that does not fit is answered 503 with Retry-After before the engine runs it. A file nobody
deletes (its client died) is deleted after `--unread-ttl`; a restarted server adopts the files
an earlier one left and deletes unfinished ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path

import torch

from vllm_hidden.config import ConnectorConfig, ServeConfig
from vllm_hidden.format import header as st
from vllm_hidden.layers import SEMANTICS, from_aux_ids
from vllm_hidden.server.protocol import RequestError
from vllm_hidden.server.store import FetchStore, _Entry, _unlink, new_id, write_part
from vllm_hidden.server.transport import ConnectorTransport, Delivery, ServerShape, Stored

log = logging.getLogger("vllm_hidden")

PREFIX = "vh-"
SUFFIX = ".safetensors"
LOCK = ".lock"
_FILE = re.compile(rf"{PREFIX}[A-Za-z0-9_-]{{32}}{re.escape(SUFFIX)}")
_PART = re.compile(rf"\.{PREFIX}[A-Za-z0-9_-]{{32}}\.(\d+)\.part")


def row_bytes(cfg: ConnectorConfig, columns: int, hidden: int, itemsize: int) -> int:
    """Bytes of one token in a file: its states (float8 with one float32 scale) and its id."""
    return columns * hidden * (1 if cfg.fp8 else itemsize) + (4 if cfg.fp8 else 0) + 8


def file_pieces(cfg: ConnectorConfig, rows: torch.Tensor, scale: torch.Tensor | None,
                token_ids: list[int]) -> list:
    """The file's bytes as pieces: `rows` [T, K, H] (float8 with `scale` [T, K], every column of
    a token holding the same scale, or the model's dtype) and the token ids."""
    aux = list(cfg.file_aux_ids)
    if rows.shape[1] != len(aux):
        raise ValueError(f"{rows.shape[1]} captured layers for the connector's {len(aux)} aux ids {aux}")
    tensors = {"hidden_states": rows}
    if cfg.fp8:
        if scale is None:
            raise ValueError("float8 rows came without their scales")
        tensors["hidden_states_scales"] = scale[:, :1].unsqueeze(-1)
    tensors["token_ids"] = torch.tensor(token_ids, dtype=torch.int64)
    meta = {"aux_layer_ids": str(aux), "layer_ids": str(from_aux_ids(aux)), "layer_semantics": SEMANTICS,
            "writer": "vllm-hidden", "connector": cfg.connector}
    return st.pieces(tensors, metadata=meta)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ConnectorStore(FetchStore):
    """One API server process's files in the storage path: `reserve` before a request reaches
    the engine (FetchStore's), `put` when its states are in, `sweep` now and then: files that
    are gone (a client deleted or moved them) give their bytes back, files past their time are
    deleted."""

    BUDGET_FLAG = "--max-unread-bytes"

    def __init__(self, cfg: ConnectorConfig, budget_bytes: int, ttl_s: float) -> None:
        self.cfg = cfg
        if cfg.storage_path is None:  # the file connectors' (config.ConnectorConfig checks it)
            raise ValueError(f"{cfg.connector}: no shared_storage_path to write the files under")
        super().__init__(cfg.storage_path, budget_bytes, ttl_s)

    def adopt(self, started: float) -> None:
        """Files an earlier server left: finished ones (before `started`) are held until their
        time (mtime + ttl) runs out; unfinished ones of dead processes are deleted."""
        for e in os.scandir(self.root):
            m = _PART.fullmatch(e.name)
            if m and not _pid_alive(int(m.group(1))):
                _unlink(Path(e.path))
                continue
            if not _FILE.fullmatch(e.name) or e.name in self._own:
                continue
            try:
                s = e.stat()
            except FileNotFoundError:
                continue
            if s.st_mtime < started:
                self._own[e.name] = _Entry(s.st_size, s.st_mtime + self.ttl)
                self.held += s.st_size
        if self._own:
            log.info("vllm-hidden: %d unread files (%.1f MB) from an earlier server in %s count against "
                     "--max-unread-bytes until read or %g s old", len(self._own), self.held / 1e6, self.root,
                     self.ttl)

    def full(self, nbytes: int) -> str:
        return (f"unread hidden-state files in {str(self.root)!r} hold {self.held + self.reserved} of this server's "
                f"{self.budget} bytes, no room for {nbytes} more (--max-unread-bytes); retry once the trainer has "
                f"read and deleted some (files nobody deletes go after {self.ttl:g} s, --unread-ttl)")

    async def put(self, pieces: list, reserved: int) -> tuple[str, int]:
        """Write one response's file (a thread writes; the event loop goes on): (path, size)."""
        name = f"{PREFIX}{new_id()}{SUFFIX}"
        try:
            size = await asyncio.to_thread(self._write, name, pieces)
        finally:
            self.release(reserved)
        self.held += size
        self._own[name] = _Entry(size, time.time() + self.ttl)
        return str(self.root / name), size

    def _write(self, name: str, pieces: list) -> int:
        part = self.root / f".{name.removesuffix(SUFFIX)}.{os.getpid()}.part"
        size = write_part(part, pieces, mode=0o644)
        if self.cfg.use_lock:  # vLLM's readers open it; it is never held: the file is whole
            os.close(os.open(self.root / (name + LOCK), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        os.rename(part, self.root / name)
        return size

    def sweep(self) -> None:
        now, expired = time.time(), 0
        for name, e in list(self._own.items()):
            path = self.root / name
            if e.expires <= now:
                _unlink(path)
                expired += 1
            elif path.exists():
                continue
            _unlink(self.root / (name + LOCK))  # a reader that deleted the file but not its lock
            del self._own[name]
            self.held -= e.size
        if expired:
            log.warning("vllm-hidden: deleted %d hidden-state files in %s that no client read within %g s "
                        "(--unread-ttl)", expired, self.root, self.ttl)

    def close(self) -> None:
        """The files stay for their readers (a restarted server adopts what is left)."""
        self._own.clear()
        self.held = 0


STARTED = time.time()  # files in the storage path from before this are an earlier server's


class FileTransport(ConnectorTransport):
    """The file form (server.transport): this process's share of the storage path's budget
    (`--max-unread-bytes` over the API server processes); process 0 also adopts what an earlier
    server left."""

    def __init__(self, cfg: ConnectorConfig, serve: ServeConfig, shape: ServerShape) -> None:
        super().__init__(cfg, serve, shape)
        self.store = ConnectorStore(cfg, max(1, serve.max_unread_bytes // shape.processes), serve.unread_ttl_s)
        if shape.rank == 0:
            self.store.adopt(STARTED)

    def describe(self) -> str:
        return (f"a file under {self.store.root} ({self.store.budget / 1e9:.1f} GB of unread files at most in this "
                "process)")

    def row_bytes(self, columns: int) -> int:
        return row_bytes(self.cfg, columns, self.shape.hidden_size, self.shape.itemsize)

    def reserve(self, nbytes: int) -> str | None:
        return self.store.reserve(nbytes)

    def release(self, nbytes: int) -> None:
        self.store.release(nbytes)

    def sweep(self) -> None:
        self.store.sweep()

    def close(self) -> None:
        self.store.close()

    async def keep(self, got: Delivery, token_ids: list[int], reserved: int) -> Stored:
        t = len(token_ids)
        if not got.finite:
            log.warning("vllm-hidden: NaN/Inf in the hidden states of a %d-token prompt; written as they are", t)
        if got.rows is None:  # a failure: the middleware answers it before any form sees it
            raise RuntimeError(f"no rows to store: {got.error}")
        try:
            pieces = await asyncio.to_thread(file_pieces, self.cfg, got.rows[:t],
                                             None if got.scale is None else got.scale[:t], token_ids)
        except ValueError as e:
            self.release(reserved)
            raise RequestError(f"could not build the hidden-states file: {e}", status=500) from None
        try:
            path, _ = await self.store.put(pieces, reserved)
        except OSError as e:
            raise RequestError(f"could not write the hidden-states file: {e}", status=500) from None
        return Stored({"hidden_states_path": path}, path)

    async def discard(self, stored: str) -> None:
        _unlink(Path(stored))
        _unlink(Path(stored + LOCK))
        self.store.sweep()
