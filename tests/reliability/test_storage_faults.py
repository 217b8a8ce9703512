"""Storage failures under a running extract: the disk fills up, the S3 endpoint answers 5xx
in bursts, restarts, or goes away for longer than the retries last; and shards damaged at
rest (truncated, a flipped bit) are found by `inspect` and refused by the reader, named.
Each run that fails says what failed and keeps what was durable; --resume finishes with
every sample exactly once."""

from __future__ import annotations

import os
import random
import resource
import subprocess
import threading
import time

import torch

from tests.damage import flip_bit
from tests.integration.helpers import (
    cli,
    journal_lines,
    last_json,
    random_prompts,
    run_cli,
    start_cli,
    verify_checksums,
    write_prompts,
)
from tests.outputs import random_sample, write_manifest, write_output
from tests.s3_server import FaultyProxy
from vllm_hidden.data import HiddenStatesDataset

ENGINE = ["--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]


def _ids(ds):
    ids = [ds[i]["id"] for i in range(len(ds))]
    return ids, len(ids) - len(set(ids))


class SmallDisk:
    """A 2 MiB file system: a tmpfs mount (as root), else a per-process file-size limit
    (RLIMIT_FSIZE: writes past it fail with EFBIG, the same path as ENOSPC)."""

    def __init__(self, path, size_mb=2):
        self.path = path
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                           capture_output=True, text=True)
        self.mounted = r.returncode == 0
        self.limit = size_mb << 20

    def preexec(self):
        if not self.mounted:
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.limit))

    def grow(self, size_mb):
        if self.mounted:
            subprocess.run(["mount", "-o", f"remount,size={size_mb}m", str(self.path)], check=True)
        self.limit = size_mb << 20

    def close(self):
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def test_disk_full_mid_run_stops_naming_it_then_resume_finishes(tiny_models, tmp_path, reliability_report):
    model = tiny_models("qwen3", 4)
    prompts = write_prompts(tmp_path / "in.jsonl", random_prompts(160, 11))  # ~17 MB of shards, 8 times the disk
    disk = SmallDisk(tmp_path / "disk")
    try:
        out = disk.path / "out"
        args = ["extract", "--model", str(model), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                "--layers", "0,3", "--max-shard-bytes", str(512 * 1024), "--writer-threads", "2", "--no-progress",
                *ENGINE]
        r = run_cli(*args, preexec_fn=disk.preexec)
        assert r.returncode == 2, r.stderr[-3000:]
        msg = next(line for line in r.stderr.splitlines() if line.startswith("error: "))
        assert str(out) in msg and ("No space left on device" in msg or "File too large" in msg), msg
        assert not (out / "manifest.json").exists()
        durable = journal_lines(out)
        assert durable >= 1 and not list(out.glob(".*.tmp"))  # a failed shard's temporary file is removed

        disk.grow(64)
        done = run_cli(*args, "--resume")
        assert done.returncode == 0, done.stderr[-3000:]
        summary = last_json(done)
        assert summary["resumed"] > 0 and summary["resumed"] + summary["samples"] == len(prompts)
        ids, dup = _ids(HiddenStatesDataset(out))
        assert sorted(ids) == sorted(prompts) and dup == 0
        verify_checksums(out)
        reliability_report["disk_full"] = {
            "how": "tmpfs 2 MiB" if disk.mounted else "RLIMIT_FSIZE 2 MiB", "error": msg[:300],
            "durable_shards_kept": durable, "samples": len(prompts), "resumed": summary["resumed"],
            "samples_lost": len(set(prompts) - set(ids)), "duplicates": dup}
    finally:
        disk.close()


class Outage:
    """A FaultyProxy in front of moto that can go away and come back on the same port (an
    endpoint restart, as a client sees it) and answer 503 to every request for a while."""

    def __init__(self, upstream_port):
        self.storm_until = 0.0
        self.upstream = upstream_port
        self.proxy = FaultyProxy(upstream_port, self._rule)
        self.port = self.proxy.server.server_address[1]
        self.url = self.proxy.url
        self.injected = 0
        self.restarts = 0

    def _rule(self, method, path, n):
        if time.monotonic() < self.storm_until:
            self.injected += 1
            return ("status", 503)
        return None

    def storm(self, seconds):
        self.storm_until = time.monotonic() + seconds

    def down(self):
        self.proxy.stop()

    def up(self):
        self.proxy = FaultyProxy(self.upstream, self._rule, port=self.port)
        self.restarts += 1


def test_s3_5xx_storms_restarts_and_an_outage_then_resume(tiny_models, s3, tmp_path, reliability_report):
    url, bucket, client = s3
    model = tiny_models("qwen3", 4)
    prompts = write_prompts(tmp_path / "in.jsonl", random_prompts(240, 12))
    outage = Outage(int(url.rsplit(":", 1)[1]))
    uri = f"s3://{bucket}/run"
    args = ["extract", "--model", str(model), "--input", str(tmp_path / "in.jsonl"), "--output", uri,
            "--s3-endpoint-url", outage.url, "--staging-dir", str(tmp_path / "stage"), "--layers", "0,3",
            "--max-shard-bytes", str(256 * 1024), "--writer-threads", "2", "--no-progress", *ENGINE]

    def uploaded():
        return sum(1 for o in client.list_objects_v2(Bucket=bucket, Prefix="run/").get("Contents", [])
                   if o["Key"].endswith(".safetensors"))

    # 1) the endpoint goes away for good mid-run: the run stops once the retries (5 s of them) are spent
    p = start_cli(*args, "--s3-retry-seconds", "5", inprocess=True)
    t0 = time.monotonic()
    while uploaded() < 3:
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() - t0 < 600
        time.sleep(0.1)
    outage.down()
    _, err = p.communicate(timeout=600)
    assert p.returncode == 2, err[-3000:]
    msg = next(line for line in err.splitlines() if line.startswith("error: "))
    assert "upload" in msg and "s3://" in msg, msg
    first = uploaded()
    assert "run/manifest.json" not in [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]

    # 2) back, then resume through 503 storms and two more restarts of the endpoint
    outage.up()
    stop = threading.Event()

    def chaos():
        # storms and restarts in turn while the resume uploads, each after 2 more shards are up
        # (counted, not timed, so all 4 happen however fast it runs: the outage run's 17 shards
        # held 33 of the 240 samples, so the resume uploads ~100; before its first upload its
        # engine is starting and nothing talks to S3)
        rng = random.Random(3)
        last = first
        for storm in (True, False, True, False):  # 503 storm, restart, storm, restart; then calm
            while uploaded() < last + 2:
                if stop.wait(0.1):
                    return
            last = uploaded()
            if storm:
                seconds = rng.uniform(1, 3)
                outage.storm(seconds)
                time.sleep(seconds)
            else:
                outage.down()
                time.sleep(rng.uniform(1, 3))
                outage.up()

    t = threading.Thread(target=chaos, daemon=True)
    t.start()
    try:
        done = run_cli(*args, "--resume")
    finally:
        stop.set()
        t.join()
    assert done.returncode == 0, done.stderr[-3000:]
    assert outage.injected > 0 and outage.restarts == 3, (outage.injected, outage.restarts)  # the faults happened
    summary = last_json(done)
    assert summary["resumed"] > 0 and summary["resumed"] + summary["samples"] == len(prompts), summary
    ids, dup = _ids(HiddenStatesDataset(uri, s3_endpoint_url=url))
    assert sorted(ids) == sorted(prompts) and dup == 0
    res = cli("inspect", uri, "--s3-endpoint-url", url)
    assert res.returncode == 0 and "all shards verified" in res.stdout, res.stdout + res.stderr
    outage.down()
    reliability_report["s3_faults"] = {
        "outage_error": msg[:300], "shards_uploaded_before_outage": first, "samples": len(prompts),
        "resumed": summary["resumed"], "injected_503": outage.injected, "endpoint_restarts": outage.restarts,
        "samples_lost": len(set(prompts) - set(ids)), "duplicates": dup}


def _small_output(root, n_shards=3):
    """A real output written by the shard writer: 3 shards of 4 samples."""
    g = torch.Generator().manual_seed(0)
    samples = {f"x{i}": random_sample(g, 10, 2, 16) for i in range(4 * n_shards)}  # drawn in order from g
    shards = write_output(root, [1, 2], 16, samples, rows=4 * 10, writer_threads=1, manifest=False)
    assert len(shards) == n_shards
    write_manifest(root, shards, [1, 2], 16, num_model_layers=4)
    return shards


def test_truncated_and_bit_flipped_shards_are_found_and_refused_by_name(tmp_path, reliability_report):
    out = tmp_path / "out"
    shards = _small_output(out, 4)
    files = [out / s.file for s in shards]
    os.truncate(files[0], files[0].stat().st_size - 100)  # truncated
    flip_bit(files[1], files[1].stat().st_size - 200)  # a bit in the rows (the reader would return it)
    flip_bit(files[2], 20)  # a bit in the header
    res = cli("inspect", str(out))
    assert res.returncode != 0
    report = res.stdout + res.stderr
    for f in files[:3]:
        assert f.name in report, report
    assert files[3].name not in report.replace("all shards verified", "")

    ds = HiddenStatesDataset(out)
    refused = {}
    for k, f in enumerate(files[:3]):
        errors = []
        for i in range(4 * k, 4 * k + 4):
            try:
                ds[i]
            except ValueError as e:
                errors.append(str(e))
        # truncated or a damaged header: every sample of the shard; a flipped bit in the rows: only
        # the sample it is in (each read checks what it returns), named with its shard
        assert len(errors) == (1 if k == 1 else 4) and all(f.name in m for m in errors), errors
        refused[f.name] = errors[0]
    assert ds[12]["id"] == "x12" and torch.isfinite(ds[13]["hidden_states"].float()).all()  # the intact shard
    reliability_report["corrupted_shards"] = {"damaged": 3, "found_by_inspect": 3, "refused_by_reader": 3,
                                              "messages": refused}
