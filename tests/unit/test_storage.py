import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from vllm_hidden.config import ShardConfig
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.storage.manifest import Manifest
from vllm_hidden.storage.shards import ShardWriter

K, H = 2, 8


def sample(i, n):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 100, (n,), generator=g), torch.randn(n, K, H, generator=g).to(torch.bfloat16)


def write(tmp_path, lengths, max_shard_bytes):
    w = ShardWriter(ShardConfig(output_dir=str(tmp_path), max_shard_bytes=max_shard_bytes), [3, 5])
    data = {}
    for i, n in enumerate(lengths):
        tok, hs = sample(i, n)
        data[f"id{i}"] = (tok, hs)
        w.add(f"id{i}", tok, hs)
    shards = w.close()
    Manifest(model="m", layer_ids=[3, 5], layer_semantics="s", num_model_layers=8, hidden_size=H,
             dtype="bfloat16", shards=shards).write(tmp_path)
    return shards, data


def test_shards_roll_at_size_limit_and_are_valid_safetensors(tmp_path):
    per_row = K * H * 2 + 8
    shards, data = write(tmp_path, [10, 20, 5, 7, 30, 1], max_shard_bytes=25 * per_row)
    # rolls once a shard reaches 25 rows: [10,20] [5,7,30] [1]
    assert [s.num_samples for s in shards] == [2, 3, 1]
    assert [s.num_tokens for s in shards] == [30, 42, 1]
    for s in shards:
        raw = (tmp_path / s.file).read_bytes()
        assert len(raw) == s.bytes and hashlib.sha256(raw).hexdigest() == s.sha256
    with safe_open(str(tmp_path / shards[1].file), framework="pt") as f:
        index = json.loads(f.metadata()["samples"])
        assert index == [["id2", 0, 5], ["id3", 5, 7], ["id4", 12, 30]]
        hs, tok = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        assert hs.dtype == torch.bfloat16 and tok.dtype == torch.int64
        assert torch.equal(hs[12:42], data["id4"][1]) and torch.equal(tok[5:12], data["id3"][0])
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
