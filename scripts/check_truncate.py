"""The cut model against the whole one under torch.compile (the CI test compares them in eager
mode): the same prompts extracted twice, with the default cut and with --full-model, both
compiled (no --enforce-eager), each into a fresh compile cache; prints and writes how many
samples are bit-identical and the largest difference.

    python scripts/check_truncate.py [--model DIR --layers 1,4 --engine-arg ...] [--result FILE]

Default: a tiny random Qwen3-Next (8 layers, its MoE layer first so the cut can keep it),
layers 1,4 (the cut runs 5 of 8), chunked prefill (128-token steps)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
import torch


def main() -> None:
    ap = benchlib.parser(__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", default="1,4")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--result", default=None)
    a = ap.parse_args()
    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.demo import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="check-truncate-"))
    model = a.model or str(make_tiny_model(work / "model", arch="qwen3_next", num_layers=8, moe_layer=0))
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randrange(16, 250))] for _ in range(a.prompts)]
    benchlib.write_prompts(work / "in.jsonl", prompts, ids=[f"t{i}" for i in range(a.prompts)])
    engine = a.engine_arg or ["--dtype", "bfloat16", "--max-model-len", "256", "--max-num-batched-tokens", "128",
                              "--max-num-seqs", "8"]
    if torch.cuda.is_available() and not a.engine_arg:
        engine += ["--gdn-prefill-backend", "triton"]  # vLLM's Hopper default is FlashInfer's, which may be absent
    for name, extra in (("cut", []), ("full", ["--full-model"])):
        log = work / f"{name}.log"
        with open(log, "w") as f:
            r = subprocess.run([sys.executable, "-m", "vllm_hidden.cli", "extract", "-m", model,
                                "-i", str(work / "in.jsonl"), "-o", str(work / name), "--layers", a.layers,
                                "--no-progress", "--cache-dir", str(work / f"cache-{name}"), *extra, *engine],
                               stdout=f, stderr=subprocess.STDOUT, check=False,
                               # (CPU: a small KV cache; the project first on the path, the rest of it kept)
                               # Triton's kernels and autotune results shared by both runs (the compile caches
                               # stay apart): only one run autotunes, and both run the same kernel configs
                               env={"VLLM_CPU_KVCACHE_SPACE": "1", "TRITON_CACHE_DIR": str(work / "triton"),
                                    **os.environ,
                                    "PYTHONPATH": os.pathsep.join(filter(None, [str(benchlib.ROOT),
                                                                                os.environ.get("PYTHONPATH")]))})
        if r.returncode:
            # the root cause is where the engine process logged it, often far above the launcher's traceback
            lines = log.read_text(errors="replace").splitlines()
            errors = [ln for ln in lines if "Error" in ln or "error" in ln][:40]
            sys.exit(f"{name}: exit {r.returncode} (whole log: {log})\n" + "\n".join(errors + ["..."] + lines[-40:]))
    cut, full = HiddenStatesDataset(work / "cut"), HiddenStatesDataset(work / "full")
    by_id = {full[i]["id"]: full[i] for i in range(len(full))}
    same, worst, maxabs = 0, 0.0, 0.0
    for i in range(len(cut)):
        x, y = cut[i]["hidden_states"].float(), by_id[cut[i]["id"]]["hidden_states"].float()
        same += torch.equal(x, y)
        worst = max(worst, ((x - y).norm() / y.norm()).item())
        maxabs = max(maxabs, (x - y).abs().max().item())
    res = {"command": benchlib.command_line(__file__), "model": a.model or "tiny qwen3_next 8 layers, MoE layer 0",
           "layers": a.layers, "engine_args": engine, "compiled": "--enforce-eager" not in engine,
           "layers_run": {n: json.loads((work / n / "manifest.json").read_text())["layers_run"]
                          for n in ("cut", "full")},
           "samples": len(cut), "bit_identical_samples": same, "worst_rel_l2": worst, "max_abs_diff": maxabs,
           "versions": benchlib.versions("vllm", "torch")}
    print(json.dumps(res))
    if a.result:
        benchlib.write_json(a.result, res)


if __name__ == "__main__":
    main()
