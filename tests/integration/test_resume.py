"""Crash safety: kill -9 a running extract (the whole process group: CLI, engine core and
its writer threads) at two points, then --resume to the end. Every sample must end up in
exactly one shard, none missing, every checksum valid, and the durable work of the killed
attempts kept, not redone."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

from tests.integration.helpers import run_cli, verify_checksums
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.storage.journal import JOURNAL

ENGINE = ["--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]


def _journal_lines(out) -> int:
    p = out / JOURNAL
    return p.read_text().count("\n") if p.is_file() else 0


def _kill_when(cmd, out, lines: int, timeout: float = 600) -> int:
    """Start the CLI in its own process group; SIGKILL the group once the journal has
    `lines` entries. Returns the journal length at the kill."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    p = subprocess.Popen(cmd, start_new_session=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    try:
        while _journal_lines(out) < lines:
            if p.poll() is not None:
                raise AssertionError(f"extract ended (rc {p.returncode}) before the kill point: {p.stderr.read()[-2000:]}")
            if time.monotonic() - t0 > timeout:
                raise AssertionError("no progress before the kill point")
            time.sleep(0.02)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return _journal_lines(out)


def test_kill_9_twice_then_resume_gives_every_sample_exactly_once(tiny_models, tmp_path):
    model = tiny_models("qwen3")
    rng = random.Random(7)
    prompts = {f"p{i}": [rng.randrange(1024) for _ in range(rng.randint(16, 200))] for i in range(400)}
    inp = tmp_path / "in.jsonl"
    with open(inp, "w") as f:
        for sid, ids in prompts.items():
            f.write(json.dumps({"id": sid, "token_ids": ids}) + "\n")
        f.write("not json\n")  # a bad line: recorded again (once) by the resumed run
    out = tmp_path / "out"
    args = ["extract", "--model", str(model), "--input", str(inp), "--output", str(out), "--layers", "0,3",
            "--max-shard-bytes", str(256 * 1024), "--writer-threads", "2", "--no-progress", *ENGINE]
    cmd = [sys.executable, "-m", "vllm_hidden.cli", *args]

    first = _kill_when(cmd, out, 2)
    again = run_cli(*args)  # without --resume a non-empty output is refused, naming --resume
    assert again.returncode == 2 and "pass --resume" in again.stderr
    second = _kill_when([*cmd, "--resume"], out, first + 3)
    assert second > first
    durable = [json.loads(line)["file"] for line in (out / JOURNAL).read_text().split("\n")[:second]]
    kept = {n: (out / n).stat().st_mtime_ns for n in durable}

    done = run_cli(*args, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["resumed"] > 0 and summary["resumed"] + summary["samples"] == len(prompts)
    assert summary["errors"] == 1 and len((out / "errors.jsonl").read_text().splitlines()) == 1

    ds = HiddenStatesDataset(out)
    ids = [ds[i]["id"] for i in range(len(ds))]
    assert sorted(ids) == sorted(prompts)  # every sample, each exactly once
    for i in range(len(ds)):
        s = ds[i]
        assert s["token_ids"].tolist() == prompts[s["id"]] and s["hidden_states"].shape[1] == 2
    verify_checksums(out)
    journaled = [json.loads(line)["file"] for line in (out / JOURNAL).read_text().splitlines()]
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(s["file"] for s in manifest["shards"]) == sorted(journaled)
    # shards made durable before the kills were kept as they were, not rewritten
    assert set(kept) <= set(journaled)
    assert all((out / n).stat().st_mtime_ns == kept[n] for n in kept)
    assert not list(out.glob(".*.tmp"))
    res = run_cli("inspect", str(out))
    assert res.returncode == 0 and "all shards verified" in res.stdout
