"""The Mooncake form (server.transport): started with the `--kv-transfer-config` hs_connectors'
`MooncakeBackend.build_kv_transfer_config` gives (kv_connector MooncakeHiddenStatesConnector,
`kv_connector_extra_config.mooncake` its MooncakeStoreConfig), every completion and chat request's
prompt states become ONE object in the Mooncake store, and the response's `kv_transfer_params`
is the manifest hs_connectors' reader (`MooncakeTransfer.get_generated`) takes:

    {"handle": KEY, "version": 1,
     "tensors": {"hidden_states": {"shape": [T, K, H], "dtype": "torch.bfloat16", "nbytes": N, "offset": 0},
                 "token_ids": {"shape": [T], "dtype": "torch.int64", "nbytes": 8T, "offset": N rounded up to 64}},
     "metadata": {"num_tokens": T, "total_aligned_bytes": ..., "extract_mode": "prompt_only"}}

the object being those tensors' bytes at those offsets (each tensor 64-byte aligned). The trainer
polls for the key, reads it and removes it. States with a NaN or Inf go as `KEY:error` instead (a
JSON {"error": ...}, as hs_connectors' producer does), so the reader fails at once.

Unlike vLLM's connector, the object is in the store before the response is sent. It is put from
one of a few staging buffers registered with Mooncake once each (`num_writer_threads` of them,
made on first use at the largest object this server can make), never per request.

Nothing unread is lost or left: each object is put hard-pinned (never evicted) into this
process's own segment (the memory this process contributes to the store: `global_segment_size`),
so the objects go with the process that made them, and this process's budget (`--max-unread-
bytes` over the API server processes, at most 90% of its segment: below Mooncake's eviction
watermark) answers 503 with Retry-After when it is full. Objects nobody removes are removed after
`--unread-ttl`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import torch

from vllm_hidden.config import ConnectorConfig, ServeConfig
from vllm_hidden.server.protocol import RequestError
from vllm_hidden.server.store import HeldBytes, new_id
from vllm_hidden.server.transport import ConnectorTransport, Delivery, ServerShape, Stored

log = logging.getLogger("vllm_hidden")

VERSION = 1  # hs_connectors' manifest version
ALIGN = 64  # each tensor's offset in the object
SEGMENT_SHARE = 0.9  # of this process's segment, at most: Mooncake starts evicting at its high watermark (0.9)
_NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def manifest(handle: str, tokens: int, columns: int, hidden: int, dtype: torch.dtype) -> dict:
    """hs_connectors' transfer manifest for a prompt's states [T, K, H] and token ids [T] (int64)."""
    states = tokens * columns * hidden * dtype.itemsize
    ids_at = _aligned(states)
    return {"handle": handle, "version": VERSION,
            "tensors": {"hidden_states": {"shape": [tokens, columns, hidden], "dtype": str(dtype), "nbytes": states,
                                          "offset": 0},
                        "token_ids": {"shape": [tokens], "dtype": str(torch.int64), "nbytes": 8 * tokens,
                                      "offset": ids_at}},
            "metadata": {"num_tokens": tokens, "total_aligned_bytes": _aligned(ids_at + 8 * tokens),
                         "extract_mode": "prompt_only"}}


@dataclass(slots=True)
class _Held:
    size: int
    expires: float


class MooncakeTransport(ConnectorTransport, HeldBytes):
    reserve = HeldBytes.reserve  # before Transport's defaults (nothing held) in the MRO
    release = HeldBytes.release

    def __init__(self, cfg: ConnectorConfig, serve: ServeConfig, shape: ServerShape) -> None:
        super().__init__(cfg, serve, shape)
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError:
            raise RequestError("the Mooncake connector needs the mooncake-transfer-engine package in the server's "
                               "environment (pip install -e \".[mooncake]\")", status=500) from None
        m = cfg.mooncake
        if m is None:  # the Mooncake connector's config always has it (config.ConnectorConfig)
            raise RequestError(f"{cfg.connector}: no Mooncake store configuration", status=500)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(m["local_hostname"], m["metadata_server"], m["global_segment_size"],
                              m["local_buffer_size"], m["protocol"], m["device_name"], m["master_server_address"])
        if rc != 0:
            raise RequestError(f"the Mooncake store did not set up (status {rc}): master "
                               f"{m['master_server_address']}, local host {m['local_hostname']}, protocol "
                               f"{m['protocol']}", status=500)
        self.put_config = ReplicateConfig()
        self.put_config.replica_num = 1
        self.put_config.with_hard_pin = True  # never evicted: removed by its reader, or by us after --unread-ttl
        self.put_config.preferred_segment = self.store.get_hostname()  # our memory: gone with this process
        HeldBytes.__init__(self, max(1, min(serve.max_unread_bytes // shape.processes,
                                            int(SEGMENT_SHARE * m["global_segment_size"]))))
        self._own: dict[str, _Held] = {}
        self._buffers: list[torch.Tensor] = []  # registered staging buffers not in use
        self._slots = asyncio.Semaphore(m["num_writer_threads"])

    def describe(self) -> str:
        m = self.cfg.mooncake or {}
        return (f"one object in the Mooncake store of master {m['master_server_address']} ({m['protocol']}; this "
                f"process contributes {m['global_segment_size'] / 1e9:.1f} GB, {self.budget / 1e9:.1f} GB of unread "
                "objects at most)")

    # -- budget ------------------------------------------------------------------------
    def row_bytes(self, columns: int) -> int:
        return columns * self.shape.hidden_size * self.shape.itemsize + 8

    def full(self, nbytes: int) -> str:
        return (f"unread hidden-state objects in the Mooncake store hold {self.held + self.reserved} of this "
                f"server's {self.budget} bytes, no room for {nbytes} more (--max-unread-bytes, at most "
                f"{SEGMENT_SHARE:.0%} of global_segment_size); retry once the trainer has read and removed some "
                f"(objects nobody removes go after {self.serve.unread_ttl_s:g} s, --unread-ttl)")

    def sweep(self) -> None:
        """Objects a trainer removed give their bytes back; those past --unread-ttl are removed."""
        if not self._own:
            return
        now, expired = time.time(), 0
        keys = list(self._own)
        present = self.store.batch_is_exist(keys)
        for key, there in zip(keys, present):
            e = self._own[key]
            if there == 1 and e.expires > now:
                continue
            if there == 1:
                self.store.remove(key, True)
                expired += 1
            del self._own[key]
            self.held -= e.size
        if expired:
            log.warning("vllm-hidden: removed %d hidden-state objects from the Mooncake store that no client read "
                        "within %g s (--unread-ttl)", expired, self.serve.unread_ttl_s)

    def close(self) -> None:
        for key in list(self._own):
            self.store.remove(key, True)
        self._own.clear()
        self.held = 0
        self.store.close()

    # -- the put -----------------------------------------------------------------------
    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A staging buffer registered with the store; at most num_writer_threads exist (the
        semaphore), each made once, at the largest object this server can make."""
        if self._buffers:
            buf = self._buffers.pop()
            if buf.numel() >= nbytes:
                return buf
            self.store.unregister_buffer(buf.data_ptr())  # only if --max-hidden-tokens was passed
        size = _aligned(max(nbytes, self._largest()))
        buf = torch.empty(size, dtype=torch.uint8)
        rc = self.store.register_buffer(buf.data_ptr(), size)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer of {size} bytes failed (status {rc})")
        return buf

    def _largest(self) -> int:
        m = manifest("x", self.serve.max_hidden_tokens, len(self.cfg.aux_layer_ids), self.shape.hidden_size,
                     self.shape.dtype)
        return m["metadata"]["total_aligned_bytes"]

    def _put(self, man: dict, rows: torch.Tensor, token_ids: list[int]) -> None:
        total = man["metadata"]["total_aligned_bytes"]
        buf = self._buffer(total)
        try:
            st, ids = man["tensors"]["hidden_states"], man["tensors"]["token_ids"]
            buf[st["offset"]:st["offset"] + st["nbytes"]].view(rows.dtype).view(rows.shape).copy_(rows)
            buf[ids["offset"]:ids["offset"] + ids["nbytes"]].view(torch.int64).copy_(
                torch.tensor(token_ids, dtype=torch.int64))
            rc = self.store.put_from(man["handle"], buf.data_ptr(), total, self.put_config)
            if rc != 0:
                raise RuntimeError(f"Mooncake put_from of {total} bytes failed (status {rc})")
        finally:
            self._buffers.append(buf)

    def _put_error(self, handle: str, message: str) -> None:
        rc = self.store.put(handle + ":error", json.dumps({"error": message[:4096]}).encode(), self.put_config)
        if rc != 0:
            raise RuntimeError(f"Mooncake put of the error marker failed (status {rc})")

    async def keep(self, got: Delivery, token_ids: list[int], reserved: int) -> Stored:
        t = len(token_ids)
        rows = got.rows
        if rows is None:  # a failure: the middleware answers it before any form sees it
            raise RuntimeError(f"no rows to store: {got.error}")
        if rows.dtype.itemsize == 1:  # float8 rows: only the FP8 file connector asks for them
            self.release(reserved)
            raise RequestError("the Mooncake connector stores the model's dtype; the rows came as float8", status=500)
        rows = rows[:t]
        handle = f"vh-{new_id()}"
        man = manifest(handle, t, rows.shape[1], rows.shape[2], rows.dtype)
        key, size = handle, man["metadata"]["total_aligned_bytes"]
        try:
            async with self._slots:
                if got.finite:
                    await asyncio.to_thread(self._put, man, rows, token_ids)
                else:  # as hs_connectors' producer: the reader fails at once instead of training on them
                    log.warning("vllm-hidden: NaN/Inf in the hidden states of a %d-token prompt; %s:error put instead",
                                t, handle)
                    key, size = handle + ":error", 0
                    await asyncio.to_thread(self._put_error, handle, "non-finite hidden states (NaN or Inf) in a "
                                            f"{t}-token prompt")
        except RuntimeError as e:
            raise RequestError(f"could not put the hidden states into the Mooncake store: {e}", status=500) from None
        finally:
            self.release(reserved)
        self.held += size
        self._own[key] = _Held(size, time.time() + self.serve.unread_ttl_s)
        return Stored(man, key)

    async def discard(self, stored: str) -> None:
        await asyncio.to_thread(self.store.remove, stored, True)
        self.sweep()
