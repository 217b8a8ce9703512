"""The training read path: per-sample checksums checked on exactly the samples read, shard-aware
shuffling (each sample once per epoch across ranks x DataLoader workers, deterministic by seed and
epoch), token-budget batches, older outputs, and S3 reads (one ranged GET per sample) through a
real local S3 endpoint."""

from __future__ import annotations

import json
import logging
import os
import struct

import pytest
import torch

from tests.damage import flip_bit
from tests.outputs import random_sample, write_output
from tests.s3_server import FaultyProxy
from vllm_hidden.data import HiddenStatesDataset, ShardedStream, collate_tokens, dataset, token_batches
from vllm_hidden.data.batches import BufferPool
from vllm_hidden.format import shard
from vllm_hidden.storage import files
from vllm_hidden.storage.manifest import MANIFEST, Manifest

K, H = 2, 16


def _write(root, n=48, *, final=True, mask=True, fp8=False, rows_per_shard=60, seed=0, upload=None):
    """A real output (the shard writer): n samples of 1..24 tokens; returns {id: sample tensors}."""
    g = torch.Generator().manual_seed(seed)
    data, samples = {}, {}
    for i in range(n):
        t = int(torch.randint(1, 25, (1,), generator=g))
        tok, hs, *fin = random_sample(g, t, K, H, high=1000, final=final)
        fin = fin[0] if final else None
        samples[f"s{i}"] = (tok, hs, fin, [[t // 3, t]] if mask else None)
        m = torch.zeros(t, dtype=torch.bool)
        if mask:
            m[t // 3 :] = True
        data[f"s{i}"] = {"token_ids": tok, "hidden_states": hs, "final_hidden_states": fin, "loss_mask": m}
    write_output(root, [1, 3], H, samples, rows=rows_per_shard, writer_threads=2, final_state=final, loss_mask=mask,
                 fp8=fp8, manifest={"num_model_layers": 4}, **(upload or {}))
    return data


def _same(got: dict, want: dict) -> None:
    for name, t in want.items():
        if t is not None and not (name == "loss_mask" and name not in got):
            assert torch.equal(got[name], t), name


def _header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), 8 + n


def _where(root, sid, tensor):
    """(shard file, byte offset in it) of sample `sid`'s first row of `tensor`, from the header."""
    for p in sorted(root.glob("shard-*.safetensors")):
        header, start = _header(p)
        for entry in json.loads(header["__metadata__"]["samples"]):
            if entry[0] == sid:
                t = header[tensor]
                row_bytes = (t["data_offsets"][1] - t["data_offsets"][0]) // t["shape"][0]
                return p, start + t["data_offsets"][0] + entry[1] * row_bytes
    raise KeyError(sid)


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    root = tmp_path_factory.mktemp("out")
    return root, _write(root)


def test_each_sample_once_per_epoch_across_two_ranks_and_two_workers(output):
    root, data = output
    assert len(list(root.glob("shard-*"))) >= 6

    def epoch(e, rank, persistent=None, budget=None):
        stream = ShardedStream(str(root), seed=7, window=2, rank=rank, world_size=2, token_budget=budget)
        stream.set_epoch(e)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
        if budget is None:
            return [s["id"] for s in loader]
        return [i for b in loader for i in b["ids"]]

    orders = {}
    for e in (0, 1):
        ranks = [epoch(e, r) for r in (0, 1)]
        assert not set(ranks[0]) & set(ranks[1])
        assert sorted(ranks[0] + ranks[1]) == sorted(data)  # every sample once: none twice, none skipped
        assert abs(len(ranks[0]) - len(ranks[1])) <= 1
        orders[e] = ranks
    assert orders[0] != orders[1]  # a new epoch, a new order
    assert [epoch(0, r) for r in (0, 1)] == orders[0]  # same seed and epoch: same order
    batched = epoch(1, 0, budget=40) + epoch(1, 1, budget=40)
    assert sorted(batched) == sorted(data)

    # persistent workers never see set_epoch: they count epochs themselves, in step with it
    stream = ShardedStream(str(root), seed=7, window=2, rank=1, world_size=2)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True)
    assert [[s["id"] for s in loader] for _ in range(2)] == [orders[0][1], orders[1][1]]


def test_order_is_a_function_of_seed_and_epoch_and_windows_hold_few_shards(output):
    root, data = output
    ds = HiddenStatesDataset(root)
    s = ShardedStream(ds, seed=1, window=2)
    assert s.order(0) == ShardedStream(ds, seed=1, window=2).order(0)
    assert s.order(0) != s.order(1) and s.order(0) != ShardedStream(ds, seed=2, window=2).order(0)
    assert sorted(s.order(3)) == list(range(len(ds)))
    parts = [s.order(3, p, 4) for p in range(4)]
    assert sorted(sum(parts, [])) == list(range(len(ds)))
    shard_of = lambda i: ds.locate(i)[0]  # noqa: E731
    for w in s.windows(3, 0, 1):
        assert len({shard_of(i) for i in w}) <= 2
    assert ShardedStream(ds, shuffle=False).order(0) == list(range(len(ds)))
    for bad, kw in (("window", {"window": 0}), ("read_ahead", {"read_ahead": -1}), ("layout", {"layout": "ragged"}),
                    ("token_budget", {"token_budget": 0}), ("rank", {"rank": 2, "world_size": 2})):
        with pytest.raises(ValueError, match=bad):
            ShardedStream(ds, **kw)


def test_a_flipped_byte_is_found_when_and_only_when_its_sample_is_read(tmp_path, monkeypatch):
    data = _write(tmp_path, n=24)
    hit = {"s3": "hidden_states", "s9": "final_hidden_states", "s14": "token_ids", "s20": "loss_mask"}
    for sid, tensor in hit.items():
        p, off = _where(tmp_path, sid, tensor)
        flip_bit(p, off)
    # verification reads what is returned and nothing else: a shard is never hashed whole
    monkeypatch.setattr(files, "file_checksum", lambda *a: pytest.fail("a whole shard was hashed"))
    ds = HiddenStatesDataset(tmp_path)
    for i in range(len(ds)):
        k, j = ds.locate(i)
        sid = ds.shard(k).index[j][0]
        if sid in hit:
            with pytest.raises(ValueError, match=rf"shard-\d+\.safetensors', sample '{sid}'.*do not match"):
                ds[i]
        else:
            _same(ds[i], data[sid])
    assert not torch.equal(HiddenStatesDataset(tmp_path, verify=False)[3]["hidden_states"], data["s3"]["hidden_states"])
    with pytest.raises(ValueError, match="do not match"):  # through the stream and its read-ahead threads too
        list(ShardedStream(ds, read_ahead=3))


real_checksum = files.file_checksum


def test_one_row_shards_index_their_samples(tmp_path):
    data = _write(tmp_path, n=6, rows_per_shard=1)  # the least header room there is: each sample alone
    ds = HiddenStatesDataset(tmp_path)
    assert ds.num_shards == 6
    for i in range(len(ds)):
        _same(ds[i], data[ds[i]["id"]])


def _strip_checksums(root):
    """Make `root` what an older writer wrote: no per-sample checksums, in shards or manifest."""
    for p in root.glob("shard-*.safetensors"):
        header, start = _header(p)
        del header["__metadata__"][shard.SAMPLE_CHECKSUMS]
        text = json.dumps(header, separators=(",", ":")).encode()
        with open(p, "r+b") as f:  # same header length (space padding), so the data stays where it is
            f.seek(8)
            f.write(text + b" " * (start - 8 - len(text)))
    m = json.loads((root / MANIFEST).read_text())
    del m["sample_checksum"]
    for s in m["shards"]:
        s["blake3"] = files.file_checksum(root / s["file"])
    (root / MANIFEST).write_text(json.dumps(m))


def test_older_outputs_read_with_a_one_line_note_and_whole_shard_checks(tmp_path, caplog, monkeypatch):
    data = _write(tmp_path, n=60, rows_per_shard=700)  # shards of ~70 KB: hashed on blake3's thread pool
    assert json.loads((tmp_path / MANIFEST).read_text())["sample_checksum"] == shard.SAMPLE_CHECKSUM
    _strip_checksums(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vllm_hidden"):
        ds = HiddenStatesDataset(tmp_path)
        for i in range(len(ds)):
            s = ds[i]
            _same(s, data[s["id"]])
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "without per-sample checksums" in notes[0] and "whole file" in notes[0], notes
    # whole-file hashing in forked DataLoader workers, after this process started blake3's thread
    # pool (which does not survive fork: hashing with it there hangs, and the loader times out)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(16 << 20))
    files.file_checksum(big)
    loader = torch.utils.data.DataLoader(HiddenStatesDataset(tmp_path), batch_size=None, num_workers=2, timeout=60)
    assert sorted(s["id"] for s in loader) == sorted(data)
    # a process hashes each shard once, even if it closes and reopens it
    monkeypatch.setattr(dataset, "_OPEN_SHARDS", 1)
    hashed = []
    monkeypatch.setattr(files, "file_checksum", lambda path: hashed.append(path) or real_checksum(path))
    ds = HiddenStatesDataset(tmp_path)
    for i in torch.randperm(len(ds)).tolist() * 2:
        ds[i]
    assert sorted(hashed) == sorted(tmp_path.glob("shard-*.safetensors"))
    monkeypatch.undo()
    p, off = _where(tmp_path, "s5", "hidden_states")
    flip_bit(p, off)
    fresh = HiddenStatesDataset(tmp_path)
    with pytest.raises(ValueError, match=rf"{p.name}' does not match its BLAKE3"):
        fresh[fresh.starts[int(p.stem.split("-")[1])]]  # the shard's first sample: the whole file is checked


def test_token_budget_batches_never_exceed_it_and_keep_every_token(output, tmp_path):
    root, data = output
    ds = HiddenStatesDataset(root)
    lengths = [len(d["token_ids"]) for d in data.values()]
    for budget in (24, 50, 200):
        for layout in ("packed", "padded"):
            plan = token_batches(lengths, budget, layout)
            assert sum(plan, []) == list(range(len(lengths)))  # in order, each once
            for b in plan:
                n = [lengths[i] for i in b]
                assert (len(n) * max(n) if layout == "padded" else sum(n)) <= budget
            seen, tokens = [], 0
            for batch in ShardedStream(ds, seed=budget, token_budget=budget, layout=layout, read_ahead=2):
                lens = batch["lengths"].tolist()
                tokens += sum(lens)
                if layout == "packed":
                    assert batch["hidden_states"].shape == (sum(lens), K, H) and sum(lens) <= budget
                    assert batch["cu_seqlens"].tolist() == [sum(lens[:b]) for b in range(len(lens) + 1)]
                    rows = [slice(o, o + n) for o, n in zip(batch["cu_seqlens"].tolist(), lens)]
                    assert torch.equal(batch["position_ids"], torch.cat([torch.arange(n) for n in lens]))
                else:
                    assert len(lens) * max(lens) <= budget
                    assert batch["hidden_states"].shape == (len(lens), max(lens), K, H)
                    assert batch["attention_mask"].sum(1).tolist() == lens
                    rows = [(b, slice(0, n)) for b, n in enumerate(lens)]
                    pad = ~batch["attention_mask"]
                    assert not batch["loss_mask"][pad].any() and not batch["hidden_states"][pad].any()
                for sid, r in zip(batch["ids"], rows):
                    _same({k: batch[k][r] for k in ("token_ids", "hidden_states", "final_hidden_states",
                                                     "loss_mask")}, data[sid])
                seen += batch["ids"]
            assert sorted(seen) == sorted(data) and tokens == sum(lengths)
    # the stream reuses a batch's memory only once the consumer let go of it: kept batches stay intact
    kept = list(ShardedStream(ds, seed=3, token_budget=50, read_ahead=2))
    assert len({b["hidden_states"].data_ptr() for b in kept}) == len(kept)
    for batch in kept:
        for sid, o, n in zip(batch["ids"], batch["cu_seqlens"].tolist(), batch["lengths"].tolist()):
            _same({k: batch[k][o : o + n] for k in ("token_ids", "hidden_states", "final_hidden_states", "loss_mask")},
                  data[sid])
    samples = [ds[i] for i in range(5)]
    for layout in ("packed", "padded"):
        b = collate_tokens(samples, layout)
        assert (b["ids"] == [s["id"] for s in samples]
                and b["lengths"].tolist() == [len(s["token_ids"]) for s in samples])
    most = max(lengths)
    with pytest.raises(ValueError,
                       match=rf"sample 's\d+' has {most} tokens, more than the token budget {most - 1}") as e:
        list(ShardedStream(ds, token_budget=most - 1))
    assert len(data[str(e.value).split("'")[1]]["token_ids"]) == most  # the sample named is that long


def test_a_pooled_buffer_is_reused_only_once_nothing_refers_to_it():
    pool = BufferPool(keep=2)
    a = pool.take(1000)[10:20].view(torch.int16)  # a view the consumer keeps
    b = pool.take(800)
    assert b.data_ptr() != a.data_ptr() - 10
    ptr = b.data_ptr()
    del b
    assert pool.take(900).data_ptr() == ptr  # let go: reused (and large enough)
    del a
    assert len({pool.take(100).data_ptr() for _ in range(3)}) == 1  # each dropped at once: the same buffer


def test_fp8_batches_are_dequantized_like_single_samples(tmp_path):
    _write(tmp_path, n=12, fp8=True, final=True)
    ds = HiddenStatesDataset(tmp_path)
    for batch in ShardedStream(ds, token_budget=64):
        assert batch["hidden_states"].dtype == torch.bfloat16 and "hidden_states_scale" not in batch
        for sid, o, n in zip(batch["ids"], batch["cu_seqlens"].tolist(), batch["lengths"].tolist()):
            one = ds[int(sid[1:])]
            assert one["id"] == sid
            assert torch.equal(batch["hidden_states"][o : o + n], one["hidden_states"])
            assert torch.equal(batch["final_hidden_states"][o : o + n], one["final_hidden_states"])


def test_s3_reads_one_ranged_get_per_sample_with_read_ahead_and_retries(s3, tmp_path):
    url, bucket, _ = s3
    port = int(url.rsplit(":", 1)[1])
    uri = f"s3://{bucket}/read"
    data = _write(tmp_path / "stage", n=30, final=False, upload={"upload_uri": uri, "s3_endpoint_url": url})
    from vllm_hidden.storage.s3 import S3Location

    S3Location(uri, url).put_file(tmp_path / "stage" / MANIFEST, MANIFEST)
    shards = Manifest.read(tmp_path / "stage").shards
    requests = []

    def rule(method, path, n):
        if ".safetensors" in path:
            requests.append(method)
            if method == "GET" and n % 9 == 0:
                return ("status", 503)  # boto3 retries it
        return None

    proxy = FaultyProxy(port, rule)
    try:
        ds = HiddenStatesDataset(uri, s3_endpoint_url=proxy.url)
        got = list(ShardedStream(ds, seed=1, read_ahead=4))
    finally:
        proxy.stop()
    assert sorted(s["id"] for s in got) == sorted(data)
    for s in got:
        _same(s, data[s["id"]])
    injected = len(proxy.injected)
    assert injected > 0
    # per shard: a HEAD (size), 2 GETs for the header and 1 for its ids and mask; then one GET per sample
    assert requests.count("HEAD") == len(shards)
    assert requests.count("GET") - injected == 3 * len(shards) + len(data)
    loader = torch.utils.data.DataLoader(ShardedStream(HiddenStatesDataset(uri, s3_endpoint_url=url), token_budget=64),
                                         batch_size=None, num_workers=2)
    assert sorted(i for b in loader for i in b["ids"]) == sorted(data)

    # fp8 with the final state: float32 scales before the int64 ids, at offsets a shard's row
    # count may leave unaligned for them
    fp8 = _write(tmp_path / "stage8", n=20, fp8=True, upload={"upload_uri": uri + "8", "s3_endpoint_url": url})
    S3Location(uri + "8", url).put_file(tmp_path / "stage8" / MANIFEST, MANIFEST)
    assert any(s.num_tokens % 2 for s in Manifest.read(tmp_path / "stage8").shards)
    ds = HiddenStatesDataset(uri + "8", s3_endpoint_url=url)
    for s in ShardedStream(ds):
        assert torch.equal(s["token_ids"], fp8[s["id"]]["token_ids"]) and s["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(s["loss_mask"], fp8[s["id"]]["loss_mask"])
