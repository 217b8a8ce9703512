"""Prefill throughput: plain vLLM vs `vllm-hidden extract` vs vLLM's own extractor, on the
same workloads and engine settings, in one run. One command:

    # GPU host, Qwen3.6-27B text dims (random weights), the W-chat and W-short workloads:
    python scripts/bench.py --qwen36-27b --workloads w-chat,w-short \
        --cases plain,extract,extract-shm,upstream
    # GPU host, dense Qwen3-32B dims (vLLM 0.26 runs it on its V2 model runner):
    python scripts/bench.py --qwen3-32b --workloads w-chat,w-short --cases plain,extract
    # CPU, tiny random Qwen3-Next (the CI machine's scale):
    python scripts/bench.py --workloads small --cases plain,extract

Cases (each in its own process, so its peak host RSS is its own; the engine starts once per
case and runs every workload):
  plain        vLLM prefill, max_tokens=1, nothing captured
  extract      vllm-hidden to local disk (--out-dir), output fully written before the clock stops
  extract-shm  the same to tmpfs (--shm-dir)
  upstream     vLLM's `extract_hidden_states` + ExampleHiddenStatesConnector to tmpfs, until
               every file is written (its per-file locks released)
  extract-tuned  extract with extra engine settings (--tuned-arg), vs plain at the reference ones
  extract-final  extract with --final-state post-norm (the final normed state as one more column)
  extract-full   extract with --full-model (every decoder layer runs; `extract` cuts the model
                 after the deepest captured layer, its default)
  extract-eagle3 extract of EAGLE-3's layers (ids 1, N/2-1, N-4: aux 2,32,61 at 64 layers), cut
  extract-fp8    extract with --storage-dtype fp8 (quantized on the device: half the bytes)
  extract-stats  extract, each workload four times on one engine: per-layer statistics on, off, on,
                 off (VHIDDEN_LAYER_STATS), for what the statistics cost
  plain-fp8w     plain with FP8 weights: vLLM's online quantization (--quantization fp8, one scale per
                 weight tensor) of the bf16 checkpoint
  extract-fp8w   extract (cut after the deepest captured layer, bf16 states) with the same FP8 weights
  plain-fp8b / extract-fp8b  the same from an FP8 checkpoint laid out as Qwen's FP8 releases (128 x 128
                 weight blocks; --qwen36-27b only: its config with `quantization_config`, random weights)
Every case also reports, from its engine's log, the model's memory ("Model loading took") and the
GEMM kernels vLLM selected.
--feeds runs each workload of a plain case once per way of keeping prompts in the engine (2 x
max_num_seqs requests as extract keeps them, or all up front as LLM.generate).
--step-trace records every scheduler step of every case (plain cases run vLLM's scheduler
through vllm-hidden's, which schedules as vLLM's for them) and gives each workload its `steps`:
how many, their tokens, how many were small, the time between them, and every step's row with
the scheduler's running and waiting requests and free KV-cache blocks as it was made.
Every output is verified after its clock stops: every sample present with its token ids,
no NaN/inf, and (extract) every shard's checksum. Results: one JSON under benchmarks/results/
(command, versions, git revision, per case and workload: tok/s, samples/s, ratio to plain,
MFU, engine init, bytes, verification, peak RSS of the case's process tree).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import benchlib
from benchlib import WORKLOADS, RssPeak

CASES = ("plain", "extract", "extract-shm", "upstream", "extract-tuned", "extract-final", "extract-full",
         "extract-eagle3", "extract-fp8", "extract-stats", "plain-fp8w", "extract-fp8w", "plain-fp8b",
         "extract-fp8b")
FP8_WEIGHTS = ["--quantization", "fp8"]  # vLLM 0.26's name for online per-tensor FP8
STEP_TRACE = "VHIDDEN_STEP_TRACE"  # vllm_hidden.envs.STEP_TRACE
SCHEDULER = "vllm_hidden.engine.scheduler.taper_scheduler"  # vLLM's scheduler for plain requests, traced
# Qwen3.6-27B: FLOP per prefill token (2 x params + attention at these lengths), and the
# H200's measured dense bf16 peak
GFLOP_PER_TOKEN_27B = 48.7
PEAK_TFLOPS_H200 = 790.0


# -- child side: one case, every workload ----------------------------------------------------
def _runs(workloads: dict, feeds: list[str]):
    """(result key, prompts, feed) of every run: the first feed's under the workload's name, the
    others' under name@feed."""
    for name, prompts in workloads.items():
        for i, feed in enumerate(feeds):
            yield (name if i == 0 else f"{name}@{feed}"), prompts, feed


def run_plain(args: list[str], max_len: int, workloads: dict[str, list[list[int]]], save,
              feeds: list[str]) -> dict:
    from vllm_hidden.engine import compat

    engine, init = benchlib.start_engine(args, max_len)
    # the params extract uses, nothing marked for capture, and not marked prompt-only: vLLM's own
    # scheduling (under --step-trace too, through our scheduler class)
    sp = compat.prefill_sampling_params({}, prompt_only=False)
    res = {"engine_init_seconds": init, "model_runner": "v2" if engine.vllm_config.use_v2_model_runner else "v1",
           "workloads": {}}
    save(res)
    try:
        for key, prompts, feed in _runs(workloads, feeds):
            mark = _trace_mark()
            with RssPeak() as rss:
                dt, _ = benchlib.timed_loop(engine, prompts, lambda i: sp, feed)
            res["workloads"][key] = {"seconds": dt, "feed": feed, "peak_rss_bytes_during_run": rss.peak,
                                     **_trace_since(mark, time.perf_counter())}
            save(res)
    finally:
        engine.engine_core.shutdown()
    return res


def run_extract(args: list[str], max_len: int, workloads: dict[str, list[list[int]]], out_root: Path,
                inputs: dict[str, Path], layers: str | None, writer_threads: int | None, save,
                stats_ab: int | None = None, **options) -> dict:
    from vllm_hidden.config import LAYER_STATS_ENV, ExtractConfig
    from vllm_hidden.extract.job import extract_file, start_extractor

    shutil.rmtree(out_root, ignore_errors=True)
    first = next(iter(workloads))
    kw = {"writer_threads": writer_threads} if writer_threads else {}
    cfg = ExtractConfig(model=args[0], input_path=str(inputs[first]), output_dir=str(out_root / first), layers=layers,
                        max_model_len=max_len, progress=False, engine_args=args[1:], **options, **kw)
    res = {"workloads": {}}
    with start_extractor(cfg) as ex:
        res["engine_init_seconds"] = ex.engine_init_seconds
        res["layer_ids"] = ex.layer_ids
        res["layers_run"] = ex.layers_run
        res["model_runner"] = ex.start_report.get("model_runner")
        save(res)
        for name, prompts in workloads.items():
            runs = []
            for stats in (None,) if stats_ab is None else ("1", "0") * stats_ab:
                if stats is not None:  # read when the run's shard config is made, in this process
                    os.environ[LAYER_STATS_ENV] = stats
                mark = _trace_mark()
                with RssPeak() as rss:
                    s = extract_file(ex, str(inputs[name]), str(out_root / name)).to_dict()
                steps = _trace_since(mark, time.perf_counter())
                v = benchlib.verify_extract(out_root / name, prompts)
                runs.append({"seconds": s["seconds"], "flush_seconds": s["flush_seconds"],
                             "peak_rss_bytes_during_run": rss.peak, "capture_stats": s["capture_stats"],
                             "verified": v, "layer_stats": stats != "0", **steps})
                shutil.rmtree(out_root / name)  # keep the disk for the next run
            res["workloads"][name] = runs[0] if stats_ab is None else _stats_ab(runs)
            save(res)
    return res


def _trace_mark() -> tuple[int, int]:
    """Lines in this case's step trace and in its done file so far (0 without --step-trace)."""
    from vllm_hidden.engine.scheduler import DONE_SUFFIX

    def lines(f: str) -> int:
        return len(Path(f).read_text().splitlines()) if Path(f).exists() else 0

    path = os.environ.get(STEP_TRACE)
    return (lines(path), lines(path + DONE_SUFFIX)) if path else (0, 0)


def _trace_since(mark: tuple[int, int], ended_at: float | None = None) -> dict:
    """The steps the engine scheduled since `mark`: how many, their tokens (quantiles, and how
    many were under an eighth of the largest), the time between them, and every step as a row of
    `rows_columns` (time from the first step; the scheduler's queues as the step was made). Then
    `done`: each step's output as the scheduler took it in (ms from the first step's schedule,
    tokens, ms since the previous output: the step's own time where the GPU is the bottleneck),
    and `after_last_step_ms`, from the last output to `ended_at` (the run's end as its caller saw
    it: for extract, every shard durable)."""
    from vllm_hidden.engine.scheduler import DONE_SUFFIX, TRACE_COLUMNS

    path = os.environ.get(STEP_TRACE)
    if not path or not Path(path).exists():
        return {}
    rows = [ln.split() for ln in Path(path).read_text().splitlines()[mark[0]:]]
    if not rows:
        return {"steps": {"count": 0}}
    t = [float(r[0]) for r in rows]
    tokens = sorted(int(r[1]) for r in rows)
    gaps = sorted(b - a for a, b in zip(t, t[1:]))

    def q(xs, p):
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None

    out = {"count": len(rows), "tokens_p10_p50_p90": [q(tokens, 0.1), q(tokens, 0.5), q(tokens, 0.9)],
           "under_an_eighth_of_the_largest": sum(n < tokens[-1] / 8 for n in tokens),
           "mean_tokens": round(sum(tokens) / len(tokens), 1),
           "interval_ms_p50_p90": [round(1e3 * q(gaps, 0.5), 2), round(1e3 * q(gaps, 0.9), 2)] if gaps else None,
           "rows_columns": ["ms", *TRACE_COLUMNS[1:]],
           "rows": [[round(1e3 * (float(r[0]) - t[0]), 1), *map(int, r[1:])] for r in rows]}
    done_path = Path(path + DONE_SUFFIX)
    done = [ln.split() for ln in done_path.read_text().splitlines()[mark[1]:]] if done_path.exists() else []
    if done:
        d = [float(r[0]) for r in done]
        own = [b - a for a, b in zip(d, d[1:])]
        out["done"] = {"count": len(done),
                       "interval_ms_p50_p90": [round(1e3 * q(sorted(own), 0.5), 2), round(1e3 * q(sorted(own), 0.9), 2)]
                       if own else None,
                       "rows_columns": ["ms", "tokens", "ms_since_previous"],
                       "rows": [[round(1e3 * (x - t[0]), 1), int(r[1]), round(1e3 * (x - d[i - 1]), 1) if i else None]
                                for i, (x, r) in enumerate(zip(d, done))]}
        if ended_at is not None:
            out["after_last_step_ms"] = round(1e3 * (ended_at - d[-1]), 1)
    return {"steps": out}


def _stats_ab(runs: list[dict]) -> dict:
    """Alternating runs with statistics on and off: the best of each, and every run."""
    on = min((r for r in runs if r["layer_stats"]), key=lambda r: r["seconds"])
    off = min((r for r in runs if not r["layer_stats"]), key=lambda r: r["seconds"])
    return {**on, "seconds_without_stats": off["seconds"], "stats_cost": round(on["seconds"] / off["seconds"] - 1, 4),
            "runs": [{k: r[k] for k in ("seconds", "flush_seconds", "layer_stats")}
                     | {k: r["capture_stats"].get(k) for k in ("writer_busy_s", "writer_stats_s")} for r in runs]}


def run_upstream(args: list[str], max_len: int, workloads: dict[str, list[list[int]]], out_root: Path,
                 layer_ids: list[int], save) -> dict:
    """vLLM's own extractor: speculative method `extract_hidden_states` stores the aux
    states in KV-cache blocks; ExampleHiddenStatesConnector writes one safetensors file per
    request from a thread pool, each guarded by a lock file released when written."""
    import fcntl

    from safetensors.torch import load_file

    from vllm_hidden.engine import compat

    shutil.rmtree(out_root, ignore_errors=True)
    out_root.mkdir(parents=True)
    aux = [i + 1 for i in layer_ids]  # EAGLE-3 aux id = input of layer i+1
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(out_root)}}
    engine, init = benchlib.start_engine(
        [*args, "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)], max_len)
    res = {"engine_init_seconds": init, "aux_layer_ids": aux, "workloads": {}}
    save(res)
    sp = compat.prefill_sampling_params({}, prompt_only=False)  # vLLM's connector keeps its own scheduler
    try:
        for name, prompts in workloads.items():
            with RssPeak() as rss:
                t1 = time.perf_counter()
                dt, outs = benchlib.timed_loop(engine, prompts, lambda i: sp)
                paths = {int(o.request_id): (o.kv_transfer_params or {}).get("hidden_states_path") for o in outs}
                for p in paths.values():  # the clock stops when every file is written
                    if p:
                        with open(p + ".lock") as lf:
                            fcntl.flock(lf, fcntl.LOCK_SH)
                total = time.perf_counter() - t1
            present = sorted(paths) == list(range(len(prompts))) and all(paths.values())
            tokens_ok, finite, nbytes, shape = present, True, 0, None
            for i, p in paths.items():
                if not p or not os.path.exists(p):
                    tokens_ok = False
                    continue
                d = load_file(p)
                nbytes += os.path.getsize(p)
                shape = list(d["hidden_states"].shape)
                tokens_ok = tokens_ok and d["token_ids"].tolist() == prompts[i]
                finite = finite and benchlib.check_finite(d["hidden_states"])
            res["workloads"][name] = {"seconds": total, "engine_seconds": dt, "peak_rss_bytes_during_run": rss.peak,
                                      "verified": {
                "all_samples_present_once": present, "token_ids_match": tokens_ok, "finite": finite,
                "checksums_ok": None, "bytes": nbytes, "files": len(paths), "last_shape": shape}}
            save(res)
            for f in out_root.iterdir():
                f.unlink()
    finally:
        engine.engine_core.shutdown()
    return res


def child(spec_path: str) -> None:
    spec, save = benchlib.child_spec(spec_path)
    case = spec["case"]
    workloads = {n: json.loads(Path(p).read_text()) for n, p in spec["prompts"].items()}
    inputs = {n: Path(p) for n, p in spec["inputs"].items()}
    args = [spec["model"], *spec["engine_args"]]
    max_len = spec["max_model_len"]
    if case.endswith("-fp8w"):
        args += FP8_WEIGHTS
    elif case.endswith("-fp8b"):
        if not spec.get("model_fp8b"):
            raise ValueError(f"case {case!r} needs --qwen36-27b (an FP8 checkpoint's config with random weights)")
        args = [spec["model_fp8b"], *spec["engine_args"]]
    base = case.removesuffix("-fp8w").removesuffix("-fp8b")
    if spec.get("step_trace"):  # read by the engine's scheduler, started in this process's children
        os.environ[STEP_TRACE] = str(Path(spec["out_dir"]).parent / f"steps-{case}.txt")
        Path(os.environ[STEP_TRACE]).unlink(missing_ok=True)
        if base == "plain":
            args += ["--scheduler-cls", SCHEDULER]

    feeds = spec["feeds"]
    if base == "plain":
        run_plain(args, max_len, workloads, save, feeds)
    elif base in ("extract", "extract-tuned", "extract-final", "extract-full", "extract-eagle3", "extract-fp8",
                  "extract-stats"):
        options = {"extract-final": {"final_state": "post-norm"}, "extract-full": {"full_model": True},
                   "extract-fp8": {"storage_dtype": "fp8"}, "extract-stats": {"stats_ab": 2}}.get(base, {})
        layers = spec["layers"]
        if base == "extract-eagle3":  # SpecForge's EAGLE-3 layers: 1, N/2 - 1, N - 4
            n = spec["num_layers"]
            layers = ",".join(map(str, sorted({1, n // 2 - 1, n - 4})))
        run_extract([*args, *(spec["tuned_args"] if base == "extract-tuned" else [])], max_len, workloads,
                    Path(spec["out_dir"]) / case, inputs, layers, spec["writer_threads"], save, **options)
    elif case == "extract-shm":
        run_extract(args, max_len, workloads, Path(spec["shm_dir"]) / case, inputs, spec["layers"],
                    spec["writer_threads"], save)
    elif case == "upstream":
        run_upstream(args, max_len, workloads, Path(spec["shm_dir"]) / case, spec["layer_ids"], save)
    else:
        raise ValueError(f"unknown case {case!r}")


# -- parent side -------------------------------------------------------------------------------
def summarize(result: dict) -> None:
    """Per workload: tok/s, samples/s, ratio to plain, MFU (27B only)."""
    wl = result["workloads"]
    for r in result["cases"].values():
        for name, w in r.get("workloads", {}).items():
            w["tokens"] = wl[name.split("@")[0]]["tokens"]
            w["samples"] = wl[name.split("@")[0]]["samples"]
            w["tokens_per_s"] = round(w["tokens"] / w["seconds"], 1)
            w["samples_per_s"] = round(w["samples"] / w["seconds"], 2)
            if result.get("gflop_per_token"):
                w["mfu"] = round(w["tokens_per_s"] * result["gflop_per_token"] * 1e9 / (PEAK_TFLOPS_H200 * 1e12), 4)
    plain = result["cases"].get("plain", {}).get("workloads", {})
    for case, r in result["cases"].items():
        for name, w in r.get("workloads", {}).items():
            if name in plain:
                w["ratio_to_plain"] = round(w["tokens_per_s"] / plain[name]["tokens_per_s"], 4)
            # FP8-weight cases also against plain vLLM with the same weights
            same = result["cases"].get("plain-" + case.rsplit("-", 1)[1], {}) if case.endswith(("-fp8w", "-fp8b")) \
                else {}
            if case.startswith("extract") and name in same.get("workloads", {}):
                w["ratio_to_plain_fp8"] = round(w["tokens_per_s"] / same["workloads"][name]["tokens_per_s"], 4)


def main() -> None:
    ap = benchlib.model_parser(__doc__)
    ap.add_argument("--workloads", default="small", help=f"comma list of {sorted(WORKLOADS)}")
    ap.add_argument("--cases", default="plain,extract", help=f"comma list of {CASES}")
    ap.add_argument("--layers", default=None, help="layer ids (default: the DFlash default for the model)")
    ap.add_argument("--max-model-len", type=int, default=4095, help="longest prompt (the engine gets +1)")
    ap.add_argument("--writer-threads", type=int, default=None)
    ap.add_argument("--work-dir", default=str(benchlib.ROOT / ".bench"),
                    help="inputs, models, and the extract disk output")
    ap.add_argument("--shm-dir", default="/dev/shm/vllm-hidden-bench")
    ap.add_argument("--engine-arg", action="append", default=[], help="passed to vLLM for every case (repeat)")
    ap.add_argument("--tuned-arg", action="append", default=[], help="extra vLLM args for extract-tuned (repeat)")
    ap.add_argument("--result", default=None, help="result JSON (default benchmarks/results/<kind>-<time>.json)")
    ap.add_argument("--append", action="store_true", help="merge these cases into an existing --result")
    ap.add_argument("--feeds", default="window",
                    help=f"plain cases: comma list of {benchlib.FEEDS}, how prompts are kept in the engine (window: "
                         "2 x max_num_seqs requests, as extract keeps them; all: every prompt up front, as "
                         "LLM.generate); each workload runs once per feed, the first under its name, the others "
                         "as name@feed")
    ap.add_argument("--step-trace", action="store_true",
                    help="record every scheduler step of every case (VHIDDEN_STEP_TRACE; plain cases run vLLM's "
                         "scheduler through ours, which schedules as vLLM's for them) and summarize each workload's")
    a = ap.parse_args()
    benchlib.exit_on_sigterm()  # run finally blocks on `timeout`
    if a.child:
        child(a.child)
        return

    cases = [c for c in a.cases.split(",") if c]
    names = [w for w in a.workloads.split(",") if w]
    for c in cases:
        if c not in CASES:
            ap.error(f"--cases: unknown case {c!r}; choose from {CASES}")
    feeds = [f for f in a.feeds.split(",") if f]
    for f in feeds:
        if f not in benchlib.FEEDS:
            ap.error(f"--feeds: unknown feed {f!r}; choose from {benchlib.FEEDS}")
    if not feeds or len(set(feeds)) != len(feeds):
        ap.error(f"--feeds: {a.feeds!r} must name each feed once")
    for w in names:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {w!r}; choose from {sorted(WORKLOADS)}")
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    from transformers import AutoConfig

    from vllm_hidden.layers import resolve_layer_ids

    model, engine, model_desc = benchlib.pick_model(a, work)
    model_fp8b = None
    if a.qwen36_27b and any(c.endswith("-fp8b") for c in cases):
        from vllm_hidden.demo import write_qwen36_27b_config

        model_fp8b = str(write_qwen36_27b_config(work / "qwen36-27b-fp8b", fp8_blocks=True))
    text = AutoConfig.from_pretrained(model).get_text_config()
    layer_ids = resolve_layer_ids(text.num_hidden_layers, a.layers, None, None)

    prompts, inputs, wl_info = {}, {}, {}
    for name in names:
        ps = benchlib.make_prompts(WORKLOADS[name], text.vocab_size)
        prompts[name] = str(work / f"{name}.prompts.json")
        Path(prompts[name]).write_text(json.dumps(ps))
        inputs[name] = str(work / f"{name}.jsonl")
        benchlib.write_prompts(inputs[name], ps)
        wl_info[name] = {**WORKLOADS[name], "seed": 0, "tokens": sum(map(len, ps)), "samples": len(ps)}

    kind = "gpu" if a.qwen36_27b or a.qwen3_32b else "cpu"
    path = benchlib.result_path(a.result, f"{kind}-bench-{benchlib.stamp()}.json")
    result = benchlib.load_result(path, a.append, {"cases": {}})
    benchlib.add_command(result, __file__)
    result.update({
        # what ran, independent of the checkout's history: source_blake3 over the package, benchlib and this script
        **benchlib.engine_provenance(__file__), "git_dirty": bool(benchlib.git_changes(untracked=False)),
        "model": model_desc, "layer_ids": layer_ids, "engine_args": engine, "max_model_len": a.max_model_len + 1,
        "tuned_args": a.tuned_arg, "gflop_per_token": GFLOP_PER_TOKEN_27B if a.qwen36_27b else None,
        "peak_tflops": PEAK_TFLOPS_H200 if a.qwen36_27b else None,
    })
    result.setdefault("workloads", {}).update(wl_info)
    for case in cases:
        spec = {"case": case, "model": model, "engine_args": engine, "tuned_args": a.tuned_arg,
                "max_model_len": a.max_model_len, "layers": ",".join(map(str, layer_ids)), "layer_ids": layer_ids,
                "num_layers": text.num_hidden_layers, "model_fp8b": model_fp8b,
                "prompts": prompts, "inputs": inputs, "out_dir": str(work / "out"), "shm_dir": a.shm_dir,
                "writer_threads": a.writer_threads, "result": str(work / f"result-{case}.json"),
                "step_trace": a.step_trace, "feeds": feeds}
        print(f"bench: case {case} ...", flush=True)
        result["cases"][case] = benchlib.run_case(spec, work, __file__)
        summarize(result)
        benchlib.write_json(path, result)  # after every case: a later failure keeps the rest
        short = {n: {k: w.get(k) for k in ("tokens_per_s", "ratio_to_plain", "ratio_to_plain_fp8", "mfu")}
                 for n, w in result["cases"][case].get("workloads", {}).items()}
        print(f"bench: {case}: {json.dumps(short)} {result['cases'][case].get('error', '')}", flush=True)
        if result["cases"][case].pop("interrupted", False):
            print(f"bench: interrupted; wrote {path}", flush=True)
            sys.exit(143)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
