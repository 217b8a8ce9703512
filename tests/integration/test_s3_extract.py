"""`extract --output s3://...` against a real local S3 endpoint (moto server): kill -9 the run
mid-way, --resume against S3, and read the result back with the S3 reader: every sample
exactly once, its states matching HF Transformers."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import blake3

from tests.integration.helpers import HFReference, last_json, rel_l2, run_cli, start_cli
from vllm_hidden.data import HiddenStatesDataset

ENGINE = ["--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]


def _shard_objects(client, bucket, prefix):
    r = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return [o["Key"] for o in r.get("Contents", []) if o["Key"].endswith(".safetensors")]


def test_extract_to_s3_killed_then_resumed_and_read_back(tiny_models, s3, tmp_path):
    url, bucket, client = s3
    model = tiny_models("qwen3")
    rng = random.Random(3)
    # ~20 shards; the kill comes after 3
    prompts = {i: [rng.randrange(1024) for _ in range(rng.randint(16, 160))] for i in range(120)}
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts.values()))  # ids: line numbers
    uri = f"s3://{bucket}/runs/r1"
    args = ["extract", "--model", str(model), "--input", str(inp), "--output", uri, "--s3-endpoint-url", url,
            "--staging-dir", str(tmp_path / "stage"), "--layers", "3,1", "--max-shard-bytes", str(128 * 1024),
            "--writer-threads", "2", "--no-progress", *ENGINE]

    p = start_cli(*args, inprocess=True)
    t0 = time.monotonic()
    try:
        while len(_shard_objects(client, bucket, "runs/r1")) < 3:
            assert p.poll() is None, p.stderr.read()[-2000:]
            assert time.monotonic() - t0 < 600
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    before = set(_shard_objects(client, bucket, "runs/r1"))

    refused = run_cli(*args)
    assert refused.returncode == 2 and "is not empty; pass --resume" in refused.stderr
    done = run_cli(*args, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = last_json(done)
    assert summary["resumed"] >= 1 and summary["resumed"] + summary["samples"] == len(prompts)
    assert not (tmp_path / "stage").exists() or not list((tmp_path / "stage").glob("shard-*"))

    manifest = json.loads(client.get_object(Bucket=bucket, Key="runs/r1/manifest.json")["Body"].read())
    assert before <= {f"runs/r1/{s['file']}" for s in manifest["shards"]}  # uploaded shards were kept
    for s in manifest["shards"]:
        body = client.get_object(Bucket=bucket, Key=f"runs/r1/{s['file']}")["Body"].read()
        assert len(body) == s["bytes"] and blake3.blake3(body).hexdigest() == s["blake3"]

    ds = HiddenStatesDataset(uri, s3_endpoint_url=url)
    got = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    assert len(ds) == len(prompts) and set(got) == set(prompts)  # exactly once
    ref = HFReference(model)  # states written across the killed and the resumed attempt are the model's
    for i in list(prompts)[::20]:
        states = ref.states(prompts[i])
        for k, layer in enumerate([3, 1]):
            err = rel_l2(got[i]["hidden_states"][:, k], states[layer])
            assert err < 1e-2, (i, layer, err)
    for i, s in got.items():
        assert s["token_ids"].tolist() == prompts[i]
