"""Prefill throughput: plain vLLM vs `vllm-hidden extract` vs vLLM's own extractor, on the
same workloads and engine settings, in one session. One command:

    # GPU host, Qwen3.6-27B text dims (random weights), BRIEF's W-chat and W-short:
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
Every output is verified after its clock stops: every sample present with its token ids,
no NaN/inf, and (extract) every shard's checksum. Results: one JSON under benchmarks/results/
(command, versions, git revision, per case and workload: tok/s, samples/s, ratio to plain,
MFU, engine init, bytes, verification, peak RSS of the case's process tree).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("plain", "extract", "extract-shm", "upstream", "extract-tuned", "extract-final", "extract-full",
         "extract-eagle3", "extract-fp8")
# BRIEF's workloads: lognormal lengths clipped, random token ids, seed 0
WORKLOADS = {
    "w-chat": {"samples": 512, "median": 384, "sigma": 0.8, "min": 32, "max": 2048},
    "w-short": {"samples": 4096, "median": 64, "sigma": 0.5, "min": 8, "max": 256},
    "small": {"samples": 256, "median": 128, "sigma": 0.8, "min": 16, "max": 1024},  # CPU scale
}
# Qwen3.6-27B: FLOP per prefill token (2 x params + attention at these lengths), and the
# H200's measured dense bf16 peak
GFLOP_PER_TOKEN_27B = 48.7
PEAK_TFLOPS_H200 = 790.0
# The reference settings plain vLLM is measured at (BRIEF)
REFERENCE_27B = ["--dtype", "bfloat16", "--max-num-batched-tokens", "16384", "--max-num-seqs", "256",
                 "--gpu-memory-utilization", "0.85", "--gdn-prefill-backend", "triton"]


def make_prompts(spec: dict, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(spec["samples"]):
        n = int(min(spec["max"], max(spec["min"], round(rng.lognormvariate(math.log(spec["median"]), spec["sigma"])))))
        out.append([rng.randrange(vocab) for _ in range(n)])
    return out


# -- child side: one case, every workload ----------------------------------------------------
class RssPeak:
    """Peak RSS of this process and its children (the engine core, workers) while the block
    runs, sampled every 0.1 s."""

    def __enter__(self) -> "RssPeak":
        import psutil

        me = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

        def sample() -> None:
            while True:
                try:
                    self.peak = max(self.peak, sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]))
                except psutil.Error:
                    pass
                if self._stop.wait(0.1):
                    return

        self._t = threading.Thread(target=sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def _timed_loop(engine, prompts: list[list[int]], params_for) -> tuple[float, list]:
    """Feed prompts with at most 2 x max_num_seqs in flight (as extract does); returns the
    wall time to the last finished request and the finished outputs."""
    max_inflight = 2 * engine.vllm_config.scheduler_config.max_num_seqs
    pending = list(enumerate(prompts))[::-1]
    inflight, finished = 0, []
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and inflight < max_inflight:
            i, p = pending.pop()
            engine.add_request(str(i), {"prompt_token_ids": p}, params_for(i))
            inflight += 1
        for o in engine.step():
            if o.finished:
                inflight -= 1
                finished.append(o)
    return time.perf_counter() - t0, finished


def _check_finite(t) -> bool:
    import torch

    if t.dtype == torch.bfloat16:  # NaN/inf <=> exponent bits all ones; no float copy of GBs
        return not bool(((t.view(torch.int16) & 0x7F80) == 0x7F80).any())
    return bool(torch.isfinite(t).all())


def verify_extract(out: Path, prompts: list[list[int]]) -> dict:
    """Every sample present once with its token ids, every shard's checksum, no NaN/inf."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors import safe_open

    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.storage.manifest import Manifest
    from vllm_hidden.storage.files import file_checksum

    m = Manifest.read(out)

    def sum_ok(s) -> bool:
        return file_checksum(out / s.file) == s.blake3

    def finite(s) -> bool:
        with safe_open(str(out / s.file), framework="pt") as f:  # fp8 values: their scales say it
            return all(_check_finite(f.get_tensor(k)) for k in f.keys() if k.startswith(("hidden_states", "final_"))
                       and f.get_slice(k).get_dtype() != "F8_E4M3")

    with ThreadPoolExecutor(8) as pool:
        sums = all(pool.map(sum_ok, m.shards))
        fin = all(pool.map(finite, m.shards))
    ds = HiddenStatesDataset(out)
    seen = {}
    for i in range(len(ds)):
        s = ds[i]
        seen.setdefault(s["id"], []).append(s["token_ids"].tolist())
    present = set(seen) == set(range(len(prompts))) and all(len(v) == 1 for v in seen.values())
    tokens_ok = present and all(seen[i][0] == p for i, p in enumerate(prompts))
    return {"all_samples_present_once": present, "token_ids_match": tokens_ok, "checksums_ok": sums,
            "finite": fin, "bytes": sum(s.bytes for s in m.shards), "shards": len(m.shards),
            "bytes_per_token": round(sum(s.bytes for s in m.shards) / max(1, m.num_tokens), 1),
            "final_state": m.final_state}


def _start_engine(args: list[str], max_len: int):
    """A plain vLLM engine with extract's settings and runner; returns (engine, init seconds)."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_hidden.engine import compat
    from vllm_hidden.engine.extractor import engine_args

    compat.spawn_on_cuda()  # the model runner is vLLM's choice, as for extract
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args(args[0], args[1:], max_len))
    return engine, time.perf_counter() - t0


def run_plain(args: list[str], max_len: int, workloads: dict[str, list[list[int]]], save) -> dict:
    from vllm_hidden.engine import compat

    engine, init = _start_engine(args, max_len)
    sp = compat.prefill_sampling_params({})  # the params extract uses, nothing marked for capture
    res = {"engine_init_seconds": init, "model_runner": "v2" if engine.vllm_config.use_v2_model_runner else "v1",
           "workloads": {}}
    save(res)
    try:
        for name, prompts in workloads.items():
            with RssPeak() as rss:
                dt, _ = _timed_loop(engine, prompts, lambda i: sp)
            res["workloads"][name] = {"seconds": dt, "peak_rss_bytes_during_run": rss.peak}
            save(res)
    finally:
        engine.engine_core.shutdown()
    return res


def run_extract(args: list[str], max_len: int, workloads: dict[str, list[list[int]]], out_root: Path,
                inputs: dict[str, Path], layers: str | None, writer_threads: int | None, save,
                **options) -> dict:
    from vllm_hidden.config import ExtractConfig
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
            with RssPeak() as rss:
                s = extract_file(ex, str(inputs[name]), str(out_root / name)).to_dict()
            v = verify_extract(out_root / name, prompts)
            res["workloads"][name] = {"seconds": s["seconds"], "flush_seconds": s["flush_seconds"],
                                      "peak_rss_bytes_during_run": rss.peak, "capture_stats": s["capture_stats"],
                                      "verified": v}
            save(res)
            shutil.rmtree(out_root / name)  # keep the disk for the next workload
    return res


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
    engine, init = _start_engine(
        [*args, "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)], max_len)
    res = {"engine_init_seconds": init, "aux_layer_ids": aux, "workloads": {}}
    save(res)
    sp = compat.prefill_sampling_params({})
    try:
        for name, prompts in workloads.items():
            with RssPeak() as rss:
                t1 = time.perf_counter()
                dt, outs = _timed_loop(engine, prompts, lambda i: sp)
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
                finite = finite and _check_finite(d["hidden_states"])
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
    spec = json.loads(Path(spec_path).read_text())
    case = spec["case"]
    workloads = {n: json.loads(Path(p).read_text()) for n, p in spec["prompts"].items()}
    inputs = {n: Path(p) for n, p in spec["inputs"].items()}
    args = [spec["model"], *spec["engine_args"]]
    max_len = spec["max_model_len"]

    def save(res: dict) -> None:  # after every workload: a run cut short keeps what it measured
        tmp = Path(spec["result"] + ".tmp")
        tmp.write_text(json.dumps(res))
        os.replace(tmp, spec["result"])

    if case == "plain":
        run_plain(args, max_len, workloads, save)
    elif case in ("extract", "extract-tuned", "extract-final", "extract-full", "extract-eagle3", "extract-fp8"):
        options = {"extract-final": {"final_state": "post-norm"}, "extract-full": {"full_model": True},
                   "extract-fp8": {"storage_dtype": "fp8"}}.get(case, {})
        layers = spec["layers"]
        if case == "extract-eagle3":  # SpecForge's EAGLE-3 layers: 1, N/2 - 1, N - 4
            n = spec["num_layers"]
            layers = ",".join(map(str, sorted({1, n // 2 - 1, n - 4})))
        run_extract([*args, *(spec["tuned_args"] if case == "extract-tuned" else [])], max_len, workloads,
                    Path(spec["out_dir"]) / case, inputs, layers, spec["writer_threads"], save, **options)
    elif case == "extract-shm":
        run_extract(args, max_len, workloads, Path(spec["shm_dir"]) / case, inputs, spec["layers"],
                    spec["writer_threads"], save)
    elif case == "upstream":
        run_upstream(args, max_len, workloads, Path(spec["shm_dir"]) / case, spec["layer_ids"], save)
    else:
        raise ValueError(f"unknown case {case!r}")


# -- parent side -------------------------------------------------------------------------------
def run_case(spec: dict, work: Path, script: str = __file__) -> dict:
    """Run one case in a child process; sample the RSS of its process tree (the engine core
    and workers are its children) every 0.2 s, start to end (engine start and output
    verification included; each workload's run alone is `peak_rss_bytes_during_run`)."""
    import psutil

    spec_path = work / f"spec-{spec['case']}.json"
    spec_path.write_text(json.dumps(spec))
    Path(spec["result"]).unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, script, "--child", str(spec_path)])
    ps = psutil.Process(proc.pid)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.2):
            try:
                rss = sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)])
            except psutil.Error:
                continue
            peak = max(peak, rss)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    interrupted = False
    try:
        rc = proc.wait()
    except (SystemExit, KeyboardInterrupt):  # timed out: keep what the case measured so far
        interrupted, rc = True, -15
    finally:  # take the engine processes down with us
        stop.set()
        t.join()
        if proc.poll() is None:
            for p in [*ps.children(recursive=True), ps]:
                try:
                    p.kill()
                except psutil.Error:
                    pass
    res = json.loads(Path(spec["result"]).read_text()) if Path(spec["result"]).exists() else {}
    if rc != 0:
        res["error"] = f"case process exited with {rc}; workloads listed were measured before that"
    res["peak_rss_bytes"] = peak
    res["interrupted"] = interrupted
    return res


def source_fingerprint() -> str:
    import blake3

    h = blake3.blake3()
    for f in sorted([*(ROOT / "vllm_hidden").rglob("*.py"), Path(__file__).resolve()]):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def summarize(result: dict) -> None:
    """Per workload: tok/s, samples/s, ratio to plain, MFU (27B only)."""
    wl = result["workloads"]
    for case, r in result["cases"].items():
        for name, w in r.get("workloads", {}).items():
            w["tokens"] = wl[name]["tokens"]
            w["samples"] = wl[name]["samples"]
            w["tokens_per_s"] = round(w["tokens"] / w["seconds"], 1)
            w["samples_per_s"] = round(w["samples"] / w["seconds"], 2)
            if result.get("gflop_per_token"):
                w["mfu"] = round(w["tokens_per_s"] * result["gflop_per_token"] * 1e9 / (PEAK_TFLOPS_H200 * 1e12), 4)
    plain = result["cases"].get("plain", {}).get("workloads", {})
    for case, r in result["cases"].items():
        for name, w in r.get("workloads", {}).items():
            if name in plain:
                w["ratio_to_plain"] = round(w["tokens_per_s"] / plain[name]["tokens_per_s"], 4)


def model_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line with the model options every benchmark takes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="model dir (default: a tiny random Qwen3-Next written to .bench/model)")
    ap.add_argument("--qwen36-27b", action="store_true",
                    help="Qwen3.6-27B text dims with random weights (load_format=dummy) at the reference settings")
    ap.add_argument("--qwen3-32b", action="store_true",
                    help="dense Qwen3-32B dims with random weights (load_format=dummy) at the reference settings "
                         "(vLLM 0.26 runs it on its V2 model runner)")
    return ap


def pick_model(a: argparse.Namespace, work: Path) -> tuple[str, list[str], str]:
    """(model dir, engine args, description) from --qwen36-27b / --model / the tiny default."""
    engine = list(a.engine_arg)
    if getattr(a, "qwen3_32b", False):
        from vllm_hidden.demo import write_qwen3_32b_config

        model = str(write_qwen3_32b_config(work / "qwen3-32b"))
        ref = [x for x in REFERENCE_27B if x not in ("--gdn-prefill-backend", "triton")]
        return model, [*ref, "--load-format", "dummy", *engine], "Qwen3-32B dims (dense), random weights (load_format=dummy)"
    if a.qwen36_27b:
        from vllm_hidden.demo import write_qwen36_27b_config

        model = str(write_qwen36_27b_config(work / "qwen36-27b"))
        engine = [*REFERENCE_27B, "--load-format", "dummy", "--language-model-only", *engine]
        return model, engine, "Qwen3.6-27B text dims, random weights (load_format=dummy), language_model_only"
    if a.model:
        return a.model, engine, a.model
    from vllm_hidden.demo import make_tiny_model

    model = str(make_tiny_model(work / "model"))
    return model, ["--dtype", "bfloat16", *engine], "tiny random Qwen3-Next (vllm_hidden.demo, 8 layers, hidden 256)"


def main() -> None:
    ap = model_parser(__doc__)
    ap.add_argument("--workloads", default="small", help=f"comma list of {sorted(WORKLOADS)}")
    ap.add_argument("--cases", default="plain,extract", help=f"comma list of {CASES}")
    ap.add_argument("--layers", default=None, help="layer ids (default: the DFlash default for the model)")
    ap.add_argument("--max-model-len", type=int, default=4095, help="longest prompt (the engine gets +1)")
    ap.add_argument("--writer-threads", type=int, default=None)
    ap.add_argument("--work-dir", default=str(ROOT / ".bench"), help="inputs, models, and the extract disk output")
    ap.add_argument("--shm-dir", default="/dev/shm/vllm-hidden-bench")
    ap.add_argument("--engine-arg", action="append", default=[], help="passed to vLLM for every case (repeat)")
    ap.add_argument("--tuned-arg", action="append", default=[], help="extra vLLM args for extract-tuned (repeat)")
    ap.add_argument("--result", default=None, help="result JSON (default benchmarks/results/<kind>-<time>.json)")
    ap.add_argument("--append", action="store_true", help="merge these cases into an existing --result")
    a = ap.parse_args()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run finally blocks on `timeout`
    if a.child:
        child(a.child)
        return

    cases = [c for c in a.cases.split(",") if c]
    names = [w for w in a.workloads.split(",") if w]
    for c in cases:
        if c not in CASES:
            ap.error(f"--cases: unknown case {c!r}; choose from {CASES}")
    for w in names:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {w!r}; choose from {sorted(WORKLOADS)}")
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    from transformers import AutoConfig

    from vllm_hidden.layers import resolve_layer_ids

    model, engine, model_desc = pick_model(a, work)
    text = AutoConfig.from_pretrained(model).get_text_config()
    layer_ids = resolve_layer_ids(text.num_hidden_layers, a.layers, None, None)

    prompts, inputs, wl_info = {}, {}, {}
    for name in names:
        ps = make_prompts(WORKLOADS[name], text.vocab_size)
        prompts[name] = str(work / f"{name}.prompts.json")
        Path(prompts[name]).write_text(json.dumps(ps))
        inputs[name] = str(work / f"{name}.jsonl")
        with open(inputs[name], "w") as f:
            for i, p in enumerate(ps):
                f.write(json.dumps({"id": i, "token_ids": p}) + "\n")
        wl_info[name] = {**WORKLOADS[name], "seed": 0, "tokens": sum(map(len, ps)), "samples": len(ps)}

    path = Path(a.result) if a.result else ROOT / "benchmarks" / "results" / (
        f"{'gpu' if a.qwen36_27b or a.qwen3_32b else 'cpu'}-bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    import torch
    import vllm

    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    result = {"cases": {}}
    if a.append and path.exists():
        result = json.loads(path.read_text())
    result.setdefault("commands", []).append(" ".join(["python", "scripts/bench.py", *sys.argv[1:]]))
    result.update({
        "git_revision": rev, "git_dirty": dirty,
        # what ran, independent of the checkout's history: BLAKE3 over the package and this script
        "source_blake3": source_fingerprint(),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"cpus": os.cpu_count(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "model": model_desc, "layer_ids": layer_ids, "engine_args": engine, "max_model_len": a.max_model_len + 1,
        "tuned_args": a.tuned_arg, "gflop_per_token": GFLOP_PER_TOKEN_27B if a.qwen36_27b else None,
        "peak_tflops": PEAK_TFLOPS_H200 if a.qwen36_27b else None,
    })
    result.setdefault("workloads", {}).update(wl_info)
    for case in cases:
        spec = {"case": case, "model": model, "engine_args": engine, "tuned_args": a.tuned_arg,
                "max_model_len": a.max_model_len, "layers": ",".join(map(str, layer_ids)), "layer_ids": layer_ids,
                "num_layers": text.num_hidden_layers,
                "prompts": prompts, "inputs": inputs, "out_dir": str(work / "out"), "shm_dir": a.shm_dir,
                "writer_threads": a.writer_threads, "result": str(work / f"result-{case}.json")}
        print(f"bench: case {case} ...", flush=True)
        result["cases"][case] = run_case(spec, work)
        summarize(result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))  # after every case: a later failure keeps the rest
        short = {n: {k: w.get(k) for k in ("tokens_per_s", "ratio_to_plain", "mfu")}
                 for n, w in result["cases"][case].get("workloads", {}).items()}
        print(f"bench: {case}: {json.dumps(short)} {result['cases'][case].get('error', '')}", flush=True)
        if result["cases"][case].pop("interrupted", False):
            print(f"bench: interrupted; wrote {path}", flush=True)
            sys.exit(143)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
