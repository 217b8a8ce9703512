"""The server's fetch form and encoders without a server: the shared store (fetch once,
expiry seen by any process, the byte budget), the chunked base64 encoder, the non-finite
report and the client helpers' checks."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import time

import pytest
import torch
from safetensors.torch import load

from vllm_hidden.format.header import load as load_safetensors
from vllm_hidden.format.header import pieces as safetensors_pieces
from vllm_hidden.server import decode, fetch
from vllm_hidden.server.protocol import _b64_pieces, finiteness, inline_parts, parse_field, prepare
from vllm_hidden.server.store import FetchStore


@pytest.mark.parametrize("sizes", [[0], [1], [2], [3], [1, 1, 1, 1], [2, 0, 5, 1], [7, 3 << 20, 2, (3 << 20) + 1],
                                   [24, 9999, 1]])
def test_chunked_base64_equals_base64_of_the_whole(sizes):
    rng = random.Random(sum(sizes))
    pieces = [bytes(rng.randrange(256) for _ in range(n)) if n < 100_000 else os.urandom(n) for n in sizes]
    got = b"".join(_b64_pieces([bytearray(p) for p in pieces]))
    assert got == base64.b64encode(b"".join(pieces))


def test_inline_object_is_json_and_decodes_to_the_rows():
    rows = torch.randn(6, 3, 8).bfloat16()
    spec = parse_field({"layers": [5, 1]}, (1, 3, 5))
    obj = json.loads(b"".join(inline_parts(prepare(spec, rows, [4, 5, 6, 7, 8]))))
    d = decode(obj)
    assert d["token_ids"].tolist() == [4, 5, 6, 7, 8]
    assert torch.equal(d["hidden_states"], rows[:5][:, [2, 0]])
    assert obj["transfer"] == "inline" and obj["not_finite"]["count"] == 0


def test_load_safetensors_matches_the_library_and_views_the_buffer():
    tensors = {"hidden_states": torch.randn(5, 2, 4).bfloat16(), "token_ids": torch.arange(5)}
    raw = b"".join(bytes(memoryview(p).cast("B")) for p in safetensors_pieces(tensors))
    ref = load(raw)
    buf = bytearray(raw)
    got = load_safetensors(buf)
    for k in tensors:
        assert torch.equal(got[k], ref[k]) and torch.equal(got[k], tensors[k])
    buf[-1] ^= 0xFF  # a view, not a copy
    assert got["token_ids"][-1] != 4
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_safetensors(b"\x00" * 4)


def test_finiteness_counts_values_and_names_the_first_bad_token():
    hs = torch.zeros(10, 3, 4)
    assert finiteness(hs, (2, 7, 9)) == {"count": 0, "tokens": 0, "first_token": None, "layer_ids": []}
    hs[6, 0, 1] = float("inf")
    hs[3, 1, 0] = float("nan")
    hs[3, 2, 3] = float("nan")
    got = finiteness(hs, (2, 7, 9))
    assert got == {"count": 3, "tokens": 2, "first_token": 3, "layer_ids": [7, 9]}
    # the worker's statistics said every row is finite: no pass over the values
    assert finiteness(hs, (2, 7, 9), suspect=False)["count"] == 0


def test_prepare_reports_non_finite_states_and_still_returns_them():
    rows = torch.ones(4, 2, 8).bfloat16()
    rows[2, 1, 5] = float("nan")
    spec = parse_field(True, (0, 1))
    p = prepare(spec, rows, [1, 2, 3, 4])
    assert p.meta["not_finite"] == {"count": 1, "tokens": 1, "first_token": 2, "layer_ids": [1]}
    d = decode(json.loads(b"".join(inline_parts(p))))
    assert torch.isnan(d["hidden_states"][2, 1, 5])


def _put(store: FetchStore, data: bytes) -> tuple[str, int]:
    assert store.reserve(len(data) + 100) is None
    return asyncio.run(store.put([data[:3], memoryview(data)[3:]], len(data) + 100))


def _read(fd: int) -> bytes:
    try:
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def test_store_gives_the_bytes_once_to_any_process(tmp_path):
    owner, other = FetchStore(str(tmp_path), 10_000, 60), FetchStore(str(tmp_path), 10_000, 60)
    data = os.urandom(1234)
    entry, size = _put(owner, data)
    assert size == 1234 and owner.held == 1234 and owner.reserved == 0
    assert _read(other.open(entry)) == data  # another API process serves it
    assert other.open(entry) is None and owner.open(entry) is None  # once
    owner.sweep()  # the owner learns it was fetched and frees the room
    assert owner.held == 0 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", ["", "x", "../../etc/passwd", "A" * 31 + "/", "A" * 33, "." + "A" * 31])
def test_store_refuses_ids_that_are_not_ids(tmp_path, bad):
    store = FetchStore(str(tmp_path), 10_000, 60)
    assert store.open(bad) is None


def test_store_budget_refuses_then_frees(tmp_path):
    store = FetchStore(str(tmp_path), 3000, 60)
    a, _ = _put(store, b"a" * 1000)
    _put(store, b"b" * 1000)
    assert store.held == 2000
    why = store.reserve(1001)
    assert why is not None and "--max-unfetched-bytes" in why and "3000" in why
    os.close(store.open(a))
    assert store.reserve(1001) is None  # the sweep on refusal saw the fetch
    store.release(1001)
    assert store.reserved == 0


def test_store_expiry_is_seen_by_every_process_and_swept_by_the_owner(tmp_path):
    owner, other = FetchStore(str(tmp_path), 10_000, 0.3), FetchStore(str(tmp_path), 10_000, 60)
    entry, _ = _put(owner, b"x" * 100)
    time.sleep(0.4)
    assert other.open(entry) is None  # its mtime says it expired, whoever asks
    entry2, _ = _put(owner, b"y" * 100)
    time.sleep(0.4)
    owner.sweep()
    assert owner.held == 0 and not (tmp_path / entry2).exists()


def test_store_close_removes_its_own_files_only(tmp_path):
    a, b = FetchStore(str(tmp_path), 10_000, 60), FetchStore(str(tmp_path), 10_000, 60)
    ea, _ = _put(a, b"a" * 10)
    eb, _ = _put(b, b"b" * 10)
    a.close()
    assert not (tmp_path / ea).exists() and (tmp_path / eb).exists()


def test_client_helpers_refuse_the_other_form():
    with pytest.raises(ValueError, match="fetch form"):
        decode({"format": "safetensors", "transfer": "fetch", "url": "/v1/hidden_states/x"})
    with pytest.raises(ValueError, match="not a fetch-form"):
        fetch("http://127.0.0.1:1", {"format": "safetensors", "encoding": "base64", "data": ""})
    with pytest.raises(ValueError, match="client_or_url"):
        fetch(object(), {"transfer": "fetch", "url": "/v1/hidden_states/x"})


@pytest.mark.parametrize("value, needle", [({"transfer": "binary"}, "'hidden_states.transfer'"),
                                           ({"transfer": None}, "'hidden_states.transfer'")])
def test_bad_transfer_is_named(value, needle):
    from vllm_hidden.server.protocol import RequestError

    with pytest.raises(RequestError, match=needle):
        parse_field(value, (0,))


def test_transfer_defaults_to_inline_and_fetch_is_kept():
    assert parse_field(True, (0, 1)).transfer == "inline"
    spec = parse_field({"transfer": "fetch", "tokens": "all"}, (0, 1))
    assert spec.fetch and spec.all_tokens and spec.layer_ids == (0, 1)
