import json

import blake3
import pytest
import torch
from safetensors import safe_open

from tests.outputs import random_sample, shard_writer, write_output
from vllm_hidden.capture.records import Rows
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.format import quant
from vllm_hidden.storage.manifest import Manifest

K, H = 2, 8


def sample(i, n):
    return random_sample(i, n, K, H)


def write(tmp_path, lengths, max_shard_bytes, threads=2):
    data = {f"id{i}": sample(i, n) for i, n in enumerate(lengths)}
    shards = write_output(tmp_path, [3, 5], H, data, max_shard_bytes=max_shard_bytes, writer_threads=threads)
    return shards, data


def test_shards_hold_at_most_the_size_limit_and_are_valid_safetensors(tmp_path):
    per_row = K * H * 2 + 8
    shards, data = write(tmp_path, [10, 20, 5, 7, 30, 1], max_shard_bytes=25 * per_row)
    # 25 rows per shard: [10] | [20, 5] | 7 opens a shard; 30 > 25 gets its own; 1 joins 7
    assert [(s.num_samples, s.num_tokens) for s in shards] == [(1, 10), (2, 25), (1, 30), (2, 8)]
    for s in shards:
        raw = (tmp_path / s.file).read_bytes()
        assert len(raw) == s.bytes and blake3.blake3(raw).hexdigest() == s.blake3
    with safe_open(str(tmp_path / shards[1].file), framework="pt") as f:
        index = json.loads(f.metadata()["samples"])
        assert index == [["id1", 0, 20], ["id2", 20, 5]]
        hs, tok = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        assert hs.dtype == torch.bfloat16 and tok.dtype == torch.int64 and hs.shape == (25, K, H)
        assert torch.equal(hs[20:25], data["id2"][1]) and torch.equal(tok[:20], data["id1"][0])
    with safe_open(str(tmp_path / shards[3].file), framework="pt") as f:
        assert json.loads(f.metadata()["samples"]) == [["id3", 0, 7], ["id5", 7, 1]]
        assert torch.equal(f.get_tensor("hidden_states")[7:], data["id5"][1])
    assert not list(tmp_path.glob(".*.tmp"))


def test_manifest_round_trip(tmp_path):
    shards, _ = write(tmp_path, [3, 4], max_shard_bytes=1 << 20)
    m = Manifest.read(tmp_path)
    assert m.shards == shards and m.layer_ids == [3, 5] and m.num_samples == 2 and m.num_tokens == 7
    d = json.loads((tmp_path / "manifest.json").read_text())
    assert d["aux_layer_ids"] == [4, 6] and d["format"] == "vllm-hidden/1"
    d["format"] = "other/9"
    with pytest.raises(ValueError, match="unsupported manifest format 'other/9'"):
        Manifest.from_dict(d)


def test_reader_contract_and_dataloader_workers(tmp_path):
    lengths = [10, 20, 5, 7, 30, 1]
    _, data = write(tmp_path, lengths, max_shard_bytes=25 * (K * H * 2 + 8))
    ds = HiddenStatesDataset(tmp_path)
    assert len(ds) == 6 and ds.layer_ids == [3, 5]
    seen = {}
    for i in range(len(ds)):
        s = ds[i]
        assert s["token_ids"].dtype == torch.int64 and s["hidden_states"].dtype == torch.bfloat16
        seen[s["id"]] = s
    assert set(seen) == set(data)
    for sid, (tok, hs) in data.items():
        assert torch.equal(seen[sid]["token_ids"], tok) and torch.equal(seen[sid]["hidden_states"], hs)
    with pytest.raises(IndexError):
        ds[6]
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert sorted(s["id"] for s in loader) == sorted(data)


def test_reader_without_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        HiddenStatesDataset(tmp_path)


def _writer(tmp_path, rows, threads=1):
    return shard_writer(tmp_path, [3, 5], H, rows=rows, writer_threads=threads)


def test_dropped_and_interleaved_samples(tmp_path):
    """Slots are filled out of order and one is dropped (an aborted request): the index lists
    exactly the committed samples at their rows; the dropped one's rows are zeros."""
    w = _writer(tmp_path, rows=100)
    data = {i: sample(i, n) for i, n in enumerate([4, 6, 3])}
    slots = {i: w.reserve(f"id{i}", data[i][0]) for i in data}
    slots[2].buf.copy_(data[2][1])
    w.commit(slots[2])
    w.drop(slots[1])
    slots[0].buf[:2].copy_(data[0][1][:2])  # filled in two steps
    slots[0].buf[2:].copy_(data[0][1][2:])
    w.commit(slots[0])
    with pytest.raises(RuntimeError, match="already committed or dropped"):
        w.commit(slots[0])
    (shard,) = w.close()
    with safe_open(str(tmp_path / shard.file), framework="pt") as f:
        assert json.loads(f.metadata()["samples"]) == [["id0", 0, 4], ["id2", 10, 3]]
        hs, tok = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        assert torch.equal(hs[:4], data[0][1]) and torch.equal(hs[10:], data[2][1])
        assert not hs[4:10].any() and not tok[4:10].any() and torch.equal(tok[10:], data[2][0])
    assert shard.num_samples == 2 and shard.num_tokens == 7
    assert blake3.blake3((tmp_path / shard.file).read_bytes()).hexdigest() == shard.blake3


def test_incomplete_samples_are_left_out_at_close(tmp_path):
    w = _writer(tmp_path, rows=10)
    tok, hs = sample(0, 8)
    w.add("done", tok, hs)
    w.reserve("half", sample(1, 5)[0])  # seals the first arena, waits for the rest that never comes
    (shard,) = w.close()
    assert shard.num_samples == 1 and shard.num_tokens == 8


def test_memory_is_bounded_by_the_arena_pool(tmp_path, monkeypatch):
    """More shards than threads + 1: arenas are reused, never more than the pool holds."""
    import vllm_hidden.storage.shards as shards_mod

    allocated = []
    real = shards_mod.ShardWriter._new_buffer
    monkeypatch.setattr(shards_mod.ShardWriter, "_new_buffer",
                        lambda self, rows: allocated.append(rows) or real(self, rows))
    w = _writer(tmp_path, rows=10, threads=2)
    data = {}
    for i in range(40):
        data[f"id{i}"] = sample(i, 7)
        w.add(f"id{i}", *data[f"id{i}"])
    shards = w.close()
    assert len(shards) == 40 and len(allocated) <= 3
    assert [s.file for s in shards] == [f"shard-{i:05d}.safetensors" for i in range(40)]


def test_write_failure_is_raised_with_the_directory(tmp_path):
    w = _writer(tmp_path, rows=4)
    (tmp_path / "shard-00000.safetensors").mkdir()  # the finished file cannot take its name
    tok, hs = sample(0, 3)
    w.add("a", tok, hs)
    with pytest.raises(OSError, match="writing a shard to .*IsADirectoryError"):
        try:  # sealing shard 0 starts its write, which fails in a writer thread: reported on
            w.add("b", tok, hs)  # the next call into the writer, whichever comes first
        finally:
            w.close()


def test_reserve_blocks_while_every_arena_is_being_written(tmp_path, monkeypatch):
    """Backpressure: with one writer thread (two arenas) and the disk stalled, the third
    shard's reserve waits until a write finishes instead of allocating more memory."""
    import threading

    import vllm_hidden.storage.shards as shards_mod

    gate = threading.Event()
    real = shards_mod.ShardWriter._finish_file

    def slow(self, *args):
        gate.wait(10)
        return real(self, *args)

    monkeypatch.setattr(shards_mod.ShardWriter, "_finish_file", slow)
    w = _writer(tmp_path, rows=4, threads=1)
    tok, hs = sample(0, 3)
    w.add("a", tok, hs)
    w.add("b", tok, hs)  # shard 0 sealed -> writing (stalled); arena 2 filling
    got = threading.Event()
    t = threading.Thread(target=lambda: (w.add("c", tok, hs), got.set()))
    t.start()  # shard 1 sealed -> queued behind the stalled write; no free arena for "c"
    assert not got.wait(0.5)
    gate.set()
    assert got.wait(10)
    t.join()
    assert [s.num_samples for s in w.close()] == [1, 1, 1]


def test_long_ids_roll_the_shard_before_its_header_room_overflows(tmp_path):
    """Rows are written before the index is known, behind reserved header room: a shard whose
    index would not fit rolls early, and every file stays valid safetensors."""
    w = _writer(tmp_path, rows=10_000)
    room = w.header_room
    tok, hs = sample(0, 1)
    n = 0
    while w._next_shard == 0 and n < 10_000:  # until the first shard is sealed
        w.add("x" * 200 + str(n), tok, hs)
        n += 1
    shards = w.close()
    assert len(shards) == 2 and shards[0].num_samples < 10_000 and sum(s.num_samples for s in shards) == n
    for s in shards:
        with safe_open(str(tmp_path / s.file), framework="pt") as f:
            assert len(json.loads(f.metadata()["samples"])) == s.num_samples
        assert s.bytes == room + s.num_tokens * (K * H * 2 + 8)


def test_manifest_from_an_older_writer_is_refused_by_name(tmp_path):
    write(tmp_path, [3], max_shard_bytes=1 << 20)
    d = json.loads((tmp_path / "manifest.json").read_text())
    d["shards"][0]["sha256"] = d["shards"][0].pop("blake3")
    with pytest.raises(ValueError, match="has no blake3 checksum"):
        Manifest.from_dict(d)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
# "buf": the stats are made by a writer thread; "place": they came with the rows (decided at commit)
@pytest.mark.parametrize("fill", ["buf", "place"])
def test_samples_with_nan_or_inf_are_refused_named_and_not_written(tmp_path, poison, fill):
    w = shard_writer(tmp_path, [3, 5], H, max_shard_bytes=1 << 20, writer_threads=2)
    data = {f"id{i}": sample(i, 6) for i in range(4)}
    data["id1"][1][2:4, 1, 0] = poison  # tokens 2 and 3 of layer id 5
    for line, (sid, (tok, hs)) in enumerate(data.items()):
        slot = w.reserve(sid, tok, line=line + 10)
        if fill == "buf":
            slot.buf.copy_(hs)
        else:
            row_scale = torch.empty(hs.shape[:2])
            quant.row_amax(hs, row_scale)
            slot.place(0, Rows(hs, row_scale))
        w.commit(slot)
    alone = w.reserve("alone", torch.arange(3))  # never completed: left out at close
    w.close()
    (sid, line, why), = w.not_finite
    assert (sid, line) == ("id1", 11)
    kind = "NaN" if poison != poison else "Inf"
    assert f"2 {kind}" in why and "layer ids [5]" in why and "2 of 6 tokens (first at token 2)" in why, why
    assert alone.state == alone.DROPPED
    (s,) = w.shards
    raw = (tmp_path / s.file).read_bytes()
    assert blake3.blake3(raw).hexdigest() == s.blake3 and s.num_samples == 3
    with safe_open(str(tmp_path / s.file), framework="pt") as f:
        assert [e[0] for e in json.loads(f.metadata()["samples"])] == ["id0", "id2", "id3"]
        hs = f.get_tensor("hidden_states")
        assert torch.isfinite(hs).all() and not hs[6:12].any()  # id1's rows: zeros, never its values
        assert torch.equal(hs[12:18], data["id2"][1])


def test_a_shard_of_only_refused_samples_is_not_written(tmp_path):
    w = shard_writer(tmp_path, [3, 5], H, max_shard_bytes=1 << 20, writer_threads=1)
    tok, hs = sample(0, 4)
    hs[0, 0, 0] = float("nan")
    w.add("x", tok, hs)
    assert w.close() == [] and [e[0] for e in w.not_finite] == ["x"]
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(".*.tmp"))


def test_write_behind_turns_itself_off_where_unsupported(tmp_path, monkeypatch):
    import ctypes

    from vllm_hidden.storage import files

    calls = []

    def unsupported(fd, offset, nbytes, flags):
        calls.append((offset, nbytes, flags))
        ctypes.set_errno(95)  # EOPNOTSUPP
        return -1

    monkeypatch.setattr(files, "_SYNC_FILE_RANGE", unsupported)
    shards, data = write(tmp_path, [4, 5], max_shard_bytes=1 << 20)
    assert len(calls) == 1 and calls[0][2] == 2 and files._SYNC_FILE_RANGE is None  # two writes: tried once
    (s,) = shards
    assert blake3.blake3((tmp_path / s.file).read_bytes()).hexdigest() == s.blake3
    assert torch.equal(HiddenStatesDataset(tmp_path)[1]["hidden_states"], data["id1"][1])
