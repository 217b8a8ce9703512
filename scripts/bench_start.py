"""Engine start, cold vs warm: `vllm-hidden warmup`, then `extract` from the warmed caches,
against `extract` from empty caches, and N extracts started at once from the warmed caches.
Each step is the real CLI in its own process; the host's CPU use is sampled while it runs.

    # GPU host, Qwen3.6-27B dims (64 layers, random weights), BRIEF's reference settings:
    python scripts/bench_start.py --qwen36-27b --steps warmup,noop,warm --cache-root /tmp/vh-start
    python scripts/bench_start.py --qwen36-27b --steps cold --cache-root /tmp/vh-start --append
    # 2 GPUs of one host, one engine each (data parallel), from the warmed cache and from none:
    python scripts/bench_start.py --qwen36-27b --steps warmup,parallel,parallel-cold --parallel-gpus 0,1
    # CPU, tiny random Qwen3-Next:
    python scripts/bench_start.py --steps warmup,noop,warm,cold,parallel

Steps: warmup (cache A, empty at first), noop (warmup again: must return at once), warm
(extract on A), cold (extract on a fresh cache B), parallel (--parallel extracts on A at
once, one per GPU with --parallel-gpus, or sharing one with --parallel-gpu-memory-utilization),
parallel-cold (the same on a fresh cache C: one compiles, the others wait for it). Per step: wall seconds, the CLI's JSON
(engine start report: warm/cold, kernels compiled; seconds to the first finished sample),
and the busy cores of the host (peak and mean of 0.5 s samples).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import REFERENCE_27B, ROOT, WORKLOADS, make_prompts  # noqa: E402


class CpuSampler:
    """Busy cores of the whole host, sampled every 0.5 s."""

    def __enter__(self) -> "CpuSampler":
        import psutil

        self.samples: list[float] = []
        self._stop = threading.Event()
        ncpu = psutil.cpu_count() or 1
        psutil.cpu_percent(None)

        def run() -> None:
            while not self._stop.wait(0.5):
                self.samples.append(psutil.cpu_percent(None) / 100 * ncpu)

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def summary(self) -> dict:
        s = self.samples or [0.0]
        return {"busy_cores_peak": round(max(s), 1), "busy_cores_mean": round(sum(s) / len(s), 1)}


def bench_model(work: Path, qwen36_27b: bool, tiny_engine: list[str]) -> tuple[str, list[str], str, int, int]:
    """(model dir, engine args, description, longest prompt, vocab size): Qwen3.6-27B dims with
    random weights at the reference settings, or a tiny random Qwen3-Next with `tiny_engine`."""
    if qwen36_27b:
        from vllm_hidden.demo import write_qwen36_27b_config

        model = str(write_qwen36_27b_config(work / "qwen36-27b"))
        engine = [*REFERENCE_27B, "--load-format", "dummy", "--language-model-only"]
        desc, max_len = "Qwen3.6-27B text dims (64 layers), random weights", 4095
    else:
        from vllm_hidden.demo import make_tiny_model

        model = str(make_tiny_model(work / "model"))
        engine, desc, max_len = list(tiny_engine), "tiny random Qwen3-Next", 1024
    from transformers import AutoConfig

    return model, engine, desc, max_len, AutoConfig.from_pretrained(model).get_text_config().vocab_size


def _last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def run_cli(argv: list[str], log: Path, gpu: str | None = None) -> subprocess.Popen:
    f = open(log, "w")
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
    return subprocess.Popen([sys.executable, "-m", "vllm_hidden.cli", *argv], stdout=subprocess.PIPE, stderr=f,
                            text=True, env=env)


def finish(proc: subprocess.Popen, t0: float, log: Path) -> dict:
    out, _ = proc.communicate()
    cli = _last_json(out)
    res = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 2), "cli": cli}
    if cli.get("errors"):  # an extract must have run every prompt, or its first-sample time means nothing
        res["rc"] = res["rc"] or 3
    if proc.returncode:
        res["log_tail"] = log.read_text(errors="replace")[-2000:]
    text = out + log.read_text(errors="replace")  # vLLM's processes log to stdout, ours to stderr
    lines = [ln for ln in text.splitlines() if "engine started" in ln or "waiting for it" in ln]
    res["log_lines"] = [ln[-400:] for ln in lines]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qwen36-27b", action="store_true", help="Qwen3.6-27B text dims, random weights (GPU)")
    ap.add_argument("--steps", default="warmup,noop,warm,cold,parallel")
    ap.add_argument("--cache-root", default=str(ROOT / ".bench" / "start-cache"), help="A = <root>/a, B = <root>/b")
    ap.add_argument("--work-dir", default=str(ROOT / ".bench"))
    ap.add_argument("--samples", type=int, default=64, help="prompts per extract (W-chat lengths)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--parallel-gpu-memory-utilization", type=float, default=None,
                    help="each parallel engine's share of one GPU (engines sharing a GPU)")
    ap.add_argument("--parallel-gpus", default=None, help="one GPU per parallel engine, e.g. 0,1 (data parallel)")
    ap.add_argument("--result", default=None)
    ap.add_argument("--append", action="store_true")
    a = ap.parse_args()

    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model, engine, desc, max_len, vocab = bench_model(
        work, a.qwen36_27b, ["--dtype", "bfloat16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"])
    spec = {**WORKLOADS["w-chat"], "samples": a.samples, "max": min(WORKLOADS["w-chat"]["max"], max_len)}
    inp = work / "start.jsonl"
    with open(inp, "w") as f:
        for i, p in enumerate(make_prompts(spec, vocab)):
            f.write(json.dumps({"id": i, "token_ids": p}) + "\n")
    common = ["-m", model, "--max-model-len", str(max_len)]
    cache_a, cache_b = Path(a.cache_root) / "a", Path(a.cache_root) / "b"

    path = Path(a.result) if a.result else ROOT / "benchmarks" / "results" / (
        f"{'gpu' if a.qwen36_27b else 'cpu'}-start-{time.strftime('%Y%m%d-%H%M%S')}.json")
    result = json.loads(path.read_text()) if a.append and path.exists() else {"steps": {}}
    result.setdefault("commands", []).append(" ".join(["python", "scripts/bench_start.py", *sys.argv[1:]]))
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
        with CpuSampler() as cpu:
            t0 = time.perf_counter()
            if step in ("warmup", "noop"):
                if step == "warmup":
                    shutil.rmtree(cache_a, ignore_errors=True)
                res = finish(run_cli(["warmup", *common, "--cache-dir", str(cache_a), *engine], logs / "log"), t0, logs / "log")
            elif step == "warm":
                res = finish(run_cli(extract_argv(cache_a, work / "out-warm"), logs / "log"), t0, logs / "log")
            elif step == "cold":
                shutil.rmtree(cache_b, ignore_errors=True)
                res = finish(run_cli(extract_argv(cache_b, work / "out-cold"), logs / "log"), t0, logs / "log")
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
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(len(procs)) as pool:  # each wall time ends when that process does
                    res = {"engines": list(pool.map(lambda ip: finish(ip[1], t0, logs / f"log{ip[0]}"), enumerate(procs)))}
                res["rc"] = max(e["rc"] for e in res["engines"])
            else:
                ap.error(f"--steps: unknown step {step!r}")
        res.update(cpu.summary())
        result["steps"][step] = res
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        brief = {k: v for k, v in res.items() if k not in ("cli", "engines", "log_tail")}
        print(f"bench_start: {step}: {json.dumps(brief)[:1500]}", flush=True)
        for e in res.get("engines", [res]):
            cli = e.get("cli", {})
            print(f"  first sample {cli.get('first_sample_seconds')} s, engine start {cli.get('engine_init_seconds')} s, "
                  f"report {json.dumps(cli.get('engine_start') or cli.get('start'))[:600]}", flush=True)
            if e.get("rc"):
                print(e.get("log_tail", "")[-1500:], flush=True)
    print(f"bench_start: wrote {path}")


if __name__ == "__main__":
    main()
