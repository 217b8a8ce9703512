"""The shard format's one safetensors header parser and builder (vllm_hidden.format), checked
against the safetensors library on the same bytes, and its refusals of damaged headers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from vllm_hidden.format import header as st
from vllm_hidden.format.shard import ShardHeader, ShardInfo


def _reader(buf: bytes):
    return lambda offset, n: buf[offset : offset + n]


def _file(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def test_parse_header_reads_what_the_library_writes():
    tensors = {"a": torch.randn(3, 2, 4).bfloat16(), "b": torch.arange(7), "c": torch.zeros(0, 5),
               "d": torch.randn(2, 3).to(torch.float8_e4m3fn)}
    buf = st_save(tensors, metadata={"k": "v"})
    h = st.parse_header(_reader(buf), len(buf))
    assert h.metadata == {"k": "v"}
    for name, t in tensors.items():
        e = h.tensors[name]
        assert (e.dtype, e.shape, e.nbytes) == (t.dtype, tuple(t.shape), t.numel() * t.element_size())
        got = st.load(bytearray(buf))[name]
        assert got.dtype == t.dtype and torch.equal(got.float(), t.float())


def test_built_headers_and_pieces_load_in_the_library():
    tensors = {"hidden_states": torch.randn(5, 2, 8).bfloat16(), "token_ids": torch.arange(5)}
    for multiple in (8, 24):
        head, *raws = st.pieces(tensors, multiple=multiple)
        assert len(head) % multiple == 0
        buf = head + b"".join(bytes(memoryview(r).cast("B")) for r in raws)
        ref = st_load(buf)
        got = st.load(bytearray(buf))
        for k, t in tensors.items():
            assert torch.equal(ref[k], t) and torch.equal(got[k], t)
    ents, end = st.entries([("x", torch.float32, [2, 3])])
    head = st.build_header(ents, {"m": "1"}, room=256)
    assert len(head) == 256 and st_load(head + bytes(end))["x"].shape == (2, 3)
    with pytest.raises(ValueError, match="overflows"):
        st.build_header(ents, {"m": "x" * 300}, room=256)


@pytest.mark.parametrize("buf, why", [
    (b"\x00" * 4, "not a safetensors file"),
    ((10**6).to_bytes(8, "little") + b"{}", "header length"),
    (b"\x04\x00\x00\x00\x00\x00\x00\x00nope", "not JSON"),
    (_file([1, 2]), "not a JSON object"),
    (_file({"t": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}, b"\x00"), "bad entry"),
    (_file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\x00" * 4), "4 bytes for shape"),
    (_file({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\x00"), "bad entry"),
    (_file({"t": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, b"\x00" * 4), "past the file"),
    (_file({"__metadata__": {"k": 1}}), "__metadata__"),
])
def test_damaged_headers_are_refused_with_what_is_wrong(buf, why):
    with pytest.raises(ValueError, match=why):
        st.load(buf)


def _shard(index, digests=None, hidden=(4, 2, 3)) -> bytes:
    meta = {"samples": json.dumps(index)}
    if digests is not None:
        meta["sample_blake3"] = json.dumps(digests)
    return st_save({"hidden_states": torch.zeros(hidden, dtype=torch.bfloat16),
                    "token_ids": torch.zeros(hidden[0], dtype=torch.int64)}, metadata=meta)


def test_shard_header_index_and_problems():
    buf = _shard([["a", 0, 3], [7, 3, 1]], ["0" * 32, "1" * 32])
    h = ShardHeader.read(_reader(buf), len(buf), "x")
    assert h.lengths == [3, 1] and list(h.rows) == ["hidden_states", "token_ids"]
    info = ShardInfo(file="x", bytes=len(buf), blake3="", num_samples=2, num_tokens=4)
    assert h.problems(info, layers=2) == []
    assert len(h.problems(info, layers=3)) == 1
    over = _shard([["a", 2, 3]])
    assert "outside" in ShardHeader.read(_reader(over), len(over), "x").problems(
        ShardInfo(file="x", bytes=0, blake3="", num_samples=1, num_tokens=3), None)[0]
    for bad in (_shard([["a", -1, 3]]), _shard([["a", 0]]), _shard([["a", 0, 3]], ["0" * 32, "1" * 32])):
        with pytest.raises(ValueError, match="shard 'x' has a damaged header"):
            ShardHeader.read(_reader(bad), len(bad), "x")
