"""Engine start, cold vs warm: `vllm-hidden warmup`, then `extract` from the warmed caches,
against `extract` from empty caches, and N extracts started at once from the warmed caches.
Each step is the real CLI in its own process; the host's CPU use is sampled while it runs.

    # GPU host, Qwen3.6-27B dims (64 layers, random weights), the reference engine settings:
    python scripts/bench_start.py --qwen36-27b --steps warmup,noop,warm --cache-root /tmp/vh-start
    python scripts/bench_start.py --qwen36-27b --steps cold --cache-root /tmp/vh-start --append
    # 2 GPUs of one host, one engine each (data parallel), from the warmed cache and from none:
    python scripts/bench_start.py --qwen36-27b --steps warmup,parallel,parallel-cold --parallel-gpus 0,1
    # CPU, tiny random Qwen3-Next:
    python scripts/bench_start.py --steps warmup,noop,warm,cold,parallel

    # a warm cache carried to a fresh cache root: packed on A, unpacked into an empty root P
    python scripts/bench_start.py --qwen36-27b --steps warmup,pack,packed,warm --cache-root /tmp/vh-start

Steps: warmup (cache A, empty at first), noop (warmup again: must return at once), pack (warmup
again with --pack <root>/warm.tar.gz: A's caches as one archive), packed (extract on a fresh cache
P with --cache-from that archive: unpacked, then started; what a fresh machine does), warm
(extract on A), cold (extract on a fresh cache B), parallel (--parallel extracts on A at
once, one per GPU with --parallel-gpus, or sharing one with --parallel-gpu-memory-utilization),
parallel-cold (the same on a fresh cache C: one compiles, the others wait for it). Per step: wall seconds, the CLI's
JSON (engine start report: warm/cold, kernels compiled; seconds to the first finished sample),
and the busy cores of the host (peak and mean of 0.5 s samples).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import benchlib
from benchlib import CpuSampler, finish, run_cli


def main() -> None:
    ap = benchlib.parser(__doc__)
    ap.add_argument("--qwen36-27b", action="store_true", help="Qwen3.6-27B text dims, random weights (GPU)")
    ap.add_argument("--steps", default="warmup,noop,warm,cold,parallel")
    ap.add_argument("--cache-root", default=str(benchlib.ROOT / ".bench" / "start-cache"),
                    help="A = <root>/a, B = <root>/b")
    ap.add_argument("--work-dir", default=str(benchlib.ROOT / ".bench"))
    ap.add_argument("--samples", type=int, default=64, help="prompts per extract (W-chat lengths)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--parallel-gpu-memory-utilization", type=float, default=None,
                    help="each parallel engine's share of one GPU (engines sharing a GPU)")
    ap.add_argument("--parallel-gpus", default=None, help="one GPU per parallel engine, e.g. 0,1 (data parallel)")
    ap.add_argument("--result", default=None)
    ap.add_argument("--append", action="store_true")
    a = ap.parse_args()

    work = Path(a.work_dir)
    model, engine, desc, max_len, vocab = benchlib.bench_model(
        work, a.qwen36_27b, ["--dtype", "bfloat16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"])
    inp = work / "start.jsonl"
    benchlib.w_chat_input(inp, a.samples, max_len, vocab)
    common = ["-m", model, "--max-model-len", str(max_len)]
    cache_a, cache_b = Path(a.cache_root) / "a", Path(a.cache_root) / "b"
    archive = Path(a.cache_root) / "warm.tar.gz"

    path = benchlib.result_path(a.result, f"{'gpu' if a.qwen36_27b else 'cpu'}-start-{benchlib.stamp()}.json")
    result = benchlib.load_result(path, a.append, {"steps": {}})
    benchlib.add_command(result, __file__)
    result.update({"model": desc, "engine_args": engine, "max_model_len": max_len + 1, "samples": a.samples,
                   "cpus": os.cpu_count()})

    def extract_argv(cache: Path, out: Path, extra: list[str] = ()) -> list[str]:
        shutil.rmtree(out, ignore_errors=True)
        return ["extract", *common, "-i", str(inp), "-o", str(out), "--no-progress", "--cache-dir", str(cache),
                *engine, *extra]

    for step in [s for s in a.steps.split(",") if s]:
        print(f"bench_start: {step} ...", flush=True)
        logs = work / f"start-{step}"
        logs.mkdir(exist_ok=True)
        log = logs / "log"
        with CpuSampler() as cpu:
            t0 = time.perf_counter()
            if step in ("warmup", "noop"):
                if step == "warmup":
                    shutil.rmtree(cache_a, ignore_errors=True)
                res = finish(run_cli(["warmup", *common, "--cache-dir", str(cache_a), *engine], log), t0, log)
            elif step == "pack":
                res = finish(run_cli(["warmup", *common, "--cache-dir", str(cache_a), *engine, "--pack",
                                      str(archive)], log), t0, log)
            elif step == "packed":
                cache_p = Path(a.cache_root) / "p"
                shutil.rmtree(cache_p, ignore_errors=True)
                res = finish(run_cli(extract_argv(cache_p, work / "out-packed", ["--cache-from", str(archive)]), log),
                             t0, log)
                cli = res.get("cli", {})
                if cli.get("first_sample_seconds") is not None and cli.get("cache_from"):
                    # the extract's clock starts after the archive is unpacked: a fresh machine waits for both
                    unpack_s = cli["cache_from"]["seconds"]
                    res["first_sample_with_unpack_s"] = round(cli["first_sample_seconds"] + unpack_s, 2)
            elif step == "warm":
                res = finish(run_cli(extract_argv(cache_a, work / "out-warm"), log), t0, log)
            elif step == "cold":
                shutil.rmtree(cache_b, ignore_errors=True)
                res = finish(run_cli(extract_argv(cache_b, work / "out-cold"), log), t0, log)
            elif step in ("parallel", "parallel-cold"):  # from the warmed cache A / from an empty cache C
                cache = cache_a
                if step == "parallel-cold":
                    cache = Path(a.cache_root) / "c"
                    shutil.rmtree(cache, ignore_errors=True)
                mem = (["--gpu-memory-utilization", str(a.parallel_gpu_memory_utilization)]
                       if a.parallel_gpu_memory_utilization else [])
                gpus = a.parallel_gpus.split(",") if a.parallel_gpus else [None] * a.parallel
                procs = [run_cli(extract_argv(cache, work / f"out-par{i}", mem), logs / f"log{i}", gpus[i])
                         for i in range(a.parallel)]
                with ThreadPoolExecutor(len(procs)) as pool:  # each wall time ends when that process does
                    res = {"engines": list(pool.map(finish, procs, [t0] * len(procs),
                                                    [logs / f"log{i}" for i in range(len(procs))]))}
                res["rc"] = max(e["rc"] for e in res["engines"])
            else:
                ap.error(f"--steps: unknown step {step!r}")
        res.update(cpu.summary())
        result["steps"][step] = res
        benchlib.write_json(path, result)
        brief = {k: v for k, v in res.items() if k not in ("cli", "engines", "log_tail")}
        print(f"bench_start: {step}: {json.dumps(brief)[:1500]}", flush=True)
        for e in res.get("engines", [res]):
            cli = e.get("cli", {})
            print(f"  first sample {cli.get('first_sample_seconds')} s, "
                  f"engine start {cli.get('engine_init_seconds')} s, "
                  f"report {json.dumps(cli.get('engine_start') or cli.get('start'))[:600]}", flush=True)
            if e.get("rc"):
                print(e.get("log_tail", "")[-1500:], flush=True)
    print(f"bench_start: wrote {path}")


if __name__ == "__main__":
    main()
