"""The Mooncake form's bookkeeping without a store (tests/integration/test_mooncake.py runs the
real one): the object's bytes at the manifest's offsets, put hard-pinned from a registered
buffer (registered once), `:error` instead of non-finite states, the budget, expiry and the
discard of a hung-up client's object."""

from __future__ import annotations

import asyncio
import ctypes
import json
import time
from types import SimpleNamespace

import pytest
import torch

from vllm_hidden.config import ConnectorConfig, ServeConfig
from vllm_hidden.server.mooncake import MooncakeTransport
from vllm_hidden.server.protocol import RequestError
from vllm_hidden.server.transport import Delivery, ServerShape


class FakeStore:
    """What MooncakeTransport calls of mooncake.store.MooncakeDistributedStore: objects kept as bytes."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.configs: dict[str, object] = {}
        self.registered: list[tuple[int, int]] = []

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def put_from(self, key: str, ptr: int, size: int, config) -> int:
        assert any(p <= ptr and ptr + size <= p + n for p, n in self.registered), "put from an unregistered buffer"
        self.objects[key], self.configs[key] = ctypes.string_at(ptr, size), config
        return 0

    def put(self, key: str, value: bytes, config) -> int:
        self.objects[key], self.configs[key] = bytes(value), config
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [int(k in self.objects) for k in keys]

    def remove(self, key: str, force: bool = False) -> int:
        return 0 if self.objects.pop(key, None) is not None else -704


AUX = (2, 4)
H = 8


def form(budget: int = 1 << 20, ttl: float = 600.0) -> tuple[MooncakeTransport, FakeStore]:
    cfg = ConnectorConfig(connector="MooncakeHiddenStatesConnector", storage_path=None, aux_layer_ids=AUX,
                          mooncake={"global_segment_size": 1 << 30, "num_writer_threads": 2})
    t = MooncakeTransport.__new__(MooncakeTransport)  # its store made here, not by setup()
    t.cfg, t.serve = cfg, ServeConfig(max_unread_bytes=budget, unread_ttl_s=ttl, max_hidden_tokens=64)
    t.shape = ServerShape(hidden_size=H, dtype=torch.bfloat16, rank=0, processes=1)
    t.store = FakeStore()
    t.put_config = SimpleNamespace(with_hard_pin=True, preferred_segment="me:1")
    t.budget, t.reserved, t.held, t._own, t._buffers = budget, 0, 0, {}, []
    return t, t.store


def keep(t: MooncakeTransport, rows: torch.Tensor, ids: list[int], finite: bool = True):
    async def main():
        t._slots = asyncio.Semaphore(2)
        return await t.keep(Delivery(rows, None, finite), ids, 0)

    return asyncio.run(main())


def test_the_object_holds_the_tensors_at_the_manifests_offsets():
    t, store = form()
    rows = torch.randn(5, len(AUX), H).to(torch.bfloat16)
    kept = keep(t, rows, [7, 8, 9, 10, 11])
    m = kept.params
    obj = store.objects[kept.key]
    assert kept.key == m["handle"] and len(obj) == m["metadata"]["total_aligned_bytes"]
    for name, want in (("hidden_states", rows), ("token_ids", torch.tensor([7, 8, 9, 10, 11]))):
        spec = m["tensors"][name]
        got = torch.frombuffer(bytearray(obj[spec["offset"]:spec["offset"] + spec["nbytes"]]), dtype=want.dtype)
        assert torch.equal(got.view(want.shape), want), name
    assert store.configs[kept.key].with_hard_pin
    assert t.held == len(obj) and len(store.registered) == 1
    keep(t, rows[:2], [1, 2])  # the next put reuses the registered buffer
    assert len(store.registered) == 1


def test_non_finite_states_go_as_an_error_marker():
    t, store = form()
    rows = torch.zeros(3, len(AUX), H, dtype=torch.bfloat16)
    kept = keep(t, rows, [1, 2, 3], finite=False)
    handle = kept.params["handle"]
    assert handle not in store.objects and kept.key == handle + ":error"
    assert "non-finite" in json.loads(store.objects[handle + ":error"])["error"]


def test_budget_expiry_and_discard():
    t, store = form(budget=4000, ttl=0.2)
    assert t.reserve(3000) is None
    assert "no room for 2000 more" in t.reserve(2000)
    t.release(3000)
    kept = keep(t, torch.ones(10, len(AUX), H, dtype=torch.bfloat16), list(range(10)))
    assert t.held > 0
    asyncio.run(t.discard(kept.key))  # its client left: removed, its bytes back
    assert kept.key not in store.objects and t.held == 0
    kept = keep(t, torch.ones(10, len(AUX), H, dtype=torch.bfloat16), list(range(10)))
    time.sleep(0.25)
    t.sweep()  # nobody read it within --unread-ttl: removed
    assert kept.key not in store.objects and t.held == 0 and t._own == {}


def test_float8_rows_are_refused():
    t, _ = form()
    with pytest.raises(RequestError, match="float8"):
        keep(t, torch.zeros(2, len(AUX), H, dtype=torch.float8_e4m3fn), [1, 2])
