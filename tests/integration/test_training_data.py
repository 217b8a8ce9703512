"""Training-ready output from the real engine: conversations in (messages, role/content and
ShareGPT conversations, tools), loss masks and the final normed state out, the same records
as Parquet giving the same shards, and the hand-off to trainers: the collators, and each
export loaded by the trainer's OWN code (SpecForge 0.2.0's offline reader, normalizers and
collators; speculators 0.9.0's ArrowDataset, CollateFn and vocab mapping), every value
compared with HiddenStatesDataset and the layer each trainer believes it holds checked
against HF. The layers come from a speculators EAGLE-3 drafter config (--layers-from),
checked by parity (a SpecForge/SGLang config's are in test_warmup.py, a DFlash config's in
test_truncate.py). One engine serves both inputs (the library API, as the CLI drives it)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import chat_model
from tests.integration.helpers import HFReference, cli, cli_env, rel_l2, verify_checksums
from vllm_hidden.data import DFlashCollator, Eagle3Collator, HiddenStatesDataset

LAYERS = [1, 3, 7]  # of 8; the last one (before the final norm) for speculators' last slot
BOUND = 1e-2
# speculators' EAGLE-3 config names vLLM aux ids without the final layer: [2, 4] = layer ids 1, 3 (+ 7)
SPECULATORS_CONFIG = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                      "speculators_config": {"algorithm": "eagle3"}, "eagle_aux_hidden_state_layer_ids": [2, 4]}
DRIVER = textwrap.dedent("""
    import json, sys
    from vllm_hidden.config import ExtractConfig
    from vllm_hidden.extract.job import extract_file, start_extractor

    if __name__ == "__main__":
        model, runs = sys.argv[1], json.loads(sys.argv[2])
        cfg = ExtractConfig(model=model, input_path=runs[0][0], output_dir=runs[0][1], layers_from=runs[0][2],
                            final_state="post-norm", max_model_len=512, max_num_batched_tokens=64, dtype="bfloat16",
                            engine_args=["--enforce-eager"], progress=False, max_shard_bytes=200_000)
        with start_extractor(cfg) as ex:
            for inp, out, _ in runs:
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
    (root / "speculators.json").write_text(json.dumps(SPECULATORS_CONFIG))
    runs = [[str(root / p) for p in (i, o, "speculators.json")]
            for i, o in (("in.jsonl", "out-jsonl"), ("in.parquet", "out-parquet"))]
    r = subprocess.run([sys.executable, "-c", DRIVER, str(model), json.dumps(runs)], capture_output=True, text=True,
                       timeout=900, env=cli_env(inprocess=True))
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
    assert man["final_state"] == "post-norm" and man["layer_ids"] == LAYERS
    src = man["layer_source"]
    assert src["option"] == "--layers-from" and src["kind"] == "speculators-eagle3" and src["config_ids"] == [2, 4]
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


def _export(root, kind, dest, *args):
    r = cli("export", str(root / "out-jsonl"), "--to", kind, str(dest), "--no-progress", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((dest / "export.json").read_text()), r.stderr


def _specforge_features(strategy, dest):
    """Every sample of a SpecForge export as SpecForge's offline training gets it: its reader
    (OfflineManifestReader via the strategy's build_offline_reader), the feature store that
    loads the files, and the strategy's normalizer; keyed by our sample index (from the file)."""
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    if strategy == "eagle3":
        from specforge.algorithms.eagle3 import data as sf

        reader = sf.build_offline_reader(str(dest), run_id="t", ttt_length=7, max_len=4096)
        normalize, collate = sf.build_offline_normalizer(4096), sf.build_offline_collator()
    else:
        from specforge.algorithms.common import dflash_family_data as sf

        reader = sf.build_offline_reader("dflash", str(dest), run_id="t", ttt_length=1, max_len=4096)
        normalize, collate = sf.build_offline_normalizer(4096), sf.build_collator()
    store, feats = LocalFeatureStore(), {}
    for ref in reader.read():
        tensors, handle = store.get(ref)
        feats[int(ref.feature_store_uri.rsplit("data_", 1)[1].removesuffix(".ckpt"))] = normalize(tensors)
        store.release(handle)
    return feats, collate


@pytest.fixture(scope="module")
def eagle3_export(run):
    _, root, _, _ = run
    return _export(root, "specforge-eagle3", root / "sf-eagle3")


def test_specforge_eagle3_export_trains_in_specforge_as_written(run, eagle3_export):
    model, root, _, _ = run
    rec, err = eagle3_export
    ids = rec["settings"]["run_config"]["model.aux_hidden_state_layer_ids"]
    assert ids == LAYERS and "specforge train --config" in err and "aux_hidden_state_layer_ids: [1, 3, 7]" in err
    ds = HiddenStatesDataset(root / "out-jsonl")
    feats, collate = _specforge_features("eagle3", root / "sf-eagle3")
    assert sorted(feats) == list(range(len(ds)))
    ref = HFReference(model)
    for i, f in feats.items():
        s = ds[i]
        t = s["token_ids"].shape[0]
        mask = s["loss_mask"].long()
        mask[-1] = 0  # SpecForge drops the last position's loss itself
        assert torch.equal(f["input_ids"][0], s["token_ids"]) and torch.equal(f["loss_mask"][0], mask)
        assert torch.equal(f["hidden_state"][0], s["hidden_states"].reshape(t, -1))
        assert torch.equal(f["target"][0], s["final_hidden_states"])
        if i < 4:  # what SpecForge believes: its id j is the output of layer j; target after the final norm
            states = ref.states(s["token_ids"].tolist())
            for k, j in enumerate(ids):
                assert rel_l2(f["hidden_state"][0, :, k * 256:(k + 1) * 256], states[j]) <= BOUND, (i, j)
            assert rel_l2(f["target"][0], ref.post_norm) <= BOUND, i
    batch = collate([feats[i] for i in range(4)])
    t = max(ds[i]["token_ids"].shape[0] for i in range(4))
    assert batch["hidden_state"].shape == (4, t, 3 * 256) and batch["target"].shape == (4, t, 256)


def test_specforge_dflash_export_trains_in_specforge_as_written(run):
    from specforge.modeling.draft.dflash import extract_context_feature

    model, root, _, _ = run
    rec, err = _export(root, "specforge-dflash", root / "sf-dflash", "--layers", "3,1")
    ids = rec["settings"]["draft_config"]["dflash_config.target_layer_ids"]
    assert ids == [3, 1] and "dflash_config.target_layer_ids: [3, 1]" in err
    ds = HiddenStatesDataset(root / "out-jsonl")
    feats, collate = _specforge_features("dflash", root / "sf-dflash")
    skipped = set(rec["skipped"]["ids"]) if rec["skipped"] else set()
    assert len(feats) + len(skipped) == len(ds) == rec["exported_samples"] + len(skipped)
    ref = HFReference(model)
    for i, f in feats.items():
        s = ds[i]
        assert s["id"] not in skipped
        assert torch.equal(f["input_ids"][0], s["token_ids"]) and torch.equal(f["loss_mask"][0], s["loss_mask"].long())
        assert torch.equal(f["hidden_states"][0], s["hidden_states"][:, [1, 0]].flatten(1))
        if i < 4:  # DFlash's own selection (SpecForge's extract_context_feature) over HF's hidden states
            r = ref.model(s["token_ids"][None], output_hidden_states=True)
            want = extract_context_feature(list(r.hidden_states), ids)[0]
            assert rel_l2(f["hidden_states"][0], want) <= BOUND, i
    batch = collate([feats[i] for i in list(feats)[:3]])
    assert batch["hidden_states"].shape[-1] == 2 * 256


@pytest.fixture(scope="module")
def speculators_export(run):
    _, root, _, _ = run
    return (root / "speculators", *_export(root, "speculators", root / "speculators"))


def test_speculators_export_trains_in_speculators_as_written(run, speculators_export):
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    model, root, _, _ = run
    dest, rec, err = speculators_export
    assert rec["target_layer_ids"] == [2, 4] and "--target-layer-ids 2 4" in err  # vLLM aux ids of layers 1, 3
    ds = HiddenStatesDataset(root / "out-jsonl")
    data = ArrowDataset(4096, str(dest), on_missing="raise")  # raise: never ask a vLLM server for states
    assert len(data) == len(ds)
    ref, freq = HFReference(model), {}
    for i in range(len(ds)):
        s, row = ds[i], data[i]
        assert isinstance(row, dict), row  # not SampleUnavailable: token ids matched, dtype included
        assert torch.equal(row["input_ids"], s["token_ids"]) and torch.equal(row["loss_mask"], s["loss_mask"].long())
        assert torch.equal(row["hidden_states"], s["hidden_states"][:, :2].flatten(1))
        assert torch.equal(row["verifier_last_hidden_states"], s["hidden_states"][:, 2])
        for t in s["token_ids"][s["loss_mask"]].tolist():
            freq[t] = freq.get(t, 0) + 1
        if i < 4:  # what speculators believes: aux id j = input of layer j (HF hidden_states[j]);
            # the last slot = the final layer before the norm (speculators applies it)
            r = ref.model(s["token_ids"][None], output_hidden_states=True)
            ref.states(s["token_ids"].tolist())
            for k, j in enumerate(rec["target_layer_ids"]):
                assert rel_l2(row["hidden_states"][:, k * 256:(k + 1) * 256], r.hidden_states[j][0]) <= BOUND
            assert rel_l2(row["verifier_last_hidden_states"], ref._last[0]) <= BOUND
    batch = CollateFn(512, 256, num_target_layers=2)([data[i] for i in range(4)])
    assert batch["hidden_states"].shape == (1, 512, 512) and batch["verifier_last_hidden_states"].shape == (1, 512, 256)
    token_freq = torch.load(dest / "token_freq.pt", weights_only=True)  # as speculators' train/cli.py reads it
    assert token_freq == freq
    vocab = ref.model.config.vocab_size
    d2t, t2d = build_vocab_mappings_from_distribution(token_freq, draft_vocab_size=64, target_vocab_size=vocab)
    top = sorted(freq, key=lambda t: (-freq[t], t))[:64]
    assert set((d2t + torch.arange(64)).tolist()) >= set(top[: min(64, len(top))]) and t2d.sum() == 64
    bad = cli("export", str(root / "out-jsonl"), "--to", "speculators", str(root / "spec2"), "--layers", "1,3",
                  "--no-progress")
    assert bad.returncode == 2 and "the last exported layer is 3: pass --layers 1,3,7" in bad.stderr


def test_one_step_of_speculators_own_eagle3_drafter_on_the_export(run, speculators_export):
    """speculators' trainer needs a GPU (it moves the model to cuda:0); its pieces run on CPU:
    its config resolution with the flags the export printed, its vocab mapping from our
    token_freq.pt, its drafter, its dataset, collate and shift, its loss (eager, not the
    Triton one) and one optimizer step: the loss is finite and every trainable weight moves."""
    import argparse

    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import cli as train_cli
    from speculators.train.config import TrainConfig
    from speculators.train.config.resolution import resolve
    from speculators.train.data import ArrowDataset, CollateFn

    model, _, _, _ = run
    dest, rec, _ = speculators_export
    flags = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(model), "--data-path", str(dest),
             "--target-layer-ids", *map(str, rec["target_layer_ids"]), "--on-missing", "raise",
             "--draft-vocab-size", "64", "--total-seq-len", "256", "--draft-attn-impl", "sdpa",
             "--loss-implementation", "eager"]
    args = argparse.Namespace(**resolve(TrainConfig, flags).flatten())
    d2t, t2d, vocab = train_cli.parse_vocab_mappings(args)  # from dest/token_freq.pt
    assert vocab == 64 and (dest / "d2t-64.npy").is_file()
    cls = SpeculatorModel.registry["eagle3"]
    draft = train_cli.build_draft_model(args, cls, t2d, d2t, vocab)
    assert draft.target_layer_ids == rec["target_layer_ids"]
    data = ArrowDataset(256, str(dest), on_missing="raise")
    collate = CollateFn(256, 256, num_target_layers=len(draft.target_layer_ids), dtype=torch.float32,
                        preprocess=shift_batch)
    batch = {k: v for k, v in collate([data[i] for i in range(4)]).items() if k != "error_records"}
    kwargs, _ = cls.get_trainer_kwargs(**vars(args))
    trainable = {n: p for n, p in draft.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-3)
    draft.train()
    _, loss, _ = draft(**batch, **kwargs)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and loss.item() > 0
    assert all(not torch.equal(before[n], p) for n, p in trainable.items())

    # The caveat docs/train-a-drafter.md states: speculators 0.9.0's EAGLE-3 re-norms the last slot
    # with its draft's norm, x*w, while this verifier (Qwen3-Next, like Qwen3.5/3.6) computes
    # x*(1+w). Our slot is right (the verifier's own form gives HF's normed state); the targets
    # speculators builds from it are not. When this fails, speculators has fixed it: update the docs.
    ref = HFReference(model)
    s = HiddenStatesDataset(run[1] / "out-jsonl")[0]
    ref.states(s["token_ids"].tolist())
    last = data[0]["verifier_last_hidden_states"].float()
    w = draft.verifier_norm.weight.detach().float()
    assert torch.equal(w, ref.model.model.norm.weight.detach().float())  # the verifier's weight, loaded
    unit = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + ref.model.config.rms_norm_eps)
    assert rel_l2(unit * (1 + w), ref.post_norm) <= BOUND
    with torch.no_grad():
        assert rel_l2(draft.verifier_norm.float()(last), ref.post_norm) > 0.5


def test_one_step_of_specforge_own_eagle3_drafter_on_the_export(run, eagle3_export, tmp_path, monkeypatch):
    """SpecForge's EAGLE-3 loss is a Triton kernel (GPU only); everything else runs on CPU: its
    offline reader and normalizer over our export, its draft config generated from the
    target, its vocab mapping built from our files (generate_vocab_mapping_file), its model
    bundle (draft, EAGLE-3 TTT model, the frozen target head re-projecting our final state),
    its EAGLE-3 strategy's loss and one optimizer step. Stubbed: only the Triton loss,
    replaced by SpecForge's own reference implementation of it (core/loss.py _compute_loss)."""
    import specforge.algorithms.eagle3.model as eagle3_model
    from safetensors import safe_open
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.config import Config
    from specforge.core import loss as sf_loss
    from specforge.data.preprocessing import generate_vocab_mapping_file
    from specforge.runtime.contracts import TrainBatch
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.training.assembly import build_model_bundle
    from specforge.training.model_loading import resolve_draft_config
    from specforge.training.strategies.base import Eagle3TrainStrategy

    model, root, _, _ = run
    dest = root / "sf-eagle3"
    # SpecForge's target head reads a sharded checkpoint's index: the same weights, with one
    target = tmp_path / "target"
    target.mkdir()
    for f in model.iterdir():
        (target / f.name).symlink_to(f)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    feats, collate = _specforge_features("eagle3", dest)
    run_cfg = {"model": {"target_model_path": str(target), "aux_hidden_state_layer_ids":
                         eagle3_export[0]["settings"]["run_config"]["model.aux_hidden_state_layer_ids"]},
               "data": {"hidden_states_path": str(dest)},
               "training": {"strategy": "eagle3", "attention_backend": "sdpa", "ttt_length": 2}}
    algorithm = builtin_algorithm_registry().resolve("eagle3")
    draft = resolve_draft_config(Config.model_validate(run_cfg), provider=algorithm.providers.model.draft_config)
    draft.draft_vocab_size = 64
    draft.to_json_file(str(tmp_path / "draft.json"))
    files = sorted(dest.rglob("*.ckpt"))
    raw = [load_feature_file(str(f)) for f in files]
    mapping = generate_vocab_mapping_file({"input_ids": [r["input_ids"] for r in raw],
                                           "loss_mask": [r["loss_mask"] for r in raw]},
                                          target_vocab_size=draft.vocab_size, draft_vocab_size=64,
                                          cache_dir=str(tmp_path))
    run_cfg["model"].update(draft_model_config=str(tmp_path / "draft.json"), vocab_mapping_path=mapping)
    bundle = build_model_bundle(Config.model_validate(run_cfg), algorithm=algorithm)
    strategy = Eagle3TrainStrategy(bundle.model, target_head=bundle.target_head)
    reference = sf_loss._compute_loss._torchdynamo_orig_callable  # the function under its torch.compile
    monkeypatch.setattr(eagle3_model, "LogSoftmaxLoss", type("LogSoftmaxLoss", (), {"apply": staticmethod(reference)}))
    batch = collate([feats[i] for i in range(8)])
    assert batch["loss_mask"].sum() > 0
    trainable = {n: p for n, p in strategy.trainable_module().named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)  # bf16 weights: a step 1e-3 would round away
    out = strategy.forward_loss(TrainBatch(sample_ids=[str(i) for i in range(8)], strategy="eagle3",
                                           tensors=dict(batch), metadata={"target_repr": "hidden_state"}))
    out.loss.backward()
    opt.step()
    assert torch.isfinite(out.loss) and out.loss.item() > 0
    assert all(not torch.equal(before[n], p) for n, p in trainable.items()), \
        [n for n, p in trainable.items() if torch.equal(before[n], p)]
