"""Throughput of `vllm-hidden extract` vs plain vLLM prefill, same engine settings, same run.

    python scripts/bench.py                       # CPU, tiny Qwen3-Next (the CI machine's scale)
    python scripts/bench.py --model M --engine-arg=--gdn-prefill-backend --engine-arg=triton ...

Plain = the same prompts through vLLM with max_tokens=1 and nothing captured. Writes one
JSON file (command, versions, git revision, both cases) under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def workload(n: int, median: float, sigma: float, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import math

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))
        out.append([rng.randrange(vocab) for _ in range(length)])
    return out


def run_plain(model: str, prompts: list[list[int]], engine_args: list[str], max_model_len: int) -> dict:
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_hidden.engine import compat
    from vllm_hidden.engine.driver import engine_args as build_engine_args

    compat.pin_v1_runner()  # the runner extract uses
    compat.spawn_on_cuda()
    args = build_engine_args(model, engine_args, max_model_len)  # same settings, no capture
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    init = time.perf_counter() - t0
    try:
        max_inflight = 2 * engine.vllm_config.scheduler_config.max_num_seqs
        sp = compat.prefill_sampling_params({})  # same params as extract, nothing marked for capture
        pending = list(enumerate(prompts))[::-1]
        inflight = 0
        t1 = time.perf_counter()
        while pending or inflight:
            while pending and inflight < max_inflight:
                i, p = pending.pop()
                engine.add_request(str(i), {"prompt_token_ids": p}, sp)
                inflight += 1
            inflight -= sum(1 for o in engine.step() if o.finished)
        dt = time.perf_counter() - t1
    finally:
        engine.engine_core.shutdown()
    tokens = sum(map(len, prompts))
    return {"tokens": tokens, "samples": len(prompts), "seconds": dt, "tokens_per_s": tokens / dt,
            "samples_per_s": len(prompts) / dt, "engine_init_seconds": init}


def run_extract(model: str, prompts: list[list[int]], engine_args: list[str], max_model_len: int, out: Path,
                layers: str | None, max_shard_bytes: int | None) -> dict:
    from vllm_hidden.config import ExtractConfig
    from vllm_hidden.engine.driver import run_extract as extract

    inp = out.parent / "bench-input.jsonl"
    with open(inp, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "token_ids": p}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    s = extract(ExtractConfig(model=model, input_path=str(inp), output_dir=str(out), layers=layers,
                              max_model_len=max_model_len, progress=False, engine_args=engine_args,
                              **({"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {})))
    d = s.to_dict()
    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.storage.manifest import Manifest

    ds = HiddenStatesDataset(out)
    ids = {ds[i]["id"] for i in range(len(ds))}
    d["verified_all_samples_present"] = ids == set(range(len(prompts)))
    d["bytes_written"] = sum(x.bytes for x in Manifest.read(out).shards)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model dir (default: a tiny random Qwen3-Next written to .demo/bench-model)")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--median", type=float, default=128)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--layers", default=None)
    ap.add_argument("--max-shard-bytes", type=int, default=None, help="extract's shard size (default: extract's default)")
    ap.add_argument("--out", default=str(ROOT / ".demo" / "bench-out"))
    ap.add_argument("--engine-arg", action="append", default=[], help="passed to vLLM (repeat)")
    ap.add_argument("--result", default=None, help="result JSON path (default benchmarks/results/<name>.json)")
    a = ap.parse_args()

    from transformers import AutoConfig

    model = a.model
    if model is None:
        from vllm_hidden.demo import make_tiny_model

        model = str(make_tiny_model(ROOT / ".demo" / "bench-model"))
        a.engine_arg = ["--dtype", "bfloat16", *a.engine_arg]
    vocab = AutoConfig.from_pretrained(model).get_text_config().vocab_size
    prompts = workload(a.samples, a.median, a.sigma, a.min_len, a.max_len, vocab)
    plain = run_plain(model, prompts, a.engine_arg, a.max_len)
    ext = run_extract(model, prompts, a.engine_arg, a.max_len, Path(a.out), a.layers, a.max_shard_bytes)
    import torch
    import vllm

    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_revision": rev,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"cpus": os.cpu_count(), "cuda": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "model": model if a.model else "tiny random Qwen3-Next (vllm_hidden.demo, 8 layers, hidden 256)",
        "workload": {"samples": a.samples, "median": a.median, "sigma": a.sigma, "min": a.min_len, "max": a.max_len,
                     "tokens": plain["tokens"], "seed": 0},
        "engine_args": a.engine_arg,
        "plain_vllm": plain,
        "extract": ext,
        "ratio_extract_vs_plain": ext["tokens_per_s"] / plain["tokens_per_s"],
        # the same ratio without the final flush (last shard hashed, written, fsynced after the last request)
        "ratio_during_run": (ext["tokens"] / (ext["seconds"] - ext["flush_seconds"])) / plain["tokens_per_s"],
    }
    path = Path(a.result) if a.result else ROOT / "benchmarks" / "results" / (
        f"{'gpu' if torch.cuda.is_available() else 'cpu'}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("ratio_extract_vs_plain", "ratio_during_run")} | {
        "plain_tok_s": round(plain["tokens_per_s"]), "extract_tok_s": round(ext["tokens_per_s"])}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
