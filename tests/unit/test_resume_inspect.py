import json
import shutil

import pytest
from typer.testing import CliRunner

from tests.outputs import random_sample, write_output
from vllm_hidden.cli import app
from vllm_hidden.storage.journal import JOURNAL, RUN, prepare_resume, read_journal, write_json_atomic
from vllm_hidden.storage.verify import verify_output

K, H = 2, 8


def _run(tmp_path, ids, rows=10, manifest=True):
    """Shards as an interrupted (manifest=False) or finished run leaves them."""
    write_json_atomic(tmp_path / RUN, {"format": "vllm-hidden/1", "model": "m", "layer_ids": [3, 5], "hidden_size": H})
    samples = {i: random_sample(i, 4, K, H, high=50) for i in ids}
    return write_output(tmp_path, [3, 5], H, samples, rows=rows, writer_threads=2, manifest=manifest)


def test_resume_keeps_exactly_the_journaled_shards_and_removes_leftovers(tmp_path):
    shards = _run(tmp_path, range(6), manifest=False)  # 2 samples per shard -> 3 shards
    assert sorted(s.file for s in read_journal(tmp_path)) == [s.file for s in shards]  # in completion order
    # what a kill -9 leaves: a shard renamed but never journaled, a temporary file, a torn line
    shutil.copy(tmp_path / shards[0].file, tmp_path / "shard-00003.safetensors")
    (tmp_path / ".shard-123-9.tmp").write_bytes(b"partial")
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('{"file": "shard-00004.safetens')
    state = prepare_resume(tmp_path)
    assert state.done_ids == set(range(6)) and state.next_index == 3
    assert sorted(state.removed) == [".shard-123-9.tmp", "shard-00003.safetensors"]
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [s.file for s in shards]


def test_a_torn_last_journal_line_is_cut_so_the_next_resume_reads_clean(tmp_path):
    """A crash mid-append leaves half a line; the resumed run appends after it. Unless the
    resume cut it, the line after would be garbled and the run after that refused."""
    from vllm_hidden.format.shard import ShardInfo
    from vllm_hidden.storage.journal import Journal

    shards = _run(tmp_path, range(4), manifest=False)
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('{"file": "shard-00002.safetens')
    prepare_resume(tmp_path)
    j = Journal(tmp_path)  # what the resumed run appends
    j.record(ShardInfo(file="shard-00002.safetensors", bytes=1, blake3="0" * 64, num_samples=0, num_tokens=0))
    j.close()
    assert (sorted(s.file for s in read_journal(tmp_path))
            == sorted([*(s.file for s in shards), "shard-00002.safetensors"]))


def test_resume_refuses_a_damaged_output(tmp_path):
    shards = _run(tmp_path, range(4), manifest=False)
    (tmp_path / shards[1].file).unlink()
    with pytest.raises(ValueError, match=r"shard-00001.safetensors: recorded as done with \d+ bytes, found missing"):
        prepare_resume(tmp_path)


def test_a_garbled_journal_line_before_the_end_is_an_error(tmp_path):
    _run(tmp_path, range(4), manifest=False)
    lines = (tmp_path / JOURNAL).read_text().splitlines()
    (tmp_path / JOURNAL).write_text("\n".join(["{oops", *lines]) + "\n")
    with pytest.raises(ValueError, match="line 1 is not a shard record"):
        read_journal(tmp_path)


def test_inspect_verifies_and_names_a_corrupted_shard(tmp_path):
    shards = _run(tmp_path, range(6))
    r = verify_output(tmp_path)
    assert r.ok and r.complete and r.summary["samples"] == 6
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", str(tmp_path)])
    assert res.exit_code == 0 and "all shards verified" in res.output
    p = tmp_path / shards[1].file
    raw = bytearray(p.read_bytes())
    raw[-20] ^= 0xFF  # one flipped byte in the token ids
    p.write_bytes(bytes(raw))
    res = runner.invoke(app, ["inspect", str(tmp_path), "--json"])
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.exit_code == 1 and not rep["ok"]
    assert rep["problems"] == [f"{shards[1].file}: BLAKE3 does not match the recorded "
                               f"{shards[1].blake3[:16]}... (corrupted)"]


def test_inspect_reports_an_interrupted_run(tmp_path):
    _run(tmp_path, range(4), manifest=False)
    r = verify_output(tmp_path)
    assert not r.complete and r.summary["samples"] == 4
    assert len(r.problems) == 1 and r.problems[0].startswith("incomplete: no manifest.json")


def test_resume_refuses_another_storage_dtype(tmp_path):
    """An fp8 output resumed without --storage-dtype fp8 (or the reverse) would mix fp8 and
    bf16 shards under one manifest."""
    from vllm_hidden.storage.output import Output

    base = {"format": "vllm-hidden/1", "model": "m", "layer_ids": [3, 5], "hidden_size": H}
    for was, now in (({"storage_dtype": "fp8"}, {}), ({}, {"storage_dtype": "fp8"})):
        root = tmp_path / f"out{len(was)}"
        Output(str(root), {**base, **was}).begin(resume=False)
        with pytest.raises(ValueError, match="was written with storage_dtype="):
            Output(str(root), {**base, **now}).begin(resume=True)
    Output(str(tmp_path / "out1"), {**base, "storage_dtype": "fp8"}).begin(resume=True)  # the same one resumes
