"""Crash safety, many times over: a chain of seeded kill -9s of the whole extract (the CLI
with its engine, writer threads) at every kind of point (three spread over the engine start;
one each after one, two and three more shards became durable: mid-step or while a shard is
being finished), each followed by --resume, then one --resume to the end. After every kill
the durable part must verify and stay as it was, and a rerun without --resume is refused;
at the end every sample is there exactly once, equal to its input, and its states match HF.
Also: the engine's worker process dies under a running extract."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import psutil

from tests.integration.helpers import (
    HFReference,
    cli,
    journal,
    journal_lines,
    kill_group,
    last_json,
    random_prompts,
    rel_l2,
    run_cli,
    start_cli,
    verify_checksums,
    warm_fork_server,
    write_prompts,
)
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.storage.verify import verify_output

ENGINE = ["--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]
SEED = 20261201
# (shards that become durable before the kill, seconds after that): 0 shards = before any
# output, at three depths of the start of a run forked with vLLM imported and the engine in
# the run's own process (the input checked; engine config and model load; profiling and warm-up:
# ~1.2, 2.4 and 3.4 s on an idle 2-core machine, later under load); later kills add no new
# kind of point, only time
KILL_POINTS = [(0, (0.0, 1.2)), (0, (1.2, 2.4)), (0, (2.4, 3.4))] + [(g, (0.0, 0.3)) for g in (1, 2)]


def _shard_problems(out) -> list[str]:
    """What `inspect` finds wrong with the durable shards of a stopped run (besides it being
    incomplete): what was durable at a kill must verify; a torn tmp file or journal line is
    not durable."""
    if not (out / "run.json").exists():
        return []  # killed before the output was begun
    report = verify_output(out, threads=2)
    assert not report.complete
    return [p for p in report.problems if not p.startswith("incomplete:")]


def _attempt(args, out, grow, delay, timeout=600) -> dict:
    """One attempt, SIGKILLed (whole process group) after the journal grows by `grow` shards,
    plus `delay` seconds (0 shards: somewhere in the engine start)."""
    before = journal_lines(out)
    p = start_cli(*args, inprocess=True)
    t0 = time.monotonic()
    try:
        while journal_lines(out) < before + grow and p.poll() is None:
            if time.monotonic() - t0 > timeout:
                raise AssertionError("no progress before the kill point")
            time.sleep(0.01)
        end = time.monotonic() + delay
        while time.monotonic() < end and p.poll() is None:
            time.sleep(0.01)
    finally:
        kill_group(p)
    if p.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"attempt failed (rc {p.returncode}): {p.stderr.read()[-3000:]}")
    finished = (out / "manifest.json").exists()  # done before its kill point (the manifest is written last)
    return {"grow": grow, "delay_s": round(delay, 3), "killed_at_s": round(time.monotonic() - t0, 2),
            "shards_before": before, "shards_after": journal_lines(out), "finished_first": finished}


def test_kill_9_at_random_points_then_resume_exactly_once(tiny_models, tmp_path, reliability_report):
    model = tiny_models("qwen3", 4)
    inp = tmp_path / "in.jsonl"
    prompts = write_prompts(inp, random_prompts(200, SEED), ["not json"])  # + one bad line: one error record
    # (~117 shards: the last kill comes after at most a few)
    out = tmp_path / "out"
    args = ["extract", "--model", str(model), "--input", str(inp), "--output", str(out), "--layers", "0,3",
            "--max-shard-bytes", str(256 * 1024), "--writer-threads", "2", "--no-progress", *ENGINE]
    warm_fork_server()  # (the attempts' kill points are timed from their start)
    rng = random.Random(SEED)
    points = [(g, rng.uniform(*span)) for g, span in rng.sample(KILL_POINTS, len(KILL_POINTS))]
    trials, kept, refused = [], {}, False
    for grow, delay in points:
        t = _attempt(args + (["--resume"] if trials or out.exists() else []), out, grow, delay)
        if t["finished_first"]:
            break  # the run ended before its kill point: nothing left to interrupt
        trials.append(t)
        assert _shard_problems(out) == []
        durable = {x["file"]: (out / x["file"]).stat().st_mtime_ns for x in journal(out)}
        assert all(durable.get(f) == m for f, m in kept.items())  # what was durable stays, untouched
        kept = durable
        if not refused and (out / "run.json").exists():  # without --resume, a begun output is refused
            again = run_cli(*args)
            assert again.returncode == 2 and "pass --resume" in again.stderr, again.stderr[-3000:]
            refused = True
    assert len(trials) == len(points), f"the run finished after {len(trials)} kills; give it more work"
    assert not (out / "manifest.json").exists() and refused

    done = run_cli(*args, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = last_json(done)
    assert summary["resumed"] + summary["samples"] == len(prompts) and summary["errors"] == 1, summary
    assert len((out / "errors.jsonl").read_text().splitlines()) == 1

    ds = HiddenStatesDataset(out)
    ids = [ds[i]["id"] for i in range(len(ds))]
    lost, dup = set(prompts) - set(ids), len(ids) - len(set(ids))
    assert not lost and not dup and set(ids) == set(prompts), (sorted(lost)[:5], dup)
    for i in range(len(ds)):
        s = ds[i]
        assert s["token_ids"].tolist() == prompts[s["id"]]
    verify_checksums(out)
    journaled = [x["file"] for x in journal(out)]
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(s["file"] for s in manifest["shards"]) == sorted(journaled)
    assert not list(out.glob(".*.tmp"))
    assert all((out / f).stat().st_mtime_ns == m for f, m in kept.items())  # durable shards kept, not redone
    res = cli("inspect", str(out))
    assert res.returncode == 0 and "all shards verified" in res.stdout, res.stdout + res.stderr
    ref = HFReference(model)  # states written across different attempts are the model's
    worst = 0.0
    for i in rng.sample(range(len(ds)), 12):
        s = ds[i]
        st = ref.states(prompts[s["id"]])
        worst = max(worst, *(rel_l2(s["hidden_states"][:, k], st[layer]) for k, layer in enumerate([0, 3])))
    assert worst < 1e-2, worst
    reliability_report["kill_9"] = {
        "seed": SEED, "trials": len(trials), "samples": len(prompts),
        "killed_in_engine_start": sum(t["shards_after"] == t["shards_before"] for t in trials),
        "kills_with_new_shards": sum(t["shards_after"] > t["shards_before"] for t in trials),
        "shards_durable_before_final_resume": trials[-1]["shards_after"], "shards_total": len(journaled),
        "samples_lost": len(lost), "duplicates": dup, "hf_worst_rel_l2_sampled": round(worst, 5),
        "kill_points": trials}


def _engine_core(pid):
    """The vLLM engine-core process under the CLI (where the model and the capture run)."""
    for c in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in c.name() or any("EngineCore" in a for a in c.cmdline()):
                return c
        except psutil.Error:
            pass
    return None


def _group(pgid):
    out = []
    for q in psutil.process_iter():
        try:
            if os.getpgid(q.pid) == pgid and q.status() != psutil.STATUS_ZOMBIE:
                out.append(q)
        except (psutil.Error, ProcessLookupError):
            pass
    return out


def test_engine_worker_killed_mid_run_fails_clearly_then_resumes(tiny_models, tmp_path, reliability_report):
    model = tiny_models("qwen3", 4)
    inp = tmp_path / "in.jsonl"
    prompts = write_prompts(inp, random_prompts(200, SEED + 1), ["not json"])
    out = tmp_path / "out"
    args = ["extract", "--model", str(model), "--input", str(inp), "--output", str(out), "--layers", "0,3",
            "--max-shard-bytes", str(256 * 1024), "--writer-threads", "2", "--no-progress", *ENGINE]
    p = start_cli(*args, stdout=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        while journal_lines(out) < 2:
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.monotonic() - t0 < 600, "no progress"
            time.sleep(0.05)
        core = _engine_core(p.pid)
        assert core is not None, [c.cmdline() for c in psutil.Process(p.pid).children(recursive=True)]
        core.kill()
        t_kill = time.monotonic()
        _, err = p.communicate(timeout=120)  # the CLI notices and stops; it does not hang
        noticed = time.monotonic() - t_kill
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 2, err[-3000:]
    last = next(line for line in err.splitlines() if line.startswith("error: "))
    assert "engine process died" in last and "--resume" in last, last
    assert not (out / "manifest.json").exists()
    left = _group(p.pid)  # no orphans: the engine's worker processes went with it
    deadline = time.monotonic() + 30
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _group(p.pid)
    assert not left, [(q.pid, q.name()) for q in left]
    assert _shard_problems(out) == []

    done = run_cli(*args, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = last_json(done)
    ds = HiddenStatesDataset(out)
    ids = [ds[i]["id"] for i in range(len(ds))]
    assert sorted(ids) == sorted(prompts) and summary["resumed"] > 0, summary
    reliability_report["engine_worker_killed"] = {
        "samples": len(prompts), "resumed": summary["resumed"], "cli_stopped_after_s": round(noticed, 1),
        "exit_code": p.returncode, "message": last, "samples_lost": len(set(prompts) - set(ids)),
        "duplicates": len(ids) - len(set(ids))}
