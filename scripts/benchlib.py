"""What the benchmarks in this folder share: workloads and prompt files, model presets, the
engine's timed request loop, peak-RSS and CPU sampling, output verification, cases run in a
child process, the CLI run as a process, and provenance (command, git revision, versions, host)
and result files under benchmarks/results/.

A script imports it as `import benchlib`: run as `python scripts/<name>.py`, its own folder is
on sys.path. Heavy imports (torch, vLLM, the package) happen inside the functions that need them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# The workloads: prompt lengths lognormal around `median` (log-sigma `sigma`), clipped to
# [min, max], token ids uniformly random, seed 0. W-chat: chat-length prompts; W-short: many
# short ones; small: the CPU scale.
WORKLOADS = {
    "w-chat": {"samples": 512, "median": 384, "sigma": 0.8, "min": 32, "max": 2048},
    "w-short": {"samples": 4096, "median": 64, "sigma": 0.5, "min": 8, "max": 256},
    "small": {"samples": 256, "median": 128, "sigma": 0.8, "min": 16, "max": 1024},  # CPU scale
}
# The settings plain vLLM and extract are measured at with Qwen3.6-27B on one GPU: bf16,
# 16384-token steps, 256 sequences, 85% of the GPU's memory, the Triton GDN prefill kernels
REFERENCE_27B = ["--dtype", "bfloat16", "--max-num-batched-tokens", "16384", "--max-num-seqs", "256",
                 "--gpu-memory-utilization", "0.85", "--gdn-prefill-backend", "triton"]


# -- workloads, prompt files ----------------------------------------------------------------------
def make_prompts(spec: dict, vocab: int, seed: int = 0) -> list[list[int]]:
    """A workload's prompts: `spec["samples"]` lists of random token ids below `vocab`."""
    rng = random.Random(seed)
    out = []
    for _ in range(spec["samples"]):
        n = int(min(spec["max"], max(spec["min"], round(rng.lognormvariate(math.log(spec["median"]), spec["sigma"])))))
        out.append([rng.randrange(vocab) for _ in range(n)])
    return out


def write_prompts(path: Path | str, prompts: list[list[int]], ids: list[Any] | None = None) -> None:
    """An extract input: one `{"id", "token_ids"}` line per prompt (ids 0, 1, ... unless given)."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": i, "token_ids": p}) + "\n"
                     for i, p in zip(range(len(prompts)) if ids is None else ids, prompts))


def w_chat_input(path: Path, samples: int, max_len: int, vocab: int) -> list[list[int]]:
    """`samples` prompts of W-chat's lengths (none longer than `max_len`) written to `path`; returns them."""
    spec = {**WORKLOADS["w-chat"], "samples": samples, "max": min(WORKLOADS["w-chat"]["max"], max_len)}
    prompts = make_prompts(spec, vocab)
    write_prompts(path, prompts)
    return prompts


# -- command line, models ---------------------------------------------------------------------------
def parser(doc: str | None) -> argparse.ArgumentParser:
    """A command line whose help starts with the script's docstring, as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def model_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line with the model options (and the hidden --child) of the engine benchmarks."""
    ap = parser(doc)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="model dir (default: a tiny random Qwen3-Next written to .bench/model)")
    ap.add_argument("--qwen36-27b", action="store_true",
                    help="Qwen3.6-27B text dims with random weights (load_format=dummy) at the reference settings")
    ap.add_argument("--qwen3-32b", action="store_true",
                    help="dense Qwen3-32B dims with random weights (load_format=dummy) at the reference settings "
                         "(vLLM 0.26 runs it on its V2 model runner)")
    return ap


def exit_on_sigterm() -> None:
    """SIGTERM (`timeout`) exits with 143 through SystemExit, so finally blocks run."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def qwen36_27b(work: Path, num_layers: int = 64) -> tuple[str, list[str]]:
    """(model dir, engine args): Qwen3.6-27B text dims, random weights, at the reference settings
    (`num_layers` < 64: its first layers only, for quick probes)."""
    from vllm_hidden.demo import write_qwen36_27b_config

    name = "qwen36-27b" if num_layers == 64 else f"qwen36-27b-{num_layers}l"
    model = str(write_qwen36_27b_config(work / name, num_layers))
    return model, [*REFERENCE_27B, "--load-format", "dummy", "--language-model-only"]


def tiny_model(work: Path) -> str:
    """A tiny random Qwen3-Next (vllm_hidden.demo) under `work`/model."""
    from vllm_hidden.demo import make_tiny_model

    return str(make_tiny_model(work / "model"))


def pick_model(a: argparse.Namespace, work: Path) -> tuple[str, list[str], str]:
    """(model dir, engine args, description) from model_parser's options (--qwen3-32b,
    --qwen36-27b, --model, else the tiny model), with --engine-arg appended."""
    engine = list(a.engine_arg)
    if getattr(a, "qwen3_32b", False):
        from vllm_hidden.demo import write_qwen3_32b_config

        model = str(write_qwen3_32b_config(work / "qwen3-32b"))
        ref = [x for x in REFERENCE_27B if x not in ("--gdn-prefill-backend", "triton")]
        return (model, [*ref, "--load-format", "dummy", *engine],
                "Qwen3-32B dims (dense), random weights (load_format=dummy)")
    if a.qwen36_27b:
        model, ref = qwen36_27b(work)
        return model, [*ref, *engine], "Qwen3.6-27B text dims, random weights (load_format=dummy), language_model_only"
    if a.model:
        return a.model, engine, a.model
    return (tiny_model(work), ["--dtype", "bfloat16", *engine],
            "tiny random Qwen3-Next (vllm_hidden.demo, 8 layers, hidden 256)")


def bench_model(work: Path, qwen36: bool, tiny_engine: list[str]) -> tuple[str, list[str], str, int, int]:
    """(model dir, engine args, description, longest prompt, vocab size): Qwen3.6-27B dims with
    random weights at the reference settings, or a tiny random Qwen3-Next with `tiny_engine`
    (both written under `work`, made if needed)."""
    work.mkdir(parents=True, exist_ok=True)
    if qwen36:
        model, engine = qwen36_27b(work)
        desc, max_len = "Qwen3.6-27B text dims (64 layers), random weights", 4095
    else:
        model, engine, desc, max_len = tiny_model(work), list(tiny_engine), "tiny random Qwen3-Next", 1024
    from transformers import AutoConfig

    return model, engine, desc, max_len, AutoConfig.from_pretrained(model).get_text_config().vocab_size


# -- sampling a process tree, the host ----------------------------------------------------------------
class _Sampler:
    """Calls `sample()` every `interval` seconds on a thread while the block runs."""

    def __init__(self, interval: float) -> None:
        self.interval = interval

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.wait(self.interval):
                self.sample()

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


class RssPeak(_Sampler):
    """Peak RSS of a process (default: this one) and its children (the engine core, workers)
    while the block runs, sampled at once and then every `interval` seconds."""

    def __init__(self, pid: int | None = None, interval: float = 0.1) -> None:
        import psutil

        super().__init__(interval)
        self.proc = psutil.Process(pid)
        self.peak = 0

    def tree(self) -> list:
        return [self.proc, *self.proc.children(recursive=True)]

    def sample(self) -> None:
        import psutil

        try:
            self.peak = max(self.peak, sum(p.memory_info().rss for p in self.tree()))
        except psutil.Error:
            pass

    def __enter__(self):
        self.sample()
        return super().__enter__()


class CpuSampler(_Sampler):
    """Busy cores of the whole host, sampled every 0.5 s."""

    def __init__(self) -> None:
        import psutil

        super().__init__(0.5)
        self.samples: list[float] = []
        self._ncpu = psutil.cpu_count() or 1

    def sample(self) -> None:
        import psutil

        self.samples.append(psutil.cpu_percent(None) / 100 * self._ncpu)

    def __enter__(self):
        import psutil

        psutil.cpu_percent(None)  # the first sample measures from here
        return super().__enter__()

    def summary(self) -> dict:
        s = self.samples or [0.0]
        return {"busy_cores_peak": round(max(s), 1), "busy_cores_mean": round(sum(s) / len(s), 1)}


# -- an engine in this process -------------------------------------------------------------------------
def start_engine(args: list[str], max_len: int, generate: bool = False):
    """A plain vLLM engine with extract's settings and runner; returns (engine, init seconds).
    `generate`: as extract --generate's (--enable-prefix-caching allowed)."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_hidden.engine import compat
    from vllm_hidden.engine.args import engine_args

    compat.spawn_on_cuda()  # the model runner is vLLM's choice, as for extract
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args(args[0], args[1:], max_len, prefix_cache=generate))
    return engine, time.perf_counter() - t0


FEEDS = ("window", "all")  # how a benchmark keeps prompts in a plain engine (see timed_loop)


def timed_loop(engine: Any, prompts: list[list[int]], params_for, feed: str = "window") -> tuple[float, list]:
    """Feed prompts with at most 2 x max_num_seqs in flight (`window`, as extract does) or every
    prompt up front (`all`, as vLLM's LLM.generate); returns the wall time to the last finished
    request and the finished outputs."""
    max_inflight = 2 * engine.vllm_config.scheduler_config.max_num_seqs if feed == "window" else len(prompts)
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


# -- output verification --------------------------------------------------------------------------------
def check_finite(t: Any) -> bool:
    """No NaN/inf in tensor `t`."""
    import torch

    if t.dtype == torch.bfloat16:  # NaN/inf <=> exponent bits all ones; no float copy of GBs
        return not bool(((t.view(torch.int16) & 0x7F80) == 0x7F80).any())
    return bool(torch.isfinite(t).all())


def verify_extract(out: Path, prompts: list[list[int]]) -> dict:
    """Every sample present once with its token ids, every shard's checksum, no NaN/inf."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors import safe_open

    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.storage.files import file_checksum
    from vllm_hidden.storage.manifest import Manifest

    m = Manifest.read(out)

    def sum_ok(s: Any) -> bool:
        return file_checksum(out / s.file) == s.blake3

    def finite(s: Any) -> bool:
        with safe_open(str(out / s.file), framework="pt") as f:  # fp8 values: their scales say it
            names = f.keys()  # a safetensors file, not a dict
            return all(check_finite(f.get_tensor(k)) for k in names if k.startswith(("hidden_states", "final_"))
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


# -- a case in a child process -----------------------------------------------------------------------------
def write_json_atomic(path: Path | str, obj: Any) -> None:
    """`obj` as JSON at `path`, replaced whole (a reader never sees half a file)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def child_spec(spec_path: str) -> tuple[dict, Any]:
    """In a case's child process: (its spec, save(result)), save writing the case's result file;
    called after every workload, so that a run cut short keeps what it measured."""
    spec = json.loads(Path(spec_path).read_text())
    return spec, lambda res: write_json_atomic(spec["result"], res)


def run_case(spec: dict, work: Path, script: str) -> dict:
    """Run one case, `python <script> --child <spec file>`, in a child process; sample the RSS
    of its process tree (the engine core and workers are its children) every 0.2 s, start to
    end (engine start and output verification included; each workload's run alone is
    `peak_rss_bytes_during_run`). Returns the result file the child saved, with
    `peak_rss_bytes`, `interrupted` and, if it failed, `error`."""
    import psutil

    spec_path = work / f"spec-{spec['case']}.json"
    spec_path.write_text(json.dumps(spec))
    Path(spec["result"]).unlink(missing_ok=True)
    log_path = work / f"log-{spec['case']}.txt"
    with open(log_path, "w") as log:  # the child has its own copy of the file
        proc = subprocess.Popen([sys.executable, script, "--child", str(spec_path)], stdout=log,
                                stderr=subprocess.STDOUT)
    interrupted = False
    with RssPeak(proc.pid, 0.2) as rss:
        try:
            rc = proc.wait()
        except (SystemExit, KeyboardInterrupt):  # timed out: keep what the case measured so far
            interrupted, rc = True, -15
        finally:  # take the engine processes down with us
            if proc.poll() is None:
                for p in [*rss.proc.children(recursive=True), rss.proc]:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
    res = json.loads(Path(spec["result"]).read_text()) if Path(spec["result"]).exists() else {}
    text = log_path.read_text(errors="replace")
    res["engine_log"] = {"file": log_path.name, **engine_log_facts(text)}
    if rc != 0:
        res["error"] = f"case process exited with {rc}; workloads listed were measured before that"
        print("\n".join(text.splitlines()[-60:]), flush=True)
    res["peak_rss_bytes"] = rss.peak
    res["interrupted"] = interrupted
    return res


_MEMORY_FACTS = {  # vLLM 0.26's start log (and ours): name -> pattern of one number
    "kv_cache_available_gib": r"Available KV cache memory: ([0-9.]+) GiB",
    "cuda_graph_estimate_gib": r"Estimated CUDA graph memory: ([0-9.]+) GiB total",
    "cuda_graph_pool_actual_gib": r"CUDA graph pool memory: ([0-9.]+) GiB \(actual\)",
    "cuda_graph_capture_gib": r"Graph capturing finished in [0-9.]+ secs?, took ([0-9.]+) GiB",
    "kv_cache_tokens": r"GPU KV cache size: ([0-9,]+) tokens",
    "max_concurrency": r"Maximum concurrency for [0-9,]+ tokens per request: ([0-9.]+)x",
    "capture_gib": r"the capture path holds ([0-9.]+) GiB",
    "mamba_blocks_short": r"exceeds available Mamba cache blocks \(([0-9]+)\)",
}


def engine_log_facts(text: str) -> dict:
    """From a vLLM engine's log: the model's memory per worker (GiB, "Model loading took"), the
    linear kernels it selected ("Selected <kernel> for <method>"), each once, and what the start
    measured of memory (`_MEMORY_FACTS`: the last value of each; with VLLM_LOGGING_LEVEL=DEBUG the
    CUDA-graph estimate per mode: first capture and per-graph MiB, graphs)."""
    mem = [float(x) for x in re.findall(r"Model loading took ([0-9.]+) GiB", text)]
    kernels = sorted(set(re.findall(r"(?:Selected|Using) (\w+Kernel\w*) for (\w+)", text)))
    facts: dict = {"model_memory_gib": mem, "linear_kernels": [f"{k} for {m}" for k, m in kernels]}
    for name, pattern in _MEMORY_FACTS.items():
        found = re.findall(pattern, text)
        if found:
            facts[name] = float(found[-1].replace(",", ""))
    modes = re.findall(r"Estimated (\w+) CUDA graph memory: ([0-9.]+) MiB first-capture \+ \(([0-9]+)-1\) .{1,3} "
                       r"([0-9.]+) MiB per-graph", text)
    if modes:
        facts["cuda_graph_estimate_by_mode"] = {m: {"first_mib": float(a), "graphs": int(n), "per_graph_mib": float(b)}
                                                for m, a, n, b in modes}
    facts["capture_buffers_reallocated"] = "capture buffers were reallocated" in text
    return facts


# -- the CLI as a process ----------------------------------------------------------------------------------
def run_cli(argv: list[str], log: Path, gpu: str | None = None) -> subprocess.Popen:
    """`python -m vllm_hidden.cli <argv>`, stdout piped, stderr to `log`, on GPU `gpu` if given."""
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
    with open(log, "w") as f:  # the child has its own copy of the file
        return subprocess.Popen([sys.executable, "-m", "vllm_hidden.cli", *argv], stdout=subprocess.PIPE, stderr=f,
                                text=True, env=env)


def last_json(text: str) -> dict:
    """The last line of `text` that is a JSON object (the CLI's report), else {}."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def finish(proc: subprocess.Popen, t0: float, log: Path) -> dict:
    """Wait for a run_cli process: rc, wall seconds since `t0`, the CLI's JSON, the log's tail
    if it failed, and the engine start lines."""
    out, _ = proc.communicate()
    cli = last_json(out)
    res = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 2), "cli": cli}
    if cli.get("errors"):  # an extract must have run every prompt, or its first-sample time means nothing
        res["rc"] = res["rc"] or 3
    if proc.returncode:
        res["log_tail"] = log.read_text(errors="replace")[-2000:]
    text = out + log.read_text(errors="replace")  # vLLM's processes log to stdout, ours to stderr
    lines = [ln for ln in text.splitlines() if "engine started" in ln or "waiting for it" in ln]
    res["log_lines"] = [ln[-400:] for ln in lines]
    res["engine_log"] = engine_log_facts(text)  # start-up memory: the model's, CUDA graphs', KV cache, capture's
    return res


# -- provenance ------------------------------------------------------------------------------------------------
def command_line(script: str) -> str:
    """How this run was started: `python scripts/<script's name> <arguments>`."""
    return " ".join(["python", f"scripts/{Path(script).name}", *sys.argv[1:]])


def git(*args: str) -> str:
    """`git <args>` in the checkout; its stdout, stripped."""
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()


def git_revision() -> str:
    return git("rev-parse", "HEAD")


def git_changes(*paths: str, untracked: bool = True) -> list[str]:
    """`git status --porcelain` lines: changes to `paths` (default: all), untracked files too unless told."""
    return git("status", "--porcelain", *([] if untracked else ["--untracked-files=no"]),
               *(["--", *paths] if paths else [])).splitlines()


def source_fingerprint(*scripts: str) -> str:
    """What ran, whatever the checkout's history: BLAKE3 over the package's sources, this
    module and the given scripts (each with its path)."""
    import blake3

    h = blake3.blake3()
    files = {*(ROOT / "vllm_hidden").rglob("*.py"), Path(__file__).resolve(), *(Path(s).resolve() for s in scripts)}
    for f in sorted(files):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def versions(*names: str) -> dict[str, str]:
    """Versions of the named modules ("python": the interpreter's), in the order given."""
    import importlib

    return {n: platform.python_version() if n == "python" else importlib.import_module(n).__version__ for n in names}


def gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def machine() -> dict[str, Any]:
    """CPUs, and the first GPU's name (None without one)."""
    import torch

    return {"cpus": os.cpu_count(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def host_facts() -> dict[str, Any]:
    """Host name, CPUs and their model, memory, kernel, Python and torch versions."""
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), None)
    mem = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal:")), None)
    return {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "cpu_model": cpu, "memory_bytes": mem,
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__}


def engine_provenance(*scripts: str) -> dict[str, Any]:
    """git_revision, source_blake3 (package, this module, `scripts`), versions of vLLM, torch
    and Python, and the machine (CPUs, GPU)."""
    return {"git_revision": git_revision(), "source_blake3": source_fingerprint(*scripts),
            "versions": versions("vllm", "torch", "python"), "machine": machine()}


# -- result files ---------------------------------------------------------------------------------------------
def stamp(fmt: str = "%Y%m%d-%H%M%S") -> str:
    return time.strftime(fmt)


def result_path(given: str | Path | None, name: str) -> Path:
    """--result if given, else benchmarks/results/<name>."""
    return Path(given) if given else RESULTS / name


def load_result(path: Path, append: bool, empty: dict) -> dict:
    """The result to add to: `path`'s with --append (where it exists), else `empty`."""
    return json.loads(path.read_text()) if append and path.exists() else empty


def add_command(result: dict, script: str) -> None:
    """This run's command line appended to the result's `commands`."""
    result.setdefault("commands", []).append(command_line(script))


def write_json(path: Path | str, obj: Any, end: str = "") -> None:
    """`obj` as indented JSON at `path`, its folder made if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + end)
