"""Training-ready output from the real engine: conversations in (messages, role/content and
ShareGPT conversations, tools), loss masks and the final normed state out, the same records
as Parquet giving the same shards, and the hand-off to trainers (collators, speculators
export). One engine serves both inputs (the library API, as the CLI drives it)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import chat_model
from tests.integration.helpers import HFReference, cli_env, rel_l2, run_cli, verify_checksums
from vllm_hidden.data import DFlashCollator, Eagle3Collator, HiddenStatesDataset

LAYERS = [1, 3, 7]  # of 8; the last one (before the final norm) for speculators' last slot
BOUND = 1e-2
DRIVER = textwrap.dedent("""
    import json, sys
    from vllm_hidden.config import ExtractConfig
    from vllm_hidden.extract.job import extract_file, start_extractor

    if __name__ == "__main__":
        model, runs = sys.argv[1], json.loads(sys.argv[2])
        cfg = ExtractConfig(model=model, input_path=runs[0][0], output_dir=runs[0][1], layers="1,3,7",
                            final_state="post-norm", max_model_len=512, max_num_batched_tokens=64, dtype="bfloat16",
                            engine_args=["--enforce-eager"], progress=False, max_shard_bytes=200_000)
        with start_extractor(cfg) as ex:
            for inp, out in runs:
                print(json.dumps(extract_file(ex, inp, out).to_dict()), flush=True)
""")


def records():
    """Conversations of every kind, token_ids with and without a mask, text, and bad records."""
    recs = chat_model.conversations(30, seed=1)
    recs += [{"id": "ids-mask", "token_ids": [30, 31, 32, 33, 34], "loss_mask": [0, 0, 1, 1, 0]},
             {"id": "ids", "token_ids": [40, 41, 42]},
             {"id": "text", "text": "a b c d e"}]
    recs.insert(5, {"id": "bad-role", "messages": [{"role": "robot", "content": "a"}]})
    recs.insert(17, {"id": "bad-mask", "token_ids": [1, 2, 3], "loss_mask": [1]})
    recs.insert(22, {"id": "no-assistant", "conversations": [{"from": "human", "value": "a b"}]})
    return recs


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("training")
    model = chat_model.chat_model(tiny_models("qwen3_next"), root / "chat-model")
    recs = records()
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    keys = sorted({k for r in recs for k in r})
    pq.write_table(pa.table({k: [r.get(k) for r in recs] for k in keys}), root / "in.parquet", row_group_size=8)
    assert pq.ParquetFile(str(root / "in.parquet")).num_row_groups == 5
    runs = [[str(root / "in.jsonl"), str(root / "out-jsonl")], [str(root / "in.parquet"), str(root / "out-parquet")]]
    r = subprocess.run([sys.executable, "-c", DRIVER, str(model), json.dumps(runs)], capture_output=True, text=True,
                       timeout=900, env=cli_env())
    assert r.returncode == 0, r.stderr[-4000:]
    summaries = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return model, root, recs, summaries


def test_masks_tokens_states_and_final_state_match_hf_and_the_independent_masks(run):
    from transformers import AutoTokenizer

    model, root, recs, summaries = run
    out = root / "out-jsonl"
    verify_checksums(out)
    assert summaries[0]["errors"] == 3 and summaries[0]["samples"] == len(recs) - 3
    errors = {json.loads(x)["id"]: json.loads(x)["reason"] for x in (out / "errors.jsonl").read_text().splitlines()}
    assert "unknown role 'robot'" in errors["bad-role"] and "no assistant turn" in errors["no-assistant"]
    assert "loss_mask has 1 values for 3 token_ids" in errors["bad-mask"]
    tok = AutoTokenizer.from_pretrained(str(model))
    ds = HiddenStatesDataset(out)
    ref = HFReference(model)
    by_id = {r["id"]: r for r in recs}
    seen = 0
    for i in range(len(ds)):
        s = ds[i]
        rec = by_id[s["id"]]
        if "token_ids" in rec:
            ids, mask = rec["token_ids"], rec.get("loss_mask", [1] * len(rec["token_ids"]))
        elif "text" in rec:
            ids = tok(rec["text"])["input_ids"]
            mask = [1] * len(ids)
        else:
            ids, mask = chat_model.expected(tok, chat_model.messages_of(rec), rec.get("tools"))
        assert s["token_ids"].tolist() == ids, s["id"]
        assert s["loss_mask"].dtype == torch.bool and s["loss_mask"].int().tolist() == mask, s["id"]
        states = ref.states(ids)
        for k, lid in enumerate(LAYERS):
            assert rel_l2(s["hidden_states"][:, k], states[lid]) <= BOUND, (s["id"], lid)
        final = s["final_hidden_states"]
        assert final.shape == (len(ids), 256) and final.dtype == torch.bfloat16
        assert rel_l2(final, ref.post_norm) <= BOUND, s["id"]
        # the check can fail: the last layer before the norm is far from the state after it
        assert rel_l2(final, states[7]) > 5 * BOUND, s["id"]
        seen += 1
    assert seen == len(recs) - 3
    man = json.loads((out / "manifest.json").read_text())
    assert man["final_state"] == "post-norm"
    inp = man["input"]
    assert inp["format"] == "jsonl" and inp["loss_mask"] == "default"
    kinds = [next(k for k in ("token_ids", "text", "messages", "conversations") if k in r) for r in recs]
    assert inp["kinds"] == {k: kinds.count(k) for k in set(kinds)} and len(set(kinds)) == 4
    assert inp["chat_template_sha256"] == hashlib.sha256(chat_model.TEMPLATE.encode()).hexdigest()
    assert set(inp["special_tokens"]) == {"chat", "text", "token_ids"}


def test_parquet_input_gives_the_same_shard_contents_as_jsonl(run):
    _, root, recs, summaries = run
    assert summaries[1]["samples"] == summaries[0]["samples"] and summaries[1]["errors"] == 3
    a, b = HiddenStatesDataset(root / "out-jsonl"), HiddenStatesDataset(root / "out-parquet")
    assert b.manifest.input["format"] == "parquet"
    rows = {a[i]["id"]: a[i] for i in range(len(a))}
    assert len(b) == len(a) and {b[i]["id"] for i in range(len(b))} == set(rows)
    for i in range(len(b)):
        s = b[i]
        t = rows[s["id"]]
        assert torch.equal(s["token_ids"], t["token_ids"]) and torch.equal(s["loss_mask"], t["loss_mask"])
        # the same engine, but batches may be composed differently: states within the parity bound
        assert rel_l2(s["hidden_states"], t["hidden_states"]) <= BOUND
        assert rel_l2(s["final_hidden_states"], t["final_hidden_states"]) <= BOUND


def test_collators_give_the_dflash_and_eagle3_shapes(run):
    _, root, _, _ = run
    ds = HiddenStatesDataset(root / "out-jsonl")
    batch = [ds[i] for i in range(4)]
    t = max(s["token_ids"].shape[0] for s in batch)
    d = DFlashCollator(ds.layer_ids)(batch)
    assert d["hidden_states"].shape == (4, t, 3 * 256) and d["input_ids"].shape == d["loss_mask"].shape == (4, t)
    e = Eagle3Collator(ds.layer_ids)(batch)
    assert e["aux_hidden_state"].shape == (4, t, 3 * 256) and e["hidden_state"].shape == (4, t, 256)
    for b, s in enumerate(batch):
        n = s["token_ids"].shape[0]
        assert int(d["lengths"][b]) == n and d["attention_mask"][b].sum() == n
        assert torch.equal(d["hidden_states"][b, :n], s["hidden_states"].reshape(n, -1))
        assert torch.equal(d["hidden_states"][b, :n, 256:512], s["hidden_states"][:, 1])  # layer 3, in order
        assert torch.equal(e["hidden_state"][b, :n], s["final_hidden_states"])
        assert torch.equal(e["loss_mask"][b, :n], s["loss_mask"]) and not e["loss_mask"][b, n:].any()
    two = DFlashCollator(ds.layer_ids, use=[7, 1])(batch)
    assert torch.equal(two["hidden_states"][0, :, :256], d["hidden_states"][0, :, 512:])
    with pytest.raises(ValueError, match="layer id 5 is not in the output"):
        DFlashCollator(ds.layer_ids, use=[5])


def test_speculators_export_reads_back_as_its_loader_does(run):
    import datasets
    from safetensors.torch import load_file

    _, root, _, _ = run
    dest = root / "speculators"
    r = run_cli("export", str(root / "out-jsonl"), "--to", "speculators", str(dest), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    ds = HiddenStatesDataset(root / "out-jsonl")
    table = datasets.load_from_disk(str(dest))
    assert len(table) == len(ds) and set(table.column_names) >= {"input_ids", "loss_mask", "seq_len"}
    for i in range(len(ds)):
        s, row = ds[i], table[i]
        hs = load_file(str(dest / "hidden_states" / f"hs_{i}.safetensors"))
        # what speculators' ArrowDataset checks and takes (train/data.py, data_generation/offline.py)
        assert torch.equal(hs["token_ids"], row["input_ids"]) and len(row["input_ids"]) == hs["hidden_states"].shape[0]
        assert row["seq_len"] == len(row["input_ids"]) == len(row["loss_mask"])
        assert torch.equal(row["loss_mask"], s["loss_mask"].long())
        assert (hs["hidden_states"].shape == (len(row["input_ids"]), 3, 256)
                and torch.isfinite(hs["hidden_states"]).all())
        assert torch.equal(hs["hidden_states"][:, :-1].flatten(1), s["hidden_states"][:, :2].flatten(1))
        assert torch.equal(hs["hidden_states"][:, -1], s["hidden_states"][:, 2])  # layer 7, before the norm
    assert not list(root.glob(".speculators-export-*"))  # its scratch table is gone
    bad = run_cli("export", str(root / "out-jsonl"), "--to", "speculators", str(root / "spec2"), "--layers", "1,3",
                  "--no-progress")
    assert bad.returncode == 2 and "the last exported layer is 3" in bad.stderr and "layer id 7" in bad.stderr
