"""Data parallel vs tensor parallel extraction, output written, one command per host:

    # 2-GPU host, Qwen3.6-27B text dims (random weights), the W-chat workload doubled (1024 samples):
    python scripts/bench_parallel.py --qwen36-27b --samples 1024 --cases dp1,dp2,tp2
    # CPU (tiny random Qwen3-Next), the same cases at CI scale:
    python scripts/bench_parallel.py --samples 64 --cases dp1,dp2,tp2

Each case is one `vllm-hidden extract` process (`--dp N --tp M`) over the same prompts, with
the same engine settings, into an empty output directory (--out-dir, or --shm-dir for the
`-shm` cases); the extract's own clock runs from the first engine ready until every shard is
durable (fsynced and renamed). Cases run in the order given and share one compile cache, so
later cases with the same per-engine settings start warm. After each case the output is
checked: the manifest lists every prompt once, with its token ids (all of them compared).
Results: one JSON under benchmarks/results/ (commands, tok/s, speed-up over dp1, GB/s
written, per-engine shares, start times).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import benchlib
from benchlib import CpuSampler, finish, run_cli

CASES = {"dp1": (1, 1), "dp2": (2, 1), "tp2": (1, 2), "dp2-shm": (2, 1), "dp1-shm": (1, 1), "dp4": (4, 1),
         "tp4": (1, 4), "dp2tp2": (2, 2)}


def check_output(out: Path, prompts: list[list[int]]) -> dict:
    from safetensors import safe_open

    from vllm_hidden.data import HiddenStatesDataset

    ds = HiddenStatesDataset(out)
    seen: dict[int, int] = {}
    for shard in ds.manifest.shards:
        with safe_open(str(out / shard.file), framework="pt") as f:
            tok = f.get_tensor("token_ids")
            for sid, row, n in json.loads(f.metadata()["samples"]):
                if sid in seen:
                    return {"ok": False, "why": f"sample {sid} twice"}
                seen[sid] = 1
                if tok[row:row + n].tolist() != prompts[sid]:
                    return {"ok": False, "why": f"sample {sid}: token ids differ"}
    missing = [i for i in range(len(prompts)) if i not in seen]
    parts = sorted({s.file.split("/")[0] if "/" in s.file else "." for s in ds.manifest.shards})
    return {"ok": not missing, "samples": len(seen), "missing": missing[:5], "parts": parts,
            "shards": len(ds.manifest.shards)}


def main() -> None:
    ap = benchlib.parser(__doc__)
    ap.add_argument("--qwen36-27b", action="store_true", help="Qwen3.6-27B text dims, random weights (GPU)")
    ap.add_argument("--cases", default="dp1,dp2,tp2", help=f"comma list of {sorted(CASES)}")
    ap.add_argument("--samples", type=int, default=1024,
                    help="W-chat prompts (the W-chat workload has 512; 1024 = doubled)")
    ap.add_argument("--work-dir", default=str(benchlib.ROOT / ".bench"))
    ap.add_argument("--out-dir", default=None, help="extract output (default <work-dir>/par-out); emptied per case")
    ap.add_argument("--shm-dir", default="/dev/shm/vllm-hidden-par")
    ap.add_argument("--cache-dir", default=None,
                    help="compile caches shared by the cases (default <work-dir>/par-cache)")
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--keep-output", action="store_true")
    ap.add_argument("--result", default=None)
    ap.add_argument("--append", action="store_true")
    a = ap.parse_args()

    work = Path(a.work_dir)
    model, engine, desc, max_len, vocab = benchlib.bench_model(
        work, a.qwen36_27b, ["--dtype", "bfloat16", "--max-num-seqs", "16", "--max-num-batched-tokens", "512"])
    engine += a.engine_arg
    inp = work / "par.jsonl"
    prompts = benchlib.w_chat_input(inp, a.samples, max_len, vocab)
    cache = Path(a.cache_dir or work / "par-cache")

    path = benchlib.result_path(a.result, f"{'gpu' if a.qwen36_27b else 'cpu'}-parallel-{benchlib.stamp()}.json")
    result = benchlib.load_result(path, a.append, {"cases": {}})
    benchlib.add_command(result, __file__)
    result.update({"model": desc, "engine_args": engine, "max_model_len": max_len + 1, "samples": a.samples,
                   "tokens": sum(map(len, prompts)), "cpus": os.cpu_count()})
    with contextlib.suppress(Exception):  # informational
        result["gpus"] = benchlib.gpu_names()

    for case in [c for c in a.cases.split(",") if c]:
        if case not in CASES:
            ap.error(f"--cases: unknown case {case!r}")
        dp, tp = CASES[case]
        out = Path(a.shm_dir if case.endswith("-shm") else (a.out_dir or work / "par-out")) / case
        shutil.rmtree(out, ignore_errors=True)
        logs = work / f"par-{case}"
        logs.mkdir(exist_ok=True)
        print(f"bench_parallel: {case} (dp {dp}, tp {tp}) -> {out} ...", flush=True)
        with CpuSampler() as cpu:
            t0 = time.perf_counter()
            argv = ["extract", "-m", model, "--max-model-len", str(max_len), "-i", str(inp), "-o", str(out),
                    "--no-progress", "--cache-dir", str(cache), "--dp", str(dp), "--tp", str(tp), *engine]
            res = finish(run_cli(argv, logs / "log"), t0, logs / "log")
        res.update(cpu.summary())
        res["dp"], res["tp"] = dp, tp
        cli = res.get("cli", {})
        if res["rc"] == 0:
            res["check"] = check_output(out, prompts)
            secs = cli.get("seconds") or 0
            res["tokens_per_s"] = cli.get("tokens_per_s")
            res["gb_per_s_written"] = round(cli.get("bytes", 0) / secs / 1e9, 3) if secs else None
        base = result["cases"].get("dp1", {}).get("tokens_per_s")
        if base and res.get("tokens_per_s"):
            res["speedup_vs_dp1"] = round(res["tokens_per_s"] / base, 3)
        result["cases"][case] = res
        benchlib.write_json(path, result)
        brief = {k: res.get(k) for k in ("rc", "wall_s", "tokens_per_s", "speedup_vs_dp1", "gb_per_s_written", "check",
                                         "busy_cores_peak")}
        print(f"bench_parallel: {case}: {json.dumps(brief)}", flush=True)
        for r in cli.get("ranks", []):
            print(f"  rank {r['rank']}: {r['samples']} samples, {r['tokens']} tokens in {r['seconds']} s, "
                  f"engine start {r['engine_init_seconds']} s, warm {r.get('engine_start', {}).get('warm')}",
                  flush=True)
        if res["rc"]:
            print(res.get("log_tail", "")[-3000:], flush=True)
        if not a.keep_output:
            shutil.rmtree(out, ignore_errors=True)
    print(f"bench_parallel: wrote {path}")


if __name__ == "__main__":
    main()
