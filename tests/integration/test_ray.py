"""Extraction spread over a Ray cluster: a local cluster of a head and 2 worker nodes (one
CPU each), one engine per worker node, prompts from one shared queue, output on S3 (a real
local endpoint), states checked against HF Transformers."""

from __future__ import annotations

import json

import pytest

from tests.integration.helpers import HFReference, check_dataset, cli, last_json, run_cli
from tests.integration.test_parallel import DP_ENGINE, dp_prompts


@pytest.fixture
def cluster():
    from ray import cluster_utils  # installed by scripts/setup.sh (the ray extra): missing is an error

    c = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 << 20})
    for _ in range(2):
        c.add_node(num_cpus=1, object_store_memory=80 << 20)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()


def test_ray_cluster_two_workers_to_s3(tiny_models, cluster, s3, tmp_path):
    url, bucket, client = s3
    model = tiny_models("qwen3_next", 4)
    good = dp_prompts(tmp_path / "in.jsonl", 30)
    uri = f"s3://{bucket}/ray-run"
    r = run_cli("extract", "-m", str(model), "-i", str(tmp_path / "in.jsonl"), "-o", uri, "--s3-endpoint-url", url,
                "--layers", "3,0", "--ray", cluster.address, "--dp", "2", *DP_ENGINE)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    d = last_json(r.stdout)
    assert d["dp"] == 2 and d["samples"] == 30 and d["errors"] == 2
    hosts = {x["devices"].get("VLLM_CPU_OMP_THREADS_BIND") for x in d["ranks"]}
    assert len(hosts) == 2, d["ranks"]  # one host: the two engines got disjoint cores
    m = json.loads(client.get_object(Bucket=bucket, Key="ray-run/manifest.json")["Body"].read())
    assert m["num_samples"] == 30 and m["engine"]["data_parallel_size"] == 2
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="ray-run/")["Contents"]}
    assert {s["file"] for s in m["shards"]} <= {k[len("ray-run/"):] for k in keys}
    assert "ray-run/errors.jsonl" in keys and "ray-run/run.json" in keys
    r = cli("inspect", uri, "--s3-endpoint-url", url)
    assert r.returncode == 0, r.stdout + r.stderr
    check_dataset(uri, good, HFReference(model), [3, 0], every=3, s3_endpoint_url=url)
