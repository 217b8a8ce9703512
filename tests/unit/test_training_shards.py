"""Shards with the training tensors: final_hidden_states [R, H] and loss_mask [R] beside
hidden_states and token_ids; the reader, inspect and resume around them; the collators'
padding without an engine."""

from __future__ import annotations

import json

import blake3
import pytest
import torch
from safetensors import safe_open

from tests.outputs import random_sample, shard_writer, write_output
from vllm_hidden.data import DFlashCollator, Eagle3Collator, HiddenStatesDataset, pad_batch
from vllm_hidden.storage.output import Output
from vllm_hidden.storage.verify import verify_output

K, H = 3, 8
LAYERS = [1, 4, 7]


def make(i, n):
    tok, hs, final = random_sample(i, n, K, H, final=True)
    spans = [[1, min(n, 3)], [n - 1, n]] if n > 3 else [[0, n]]
    return tok, hs, final, spans


def write(tmp_path, lengths, rows_per_shard=20, final=True, mask=True):
    data = {f"s{i}": make(i, n) for i, n in enumerate(lengths)}
    samples = {sid: (tok, hs, fin if final else None, spans if mask else None)
               for sid, (tok, hs, fin, spans) in data.items()}
    shards = write_output(tmp_path, LAYERS, H, samples, rows=rows_per_shard, writer_threads=2, final_state=final,
                          loss_mask=mask, manifest={"final_state": "post-norm" if final else "none"})
    return shards, data


def mask_of(spans, n):
    m = torch.zeros(n, dtype=torch.bool)
    for lo, hi in spans:
        m[lo:hi] = True
    return m


def test_shards_hold_the_final_state_and_mask_rows_and_the_reader_returns_them(tmp_path):
    shards, data = write(tmp_path, [5, 9, 2, 14, 30, 1])
    assert len(shards) > 2  # rolled by size, and 30 rows get a shard of their own
    for s in shards:
        raw = (tmp_path / s.file).read_bytes()
        assert len(raw) == s.bytes and blake3.blake3(raw).hexdigest() == s.blake3
        with safe_open(str(tmp_path / s.file), framework="pt") as f:
            r = f.get_slice("hidden_states").get_shape()[0]
            assert f.get_slice("final_hidden_states").get_shape() == [r, H]
            assert f.get_tensor("loss_mask").dtype == torch.uint8 and f.get_slice("loss_mask").get_shape() == [r]
    ds = HiddenStatesDataset(tmp_path)
    got = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    assert set(got) == set(data)
    for sid, (tok, hs, fin, spans) in data.items():
        s = got[sid]
        assert torch.equal(s["token_ids"], tok) and torch.equal(s["hidden_states"], hs)
        assert torch.equal(s["final_hidden_states"], fin)
        assert s["loss_mask"].dtype == torch.bool and torch.equal(s["loss_mask"], mask_of(spans, len(tok)))
    assert verify_output(tmp_path).ok
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert sorted(s["id"] for s in loader) == sorted(data)


def test_without_final_state_or_mask_the_keys_are_absent(tmp_path):
    write(tmp_path, [4, 6], final=False, mask=False)
    s = HiddenStatesDataset(tmp_path)[0]
    assert set(s) == {"id", "token_ids", "hidden_states"}


def test_a_sample_without_its_mask_or_with_a_span_outside_it_is_refused(tmp_path):
    w = shard_writer(tmp_path, LAYERS, H, loss_mask=True)
    tok, hs, _, _ = make(0, 4)
    with pytest.raises(ValueError, match="has no loss mask"):
        w.add("a", tok, hs)
    with pytest.raises(ValueError, match=r"loss span \[2, 5\] is not within its 4 tokens"):
        w.add("b", tok, hs, loss_spans=[[2, 5]])
    with pytest.raises(ValueError, match="final_hidden_states must be given exactly when"):
        w.add("c", tok, hs, final_hidden_states=torch.zeros(4, H, dtype=torch.bfloat16), loss_spans=[[0, 4]])
    w.close()


def test_a_non_finite_final_state_refuses_the_sample(tmp_path):
    w = shard_writer(tmp_path, LAYERS, H, final_state=True, loss_mask=True)
    for i in range(3):
        tok, hs, fin, spans = make(i, 5)
        if i == 1:
            fin[2, 3] = float("nan")
        w.add(f"s{i}", tok, hs, final_hidden_states=fin, loss_spans=spans)
    shards = w.close()
    assert [x[0] for x in w.not_finite] == ["s1"] and "final" in w.not_finite[0][2]
    assert sum(s.num_samples for s in shards) == 2


def test_inspect_names_a_final_state_tensor_of_the_wrong_shape(tmp_path):
    import struct

    shards, _ = write(tmp_path, [4, 4])
    p = tmp_path / shards[0].file
    raw = bytearray(p.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    r = header["final_hidden_states"]["shape"][0]
    header["final_hidden_states"]["shape"] = [r * H // 4, 4]  # same bytes, other shape
    new = json.dumps(header).encode()
    raw[8 : 8 + n] = new + b" " * (n - len(new))
    p.write_bytes(raw)
    probs = verify_output(tmp_path).problems
    assert any(f"final_hidden_states has shape [{r * H // 4}, 4], expected [{r}, {H}]" in x for x in probs), probs


def test_resume_with_another_final_state_or_mask_rule_is_refused(tmp_path):
    ident = {"format": "vllm-hidden/1", "model": "m", "layer_ids": LAYERS, "hidden_size": H,
             "final_state": "post-norm", "loss_mask": "default"}
    Output(str(tmp_path), ident).begin(False)
    Output(str(tmp_path), dict(ident)).begin(True)  # the same settings resume
    with pytest.raises(ValueError, match="final_state='post-norm', this run has final_state='none'"):
        Output(str(tmp_path), {**ident, "final_state": "none"}).begin(True)
    with pytest.raises(ValueError, match="loss_mask='default', this run has loss_mask='none'"):
        Output(str(tmp_path), {**ident, "loss_mask": "none"}).begin(True)


def test_collators_pad_and_select_layers_without_an_engine(tmp_path):
    _, data = write(tmp_path, [5, 9, 2])
    ds = HiddenStatesDataset(tmp_path)
    batch = [ds[i] for i in range(3)]
    d = DFlashCollator(LAYERS, use=[7, 1])(batch)
    assert d["hidden_states"].shape == (3, 9, 2 * H) and d["lengths"].tolist() == [5, 9, 2]
    for b, s in enumerate(batch):
        n = s["token_ids"].shape[0]
        assert torch.equal(d["hidden_states"][b, :n, :H], s["hidden_states"][:, 2])
        assert torch.equal(d["input_ids"][b, :n], s["token_ids"]) and (d["input_ids"][b, n:] == 0).all()
        assert d["attention_mask"][b].tolist() == [True] * n + [False] * (9 - n)
    e = Eagle3Collator(LAYERS)(batch)
    assert e["aux_hidden_state"].shape == (3, 9, 3 * H) and e["hidden_state"].shape == (3, 9, H)
    with pytest.raises(ValueError, match="EAGLE-3 takes 3 layers"):
        Eagle3Collator(LAYERS, use=[1, 4])
    no_final = [{k: v for k, v in s.items() if k != "final_hidden_states"} for s in batch]
    with pytest.raises(ValueError, match="extract with --final-state post-norm"):
        Eagle3Collator(LAYERS)(no_final)
    no_mask = [{k: v for k, v in s.items() if k != "loss_mask"} for s in batch]
    assert DFlashCollator(LAYERS)(no_mask)["loss_mask"][1].all()
    with pytest.raises(ValueError, match="empty batch"):
        pad_batch([])
