"""S3 output and reader against a real local S3 endpoint (moto's server mode), with faults
injected by a proxy in front of it: 503s, slow answers, connections cut mid-upload."""

import json
import threading
import time

import blake3
import pytest
import torch

from tests.outputs import random_sample, shard_writer, write_manifest, write_samples
from tests.s3_server import FaultyProxy
from vllm_hidden.capture.records import Rows
from vllm_hidden.config import ExtractConfig, ShardConfig
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.storage.s3 import S3Location, read_done_ids, transient

K, H = 2, 64  # 256 B per row


def _data(n=30):
    return {f"s{i}": random_sample(i, 5 + i % 17, K, H, high=99) for i in range(n)}


def _write(staging, uri, endpoint, data, rows=40, pending=2, retry_s=120.0):
    w = shard_writer(staging, [3, 5], H, rows=rows, writer_threads=2, upload_uri=uri, s3_endpoint_url=endpoint,
                     upload_pending=pending, upload_retry_s=retry_s)
    shards = write_samples(w, data)
    loc = S3Location(uri, endpoint)
    write_manifest(staging, shards, [3, 5], H)
    loc.put_file(staging / "manifest.json", "manifest.json")
    return shards, loc


def test_shards_upload_evict_and_read_back_over_s3(s3, tmp_path):
    url, bucket, client = s3
    data = _data()
    shards, loc = _write(tmp_path / "stage", f"s3://{bucket}/run/a", url, data)
    assert len(shards) > 3
    assert not list((tmp_path / "stage").glob("shard-*"))  # evicted once S3 confirmed each
    assert loc.shard_infos() == shards  # size, BLAKE3 and counts live on the objects
    for s in shards:
        body = client.get_object(Bucket=bucket, Key=f"run/a/{s.file}")["Body"].read()
        assert blake3.blake3(body).hexdigest() == s.blake3
    assert read_done_ids(loc, shards) == set(data)
    ds = HiddenStatesDataset(f"s3://{bucket}/run/a", s3_endpoint_url=url)
    assert len(ds) == len(data) and ds.layer_ids == [3, 5]
    for i in range(len(ds)):
        s = ds[i]
        tok, hs = data[s["id"]]
        assert torch.equal(s["token_ids"], tok) and torch.equal(s["hidden_states"], hs)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert sorted(s["id"] for s in loader) == sorted(data)


def test_reader_names_a_missing_manifest(s3):
    url, bucket, _ = s3
    with pytest.raises(FileNotFoundError, match="no manifest.json under 's3://hidden/nothing'"):
        HiddenStatesDataset(f"s3://{bucket}/nothing", s3_endpoint_url=url)


def test_transient_faults_are_retried_and_nothing_is_lost(s3, tmp_path):
    """Every 3rd request to a shard key is answered 503, one upload is cut mid-body, one is
    slow: boto3's retries carry every shard through."""
    url, bucket, _ = s3
    port = int(url.rsplit(":", 1)[1])
    cut = []

    def rule(method, path, n):
        if ".safetensors" not in path:
            return None
        if method == "PUT" and not cut:
            cut.append(n)
            return ("cut",)
        if n % 3 == 0:
            return ("status", 503)
        if n % 7 == 0:
            return ("slow", 0.5)
        return None

    proxy = FaultyProxy(port, rule)
    try:
        data = _data()
        shards, _ = _write(tmp_path / "stage", f"s3://{bucket}/faulty", proxy.url, data)
    finally:
        proxy.stop()
    kinds = {a[0] for _, _, a in proxy.injected}
    assert kinds == {"cut", "status", "slow"}
    ds = HiddenStatesDataset(f"s3://{bucket}/faulty", s3_endpoint_url=url)
    assert sorted(ds[i]["id"] for i in range(len(ds))) == sorted(data)


def test_an_upload_that_exhausts_its_retries_stops_the_run_naming_the_shard(s3, tmp_path):
    url, bucket, client = s3
    port = int(url.rsplit(":", 1)[1])
    proxy = FaultyProxy(port, lambda m, p, n: ("status", 500) if "shard-00001" in p else None)
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError, match="shard shard-00001.safetensors was not uploaded"):
            _write(tmp_path / "stage", f"s3://{bucket}/broken", proxy.url, _data(), retry_s=3.0)
        assert time.monotonic() - t0 < 60  # tried again for retry_s (3 s), then given up
    finally:
        proxy.stop()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="broken/").get("Contents", [])]
    assert "broken/shard-00001.safetensors" not in keys and "broken/manifest.json" not in keys
    assert (tmp_path / "stage" / "shard-00001.safetensors").exists()  # the staged copy is kept


def test_inspect_over_s3_names_a_corrupted_object(s3, tmp_path):
    from vllm_hidden.storage.verify import verify_output

    url, bucket, client = s3
    shards, _ = _write(tmp_path / "stage", f"s3://{bucket}/insp", url, _data(12))
    assert verify_output(f"s3://{bucket}/insp", s3_endpoint_url=url).ok
    key = f"insp/{shards[0].file}"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-3] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    r = verify_output(f"s3://{bucket}/insp", s3_endpoint_url=url)
    assert r.problems == [f"{shards[0].file}: BLAKE3 does not match the recorded "
                          f"{shards[0].blake3[:16]}... (corrupted)"]


def test_a_fault_longer_than_boto3s_own_retries_is_ridden_out(s3, tmp_path):
    """Every request answered 503 for 6 s, then the endpoint gone for 3 s, while shards
    upload: boto3's per-request retries (and its client-wide retry quota) are spent within
    seconds of that, so the uploader tries each failed shard again, and nothing is lost."""
    url, bucket, _ = s3
    port = int(url.rsplit(":", 1)[1])
    storm = {"until": None, "injected": 0}

    def rule(method, path, n):
        if storm["until"] is None:
            storm["until"] = time.monotonic() + 6.0  # from the first request on
        if time.monotonic() < storm["until"]:
            storm["injected"] += 1
            return ("status", 503)
        return None

    proxy = FaultyProxy(port, rule)
    pport = proxy.server.server_address[1]

    def restart():
        while storm["until"] is None or time.monotonic() < storm["until"]:
            time.sleep(0.05)
        proxy.stop()
        time.sleep(3.0)
        holder.append(FaultyProxy(port, rule, port=pport))

    holder: list = []
    t = threading.Thread(target=restart, daemon=True)
    t.start()
    data = _data()
    try:
        shards, _ = _write(tmp_path / "stage", f"s3://{bucket}/storm", proxy.url, data)
    finally:
        t.join()
        for p in holder:
            p.stop()
    assert storm["injected"] > 0 and len(shards) > 3
    ds = HiddenStatesDataset(f"s3://{bucket}/storm", s3_endpoint_url=url)
    assert sorted(ds[i]["id"] for i in range(len(ds))) == sorted(data)
    for i in range(len(ds)):
        tok, hs = data[ds[i]["id"]]
        assert torch.equal(ds[i]["token_ids"], tok) and torch.equal(ds[i]["hidden_states"], hs)


def test_the_runs_own_objects_ride_out_a_passing_outage_too(s3, tmp_path):
    """run.json, errors.jsonl and the manifest go up through the same ride-out as shards:
    more 503s in a row than boto3 tries (9 attempts) fail a plain put, not the run's."""
    url, bucket, client = s3
    port = int(url.rsplit(":", 1)[1])
    puts = {"n": 0}

    def rule(method, path, n):
        if method == "PUT":
            puts["n"] += 1
            if puts["n"] <= 12:
                return ("status", 503)
        return None

    proxy = FaultyProxy(port, rule)
    try:
        loc = S3Location(f"s3://{bucket}/own", proxy.url)
        loc.put_json("run.json", {"a": 1})
        (tmp_path / "m.json").write_text('{"b": 2}')
        loc.put_file(tmp_path / "m.json", "manifest.json")
    finally:
        proxy.stop()
    assert puts["n"] > 12  # the 503s were answered, and tried past
    assert json.loads(client.get_object(Bucket=bucket, Key="own/run.json")["Body"].read()) == {"a": 1}
    assert json.loads(client.get_object(Bucket=bucket, Key="own/manifest.json")["Body"].read()) == {"b": 2}


def test_transient_errors_are_told_from_the_others():
    from botocore.exceptions import ClientError, EndpointConnectionError

    def client_error(status, code):
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert transient(EndpointConnectionError(endpoint_url="http://x"))
    assert transient(client_error(503, "ServiceUnavailable")) and transient(client_error(400, "SlowDown"))
    assert not transient(client_error(403, "AccessDenied")) and not transient(client_error(404, "NoSuchBucket"))
    assert not transient(OSError("shard-00001.safetensors: S3 holds 3 bytes, the shard has 4"))
    try:  # wrapped, as boto3's transfer manager wraps the client's error
        try:
            raise client_error(500, "InternalError")
        except ClientError as e:
            raise RuntimeError("Failed to upload") from e
    except RuntimeError as wrapped:
        assert transient(wrapped)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "5", True])
def test_a_bad_retry_time_is_refused_naming_it(bad, tmp_path):
    with pytest.raises(ValueError, match=r"--s3-retry-seconds must be a non-negative number of seconds, got "):
        ExtractConfig(model="m", input_path="in.jsonl", output_dir=str(tmp_path / "o"), s3_retry_s=bad)
    with pytest.raises(ValueError, match=r"upload_retry_s must be a non-negative number of seconds, got "):
        ShardConfig(output_dir=str(tmp_path), upload_retry_s=bad)


def test_generated_samples_over_s3_keep_their_records_and_prompt_lengths(s3, tmp_path):
    """--generate on S3: each shard object carries its samples' generation lines, gathered
    into generations.jsonl with ranged GETs (in shard order), and the reader returns each
    sample's prompt length."""
    from vllm_hidden.storage.output import write_generations

    url, bucket, _ = s3
    uri = f"s3://{bucket}/gen"
    w = shard_writer(tmp_path / "stage", [3, 5], H, rows=40, writer_threads=2, upload_uri=uri, s3_endpoint_url=url,
                     generate=True)
    data = _data(12)
    lines = {}
    for sid, (tok, hs) in data.items():
        lines[sid] = json.dumps({"id": sid, "n": len(tok)}) + "\n"
        w.add_rows(sid, tok, Rows(hs, hs.float().abs().amax(-1)), loss_spans=None, num_prompt=2, record=lines[sid])
    shards = w.close()
    assert len(shards) > 2
    loc = S3Location(uri, url)
    write_generations(tmp_path / "generations.jsonl", shards, loc)
    got = (tmp_path / "generations.jsonl").read_text().splitlines(keepends=True)
    assert sorted(got) == sorted(lines.values()) and len(got) == len(data)
    order = []
    for s in shards:  # shard order, then each shard's index order
        order += [e[0] for e in loc.shard_header(s).index]
    assert [json.loads(x)["id"] for x in got] == order
    write_manifest(tmp_path, shards, [3, 5], H)
    loc.put_file(tmp_path / "manifest.json", "manifest.json")
    ds = HiddenStatesDataset(uri, s3_endpoint_url=url)
    for i in range(len(ds)):
        s = ds[i]
        assert s["num_prompt_tokens"] == 2 and torch.equal(s["hidden_states"], data[s["id"]][1])
