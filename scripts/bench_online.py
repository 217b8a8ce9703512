"""Online hidden states for speculators' trainer: plain vLLM vs vLLM's own hidden-states connector
vs `vllm-hidden serve`, side by side on one machine, same prompts, same client.

    # GPU host, Qwen3.6-27B text dims (random weights) at the reference settings, all six default cases
    # (one server start each, ~4 min cold: split them over device calls of at most 10 minutes):
    python scripts/bench_online.py --cases plain,vllm-connector
    python scripts/bench_online.py --cases ours,plain-fp8w          # merged into the same --output
    # CPU smoke test, tiny random Qwen3-Next (only `plain` and `ours` can run on CPU):
    VLLM_CPU_KVCACHE_SPACE=1 python scripts/bench_online.py --tiny --samples 64 --cases plain,ours
    # on the GPU host with the kit (installs the project, speculators and hs-connectors first):
    OUT=... CASES=plain,vllm-connector bash scripts/gpu_online.sh

Cases (each its own server process, started, measured, stopped; the GPU memory freed before the next):
  plain            `vllm serve MODEL <engine args>`: nothing captured, the baseline of the ratios
  vllm-connector   `vllm serve MODEL --speculative_config {extract_hidden_states, aux ids}
                   --kv_transfer_config {ExampleHiddenStatesConnector, shared_storage_path DIR} <engine args>`,
                   as speculators' scripts/launch_vllm.py builds it (the kv config from hs_connectors'
                   FileBackend.build_kv_transfer_config; aux ids [2, N//2, N-3, N] unless --aux-ids)
  ours             `vllm-hidden serve MODEL` with the same two arguments and engine args (it writes the same
                   files itself; --max-unread-bytes is passed to it)
  *-fp8w           the same with FP8 weights (vLLM's online quantization, --quantization fp8)
  vllm-connector-fp8conn / ours-fp8conn  (optional, not in the default list) hs_connectors' FP8Backend config:
                   FP8HiddenStatesConnector (kv_connector_module_path hs_connectors.fp8_hidden_states_connector),
                   states stored as float8_e4m3fn with one scale per token
  vllm-connector-mooncake / ours-mooncake  (optional) hs_connectors' MooncakeBackend config: vLLM with its
                   MooncakeHiddenStatesConnector, or `vllm-hidden serve` putting the objects itself; a
                   `mooncake_master` on free 127.0.0.1 ports per case, TCP over loopback, the server contributing
                   --mooncake-segment-gib; the client reads each object with hs_connectors' MooncakeTransfer from
                   the manifest in the response and removes it (needs mooncake-transfer-engine beside vLLM)
Engine args, every case: the model's (27B: benchlib.REFERENCE_27B, --load-format dummy, --language-model-only;
--tiny: bf16, eager, and on CUDA the Triton GDN prefill) plus --max-model-len 4096 and --skip-tokenizer-init (the
27B config dir has no tokenizer; the prompts are token ids) and --engine-arg.
`plain` and `vllm-connector` run with VLLM_PLUGINS="" (vllm-hidden's plugin not loaded: vLLM as a speculators
user has it). Without CUDA, the vllm-connector cases (vLLM's connector needs a CUDA device: its mamba align
kernel is Triton-only, its pinned buffers need an accelerator) and the FP8-weight cases (vllm-cpu has no FP8
GEMM kernels) are skipped with a note.

The client is speculators' own `generate_hidden_states_async` (speculators.data_generation.vllm_client),
unmodified: a completion with the prompt's token ids, max_tokens=1, return_token_ids, its timeout and retries
(it retries any error, HTTP 503 included, after 2, 4, 8 s, ignoring Retry-After; the retries are counted from
its log). For each response the client then does what speculators' trainer does with the file: waits on
`<path>.lock` if present (speculators' `wait_for_lock_async`), loads the file (safetensors), checks its
token_ids are the prompt and its hidden_states [tokens, layers, hidden], notes its size, deletes it (load and
delete in a thread pool, so the client is not the bottleneck). `plain` sends the same request through the
OpenAI client and checks the returned prompt_token_ids. At most --concurrency requests in flight (an asyncio
semaphore; a response's file handling runs outside it, as in speculators' data generation). --warmup requests
first, untimed (Triton kernels are compiled and autotuned per shape on first use, and each server may have its
own Triton cache: too short a warmup times that compilation); --repeats timed passes, the median reported.
Prompts: W-chat (benchlib.WORKLOADS: lognormal lengths, median 384, 32..2048, random tokens).

Per case: samples, prompt tokens, wall seconds (first timed request sent to last response handled), samples/s,
tokens/s, bytes of the files written, server start seconds, request latencies, errors and retries, the ratio of
samples/s and tokens/s to `plain` with the same weights and of ours to vllm-connector (where both cases are in
the result file). The files of the first --compare prompts are kept under the work dir; where a vllm-connector
case and its ours case both kept theirs (same work dir: same call, or a warm machine), the states are compared:
token ids equal, shapes and dtypes, and per layer the relative L2 difference (float32; FP8 files dequantized
with hs_connectors' dequantize_fp8_tensor), its maximum over the prompts in the result (bf16 noise ~1e-2).
Results merge into --output if it exists (cases from several device calls in one file; each run's command,
versions and GPU names are kept, and every case names its run).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import benchlib
from benchlib import WORKLOADS

DEFAULT_CASES = ("plain", "vllm-connector", "ours", "plain-fp8w", "vllm-connector-fp8w", "ours-fp8w")
OPTIONAL_CASES = ("vllm-connector-fp8conn", "ours-fp8conn", "vllm-connector-mooncake", "ours-mooncake")
FP8_WEIGHTS = ["--quantization", "fp8"]  # as scripts/bench.py: vLLM's online per-tensor FP8
TINY_ENGINE = ["--dtype", "bfloat16", "--enforce-eager"]
CUDA_ENGINE = ["--gdn-prefill-backend", "triton"]  # the kit has no flashinfer (the default GDN prefill on Hopper)
# plain vLLM launched as speculators' launch_vllm.py does; vllm-cpu's distribution is not named `vllm`, which
# vLLM's CLI asks for its version: there the same module runs with that lookup answered as vLLM's platform
# detection answers it ("<vllm-cpu version>+cpu")
VLLM_CLI = ["-m", "vllm.entrypoints.cli.main"]
VLLM_CPU_SHIM = ("import importlib.metadata as m, runpy, sys; v = m.version; "
                 "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); sys.argv[0] = 'vllm'; "
                 "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')")


# -- cases ----------------------------------------------------------------------------------------
def parse_case(name: str) -> dict:
    """'ours-fp8w' -> {"name", "kind": plain | vllm-connector | ours, "weights": bf16 | fp8w,
    "connector": file | fp8 | mooncake | None}."""
    for kind in ("vllm-connector", "ours", "plain"):
        if name == kind or name.startswith(kind + "-"):
            tags = name[len(kind):].split("-")[1:]
            break
    else:
        raise ValueError(name)
    conn = set(tags) & {"fp8conn", "mooncake"}
    if set(tags) - {"fp8w", "fp8conn", "mooncake"} or len(set(tags)) != len(tags) or len(conn) > 1 or (
            kind == "plain" and conn):
        raise ValueError(name)
    connector = {"fp8conn": "fp8", "mooncake": "mooncake"}[conn.pop()] if conn else "file"
    return {"name": name, "kind": kind, "weights": "fp8w" if "fp8w" in tags else "bf16",
            "connector": None if kind == "plain" else connector}


def skip_reason(case: dict, cuda: bool) -> str | None:
    if cuda:
        return None
    if case["kind"] == "vllm-connector":
        return ("no CUDA: vLLM's ExampleHiddenStatesConnector cannot run on CPU (its mamba align kernel is "
                "Triton-only, its pinned buffers need an accelerator)")
    if case["weights"] == "fp8w":
        return "no CUDA: vllm-cpu has no FP8 GEMM kernels (--quantization fp8)"
    return None


def partner(name: str, kind: str) -> str:
    """The case of `kind` with the same tags: partner('ours-fp8w', 'plain') == 'plain-fp8w'."""
    c = parse_case(name)
    tags = name[len(c["kind"]):]
    if kind == "plain":
        tags = "-fp8w" if c["weights"] == "fp8w" else ""
    return kind + tags


def mooncake_args(master: str, segment_gib: float) -> argparse.Namespace:
    """speculators' --mooncake-* arguments (launch and train): TCP over loopback, P2PHANDSHAKE."""
    return argparse.Namespace(mooncake_master=master, mooncake_metadata_server="P2PHANDSHAKE",
                              mooncake_protocol="tcp", mooncake_device="", mooncake_global_segment_gib=segment_gib,
                              mooncake_local_buffer_gib=2.0, mooncake_writer_threads=4)


def capture_args(aux_ids: list[int], hs_dir: Path, connector: str, master: str | None = None,
                 segment_gib: float = 16.0) -> tuple[list[str], dict]:
    """speculators' launch_vllm.py arguments: --speculative_config and --kv_transfer_config, the latter
    built by hs_connectors' own backend. Returns (argv, kv config)."""
    from hs_connectors.transfer import FileBackend, FP8Backend, MooncakeBackend

    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux_ids}}}
    if connector == "mooncake":  # every Mooncake client of this bench on loopback
        os.environ.setdefault("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
        kv = MooncakeBackend.build_kv_transfer_config(mooncake_args(master, segment_gib))
    else:
        backend = FP8Backend if connector == "fp8" else FileBackend
        kv = backend.build_kv_transfer_config(argparse.Namespace(hidden_states_path=str(hs_dir)))
    return ["--speculative_config", json.dumps(spec), "--kv_transfer_config", json.dumps(kv)], kv


class MooncakeMaster:
    """`mooncake_master` on free 127.0.0.1 ports for one case (objects live in the clients: the
    server's segment), and the trainer's reader: hs_connectors' MooncakeTransfer."""

    def __init__(self, log: Path, segment_gib: float) -> None:
        exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
        rpc, metrics = free_port(), free_port()
        self.address = f"127.0.0.1:{rpc}"
        self.proc = subprocess.Popen([exe, f"-rpc_port={rpc}", "-rpc_address=127.0.0.1", f"-metrics_port={metrics}",
                                      "-metrics_host=127.0.0.1", "-enable_metric_reporting=false"],
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", rpc), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"mooncake_master did not start; log {log}") from None
                time.sleep(0.1)
        self.segment_gib = segment_gib
        self.transfer = None

    def reader(self):
        if self.transfer is None:
            os.environ.setdefault("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
            from hs_connectors.transfer import MooncakeBackend

            self.transfer = MooncakeBackend.from_train_args(mooncake_args(self.address, 0.0625), "")
            self.transfer.setup()
        return self.transfer

    def stop(self) -> None:
        if self.transfer is not None:
            self.transfer.store._require_store().close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def server_command(case: dict, model: str, engine: list[str], hs_dir: Path, aux_ids: list[int],
                   a: argparse.Namespace, master: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) of the case's server."""
    args = [*engine, *(FP8_WEIGHTS if case["weights"] == "fp8w" else [])]
    cap = capture_args(aux_ids, hs_dir, case["connector"], master, a.mooncake_segment_gib)[0] \
        if case["connector"] else []
    if case["kind"] == "ours":
        budget = ["--max-unread-bytes", str(a.max_unread_bytes)] if a.max_unread_bytes else []
        return [sys.executable, "-m", "vllm_hidden.cli", "serve", model, *cap, *args, *budget], {}
    try:
        importlib.metadata.version("vllm")
        launcher = VLLM_CLI
    except importlib.metadata.PackageNotFoundError:
        launcher = ["-c", VLLM_CPU_SHIM]
    env = {} if a.keep_plugins else {"VLLM_PLUGINS": ""}
    return [sys.executable, *launcher, "serve", model, *cap, *args], env


# -- a server process -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_used_mib() -> list[int] | None:
    """Memory in use on each GPU (nvidia-smi), None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(x) for x in out.split()]


class Server:
    """A server in its own session (process group) on 127.0.0.1:<free port>, output to `log`."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [*argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {**os.environ, **env}
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        """Start it and wait for GET /health; returns the seconds that took."""
        t0 = time.perf_counter()
        with open(self.log, "w") as f:  # the child has its own copy of the file
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before answering; log {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"server did not answer /health in {timeout:.0f} s; log {self.log}")
            time.sleep(1)

    def model_id(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to its process group, SIGKILL after `grace` s; then every process it started."""
        import psutil

        if self.proc is None or (self.proc.poll() is not None and not _alive_group(self.proc.pid)):
            return
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for p in tree:  # any that left the group
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(tree, timeout=grace)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _alive_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_gpu_free(baseline: list[int] | None, timeout: float = 180) -> float | None:
    """Wait until every GPU uses at most 1 GiB more than before the first server; the seconds
    waited (None without nvidia-smi; the timeout's value if it never got there)."""
    if baseline is None:
        return None
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        used = gpu_used_mib()
        if used is None or all(u <= b + 1024 for u, b in zip(used, baseline)):
            return round(time.perf_counter() - t0, 1)
        time.sleep(1)
    print(f"bench_online: GPU memory still in use after {timeout:.0f} s: {gpu_used_mib()} MiB", flush=True)
    return timeout


# -- the client -----------------------------------------------------------------------------------
@functools.cache
def speculators_client() -> tuple[Any, str]:
    """(speculators.data_generation.vllm_client, how it was loaded). Where the package's own
    __init__ cannot be imported (a host without its training dependencies: datasets, ...), the
    same installed file is loaded by itself: it needs only openai."""
    try:
        from speculators.data_generation import vllm_client

        return vllm_client, "import speculators.data_generation.vllm_client"
    except Exception as e:  # noqa: BLE001 - any failure of the package's __init__
        from importlib import metadata, util

        path = str(metadata.distribution("speculators").locate_file("speculators/data_generation/vllm_client.py"))
        spec = util.spec_from_file_location("speculators.data_generation.vllm_client", path)
        mod = util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, f"loaded from {path} (importing the package failed: {type(e).__name__}: {e})"


class RetryCount(logging.Handler):
    """Counts speculators' 'Request aborted (attempt i/n) ... Retrying' warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Request aborted"):
            self.n += 1
            if len(self.first) < 3:
                self.first.append(record.getMessage()[:300])


def consume_object(transfer, params: dict, prompt: list[int], num_layers: int, keep: Path | None) -> tuple[int, str]:
    """What speculators' trainer does with a Mooncake object: read it from the manifest (its
    MooncakeTransfer), check it, remove it. Returns (bytes, dtype)."""
    d = transfer.get_generated(params)
    hs, tok = d["hidden_states"], d["token_ids"]
    if tok.tolist() != prompt:
        raise ValueError(f"{params['handle']}: token_ids differ from the prompt ({tok.shape[0]} vs {len(prompt)})")
    if hs.dim() != 3 or hs.shape[0] != len(prompt) or hs.shape[1] != num_layers:
        raise ValueError(f"{params['handle']}: hidden_states {list(hs.shape)}, "
                         f"expected [{len(prompt)}, {num_layers}, H]")
    if keep is not None:
        from safetensors.torch import save_file

        save_file({"hidden_states": hs.contiguous(), "token_ids": tok.contiguous()}, str(keep))
    transfer.delete(params["handle"])
    return int(params["metadata"]["total_aligned_bytes"]), str(hs.dtype).removeprefix("torch.")


def consume(path: str, prompt: list[int], num_layers: int, keep: Path | None) -> tuple[int, str]:
    """What the trainer does with a file: load it, check it, delete it. Returns (bytes, dtype)."""
    from safetensors.torch import load_file

    d = load_file(path)
    hs, tok = d["hidden_states"], d["token_ids"]
    if tok.tolist() != prompt:
        raise ValueError(f"{path}: token_ids differ from the prompt ({tok.shape[0]} vs {len(prompt)} tokens)")
    if hs.dim() != 3 or hs.shape[0] != len(prompt) or hs.shape[1] != num_layers:
        raise ValueError(f"{path}: hidden_states {list(hs.shape)}, expected [{len(prompt)}, {num_layers}, H]")
    size = os.path.getsize(path)
    if keep is not None:
        shutil.copyfile(path, keep)
    os.remove(path)
    return size, str(hs.dtype).removeprefix("torch.")


async def run_requests(url: str, model: str, prompts: list[list[int]], case: dict, a: argparse.Namespace,
                       num_layers: int, keep_dir: Path | None, reader=None) -> dict:
    """Send every prompt (at most a.concurrency in flight) and handle each response as the
    trainer does; returns the wall time, bytes, latencies and errors."""
    import openai

    spec_client, _ = speculators_client()
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(a.client_threads, thread_name_prefix="bench-load"))
    sem = asyncio.Semaphore(a.concurrency)
    lat: list[float] = []
    nbytes, dtypes, errors = [0], set(), []

    async def one(i: int, prompt: list[int]) -> None:
        try:
            async with sem:
                t = time.perf_counter()
                if case["kind"] == "plain":
                    r = await client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                                        extra_body={"return_token_ids": True},
                                                        timeout=a.request_timeout)
                    if getattr(r.choices[0], "prompt_token_ids", None) != prompt:
                        raise ValueError("response's prompt_token_ids differ from the prompt")
                    lat.append(time.perf_counter() - t)
                    return
                path, params = await spec_client.generate_hidden_states_async(
                    client, model, {"input_ids": prompt}, timeout=a.request_timeout, max_retries=a.max_retries)
                lat.append(time.perf_counter() - t)
            keep = keep_dir / f"{i}.safetensors" if keep_dir is not None and i < a.compare else None
            if reader is not None:  # Mooncake: the manifest in kv_transfer_params
                size, dtype = await asyncio.to_thread(consume_object, reader, params, prompt, num_layers, keep)
            else:
                if os.path.exists(path + ".lock"):
                    await spec_client.wait_for_lock_async(path + ".lock")
                size, dtype = await asyncio.to_thread(consume, path, prompt, num_layers, keep)
            nbytes[0] += size
            dtypes.add(dtype)
        except Exception as e:  # noqa: BLE001 - counted and reported; the others go on
            errors.append(f"prompt {i}: {type(e).__name__}: {e}"[:400])

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    lat.sort()

    def q(f: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(f * len(lat)))], 3) if lat else None

    return {"wall_s": wall, "bytes": nbytes[0], "dtypes": sorted(dtypes), "errors": len(errors),
            "error_messages": errors[:5], "latency_s": {"p50": q(0.5), "p90": q(0.9), "max": q(1.0)}}


def timed_passes(url: str, model: str, prompts: list[list[int]], case: dict, a: argparse.Namespace,
                 num_layers: int, keep_dir: Path | None, reader=None) -> dict:
    """run_requests a.repeats times (the files of the first pass kept): its result with the median
    pass's wall time, every pass's, and the errors of all passes."""
    runs = [asyncio.run(run_requests(url, model, prompts, case, a, num_layers, keep_dir if i == 0 else None,
                                     reader)) for i in range(a.repeats)]
    walls = [r["wall_s"] for r in runs]
    return {**runs[0], "wall_s": statistics.median(walls), "wall_s_each": [round(w, 3) for w in walls],
            "errors": sum(r["errors"] for r in runs),
            "error_messages": [m for r in runs for m in r["error_messages"]][:5]}


# -- one case -------------------------------------------------------------------------------------
def run_case(case: dict, ctx: dict, a: argparse.Namespace) -> dict:
    """Start the case's server, warm it up, time the prompts, stop it."""
    work: Path = ctx["work"]
    hs_dir = Path(a.hs_dir or work / "hs") / case["name"]
    shutil.rmtree(hs_dir, ignore_errors=True)
    hs_dir.mkdir(parents=True)
    keep_dir = None
    if case["kind"] != "plain" and a.compare:
        keep_dir = work / "keep" / case["name"]
        shutil.rmtree(keep_dir, ignore_errors=True)
        keep_dir.mkdir(parents=True)
    log = work / f"server-{case['name']}.log"
    master = MooncakeMaster(work / f"mooncake-{case['name']}.log", a.mooncake_segment_gib) \
        if case["connector"] == "mooncake" else None
    argv, env = server_command(case, ctx["model"], ctx["engine"], hs_dir, ctx["aux_ids"], a,
                               master.address if master else None)
    server = Server(argv, env, log)
    res: dict[str, Any] = {"kind": case["kind"], "weights": case["weights"], "connector": case["connector"],
                           "server_argv": server.argv, "server_env": env, "log": str(log)}
    retries = RetryCount()
    logging.getLogger("speculators.data_generation.vllm_client").addHandler(retries)
    try:
        res["server_start_s"] = round(server.start(a.start_timeout), 1)
        model = server.model_id()
        print(f"bench_online: {case['name']}: up in {res['server_start_s']} s", flush=True)
        reader = master.reader() if master else None
        warm = asyncio.run(run_requests(server.url, model, ctx["warmup_prompts"], case, a, len(ctx["aux_ids"]), None,
                                        reader))
        res["warmup"] = {"requests": len(ctx["warmup_prompts"]), "wall_s": round(warm["wall_s"], 2),
                         "errors": warm["errors"], "retries": retries.n}
        if warm["errors"] == len(ctx["warmup_prompts"]):  # no use timing a server that answers nothing
            raise RuntimeError(f"every warmup request failed, e.g. {warm['error_messages'][:1]}")
        retries.n, retries.first = 0, []
        r = timed_passes(server.url, model, ctx["prompts"], case, a, len(ctx["aux_ids"]), keep_dir, reader)
        left = [f.name for f in hs_dir.iterdir()]
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode} during the run")
    except Exception as e:  # noqa: BLE001 - recorded with the log's tail; the next case runs
        res["error"] = f"{type(e).__name__}: {e}"
        res["log_tail"] = log.read_text(errors="replace")[-3000:] if log.exists() else None
        return res
    finally:  # SIGTERM (SystemExit) too: the server goes down with us
        logging.getLogger("speculators.data_generation.vllm_client").removeHandler(retries)
        server.stop()
        if master is not None:
            master.stop()
        res["gpu_free_wait_s"] = wait_gpu_free(ctx["gpu_baseline"])
        if log.exists():
            res["engine_log"] = benchlib.engine_log_facts(log.read_text(errors="replace"))
    n, tokens = len(ctx["prompts"]) - r["errors"] // a.repeats, ctx["tokens"]
    res.update({"samples": len(ctx["prompts"]), "prompt_tokens": tokens, "wall_s": round(r["wall_s"], 3),
                "wall_s_each_pass": r["wall_s_each"],
                "samples_per_s": round(n / r["wall_s"], 2), "tokens_per_s": round(tokens / r["wall_s"], 1),
                "bytes_written": r["bytes"], "hidden_states_dtypes": r["dtypes"], "latency_s": r["latency_s"],
                "errors": r["errors"], "error_messages": r["error_messages"], "retries": retries.n,
                "retry_messages": retries.first, "files_left_in_dir": len(left)})
    res["valid"] = r["errors"] == 0  # only valid cases enter the ratios
    if r["errors"]:
        res["note"] = "requests failed: samples_per_s counts the others, tokens_per_s all prompt tokens"
    if keep_dir is not None:
        (keep_dir / "kept.json").write_text(json.dumps({"run": ctx["run_id"], "lengths": [
            len(p) for p in ctx["prompts"][:a.compare]]}))
    return res


# -- states comparison ----------------------------------------------------------------------------
def load_states(path: Path) -> tuple[Any, Any, str]:
    """(hidden_states as float32, token_ids, stored dtype); FP8 files dequantized as hs_connectors' FP8Transfer."""
    import torch
    from safetensors.torch import load_file

    d = load_file(str(path))
    hs = d["hidden_states"]
    dtype = str(hs.dtype).removeprefix("torch.")
    if "hidden_states_scales" in d:
        from hs_connectors.fp8_utils import dequantize_fp8_tensor

        hs = dequantize_fp8_tensor(hs, d["hidden_states_scales"], dtype=torch.float32)
    return hs.float(), d["token_ids"], dtype


def compare_states(dir_a: Path, dir_b: Path, k: int) -> dict:
    """Per kept prompt: token ids equal, shapes/dtypes, per-layer relative L2 of b against a."""
    per, worst = [], None
    for i in range(k):
        fa, fb = dir_a / f"{i}.safetensors", dir_b / f"{i}.safetensors"
        if not (fa.exists() and fb.exists()):
            per.append({"prompt": i, "missing": [str(f) for f in (fa, fb) if not f.exists()]})
            continue
        (ha, ta, da), (hb, tb, db) = load_states(fa), load_states(fb)
        row = {"prompt": i, "tokens": int(ta.shape[0]), "token_ids_equal": ta.tolist() == tb.tolist(),
               "shapes": [list(ha.shape), list(hb.shape)], "dtypes": [da, db]}
        if ha.shape == hb.shape:
            rel = [float((hb[:, j] - ha[:, j]).norm() / ha[:, j].norm().clamp_min(1e-30)) for j in range(ha.shape[1])]
            row["rel_l2_per_layer"] = [round(x, 6) for x in rel]
            worst = rel if worst is None else [max(x, y) for x, y in zip(worst, rel)]
        per.append(row)
    ok = all(r.get("token_ids_equal") and "rel_l2_per_layer" in r and r["dtypes"][0] == r["dtypes"][1] for r in per)
    return {"prompts": per, "max_rel_l2_per_layer": [round(x, 6) for x in worst] if worst else None,
            "all_match_in_tokens_shapes_dtypes": ok}


def update_comparisons(result: dict, work: Path, k: int) -> None:
    """Compare every vllm-connector case's kept files with its ours partner's, where both are here."""
    for name in result["cases"]:
        if parse_case(name)["kind"] != "vllm-connector":
            continue
        other = partner(name, "ours")
        da, db = work / "keep" / name, work / "keep" / other
        if not ((da / "kept.json").exists() and (db / "kept.json").exists()):
            continue
        ka, kb = json.loads((da / "kept.json").read_text()), json.loads((db / "kept.json").read_text())
        if ka["lengths"] != kb["lengths"]:
            continue  # other prompts (another workload or --samples): nothing to compare
        c = compare_states(da, db, min(k, len(ka["lengths"])))
        result.setdefault("comparisons", {})[f"{name} vs {other}"] = {
            "runs": [ka["run"], kb["run"]], "aux_layer_ids": result["aux_layer_ids"], **c}


# -- the result -----------------------------------------------------------------------------------
def summarize(result: dict) -> None:
    """Ratios to plain with the same weights, and ours to vllm-connector, where both are present."""
    cases, runs = result["cases"], result["runs"]

    def card(c: dict) -> list:
        return runs[c["run"]]["gpu_names"] if c.get("run") is not None and c["run"] < len(runs) else []

    for name, c in cases.items():
        for key in [k for k in c if k.startswith("ratio_")]:  # from an earlier merge: recomputed here
            del c[key]
        if not c.get("valid"):
            continue
        refs = {"ours": (("plain", "to_plain"), ("vllm-connector", "to_vllm_connector")),
                "vllm-connector": (("plain", "to_plain"),)}.get(c["kind"], ())
        for kind, key in refs:
            ref = cases.get(partner(name, kind))
            if ref and ref.get("valid"):
                c[f"ratio_{key}"] = {"case": partner(name, kind),
                                     "samples_per_s": round(c["samples_per_s"] / ref["samples_per_s"], 4),
                                     "tokens_per_s": round(c["tokens_per_s"] / ref["tokens_per_s"], 4),
                                     "same_run": c.get("run") == ref.get("run"), "same_card": card(c) == card(ref)}


def describe(name: str, c: dict) -> str:
    if "skipped" in c:
        return f"{name}: skipped ({c['skipped']})"
    if "samples_per_s" not in c:
        return f"{name}: failed: {c.get('error')}"
    s = (f"{name}: {c['samples_per_s']} samples/s, {c['tokens_per_s']} tok/s, {c['wall_s']} s, "
         f"{c['bytes_written'] / 1e9:.2f} GB, start {c['server_start_s']} s, errors {c['errors']}, "
         f"retries {c['retries']}")
    for key in ("ratio_to_plain", "ratio_to_vllm_connector"):
        if key in c:
            s += f", {key} {c[key]['tokens_per_s']}"
    return s + (f"; first error: {c['error_messages'][0]}" if c["errors"] else "")


def setup(a: argparse.Namespace, work: Path, cuda: bool) -> dict:
    """Model, engine args, aux ids, prompts."""
    from transformers import AutoConfig

    if a.tiny:
        model, engine, desc = benchlib.tiny_model(work), list(TINY_ENGINE), "tiny random Qwen3-Next (8 layers)"
        engine += CUDA_ENGINE if cuda else []
    else:
        model, engine = benchlib.qwen36_27b(work, a.num_layers)
        desc = (f"Qwen3.6-27B text dims ({a.num_layers} layers), random weights (load_format=dummy), "
                "language_model_only")
    engine += ["--max-model-len", str(a.max_model_len), "--skip-tokenizer-init", *a.engine_arg]
    text = AutoConfig.from_pretrained(model).get_text_config()
    n = text.num_hidden_layers
    aux = [int(x) for x in a.aux_ids.split(",")] if a.aux_ids else [2, n // 2, n - 3, n]
    spec = {**WORKLOADS["w-chat"], "samples": a.samples or (64 if a.tiny else WORKLOADS["w-chat"]["samples"])}
    prompts = benchlib.make_prompts(spec, text.vocab_size)
    warm = benchlib.make_prompts({**spec, "samples": a.warmup}, text.vocab_size, seed=1)
    return {"work": work, "model": model, "engine": engine, "model_desc": desc, "aux_ids": aux, "prompts": prompts,
            "warmup_prompts": warm, "tokens": sum(map(len, prompts)), "workload": {"name": "w-chat", **spec, "seed": 0},
            "num_layers": n}


def load_or_new(path: Path, ctx: dict, a: argparse.Namespace) -> dict:
    """The result file to merge into (refused if it measured another model, engine or workload), or a new one."""
    head = {"benchmark": "online hidden states for speculators: plain vLLM vs vLLM's connector vs vllm-hidden serve",
            "model": ctx["model_desc"], "engine_args": ctx["engine"], "aux_layer_ids": ctx["aux_ids"],
            "workload": {**ctx["workload"], "tokens": ctx["tokens"]}, "concurrency": a.concurrency}
    if not path.exists():
        return {**head, "runs": [], "cases": {}, "comparisons": {}}
    old = json.loads(path.read_text())
    for k, v in head.items():
        if old.get(k) != v:
            raise SystemExit(f"bench_online: {path} has {k}={old.get(k)!r}, this run {v!r}: use another --output")
    return old


def run_record(a: argparse.Namespace, cuda: bool, client_how: str) -> dict:
    from importlib import metadata

    def dist(n: str) -> str | None:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            return None

    code = "import json, benchlib; print(json.dumps(benchlib.gpu_names()))"  # CUDA in a child: none held here
    names = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True,
                           text=True).stdout.strip()
    return {"started": benchlib.stamp("%Y-%m-%d %H:%M:%S"), "command": benchlib.command_line(__file__),
            "git_revision": benchlib.git_revision(), "git_dirty": bool(benchlib.git_changes(untracked=False)),
            "source_blake3": benchlib.source_fingerprint(__file__), "host": socket.gethostname(),
            "gpu_names": json.loads(names) if names.startswith("[") else [], "cuda": cuda,
            "versions": {**benchlib.versions("torch", "python"),
                         **{n: dist(n) for n in ("vllm", "vllm-cpu", "speculators", "hs-connectors", "openai",
                                                 "safetensors")}},
            "speculators_client": client_how, "cases": [], "max_unread_bytes": a.max_unread_bytes}


def main() -> None:
    ap = benchlib.parser(__doc__)
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help=f"comma list of {DEFAULT_CASES + OPTIONAL_CASES} (default: the first six)")
    ap.add_argument("--tiny", action="store_true", help="tiny random Qwen3-Next (CPU smoke test) instead of the 27B")
    ap.add_argument("--num-layers", type=int, default=64,
                    help="the 27B's first N layers only (quick probes of start-up memory; not a benchmark)")
    ap.add_argument("--samples", type=int, default=None, help="prompts timed (default 512, --tiny 64)")
    ap.add_argument("--warmup", type=int, default=128,
                    help="untimed requests first, at the same concurrency (other prompts, same lengths): enough for "
                         "the kernels JIT-compiled and autotuned per shape to be done before the clock starts")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (wall_s: the median)")
    ap.add_argument("--concurrency", type=int, default=128, help="requests in flight")
    ap.add_argument("--client-threads", type=int, default=16, help="threads loading/deleting files")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="per attempt (speculators' default)")
    ap.add_argument("--max-retries", type=int, default=3, help="speculators' retries (its default)")
    ap.add_argument("--compare", type=int, default=4, metavar="K", help="keep and compare the first K prompts' files")
    ap.add_argument("--aux-ids", default=None, help="eagle_aux_hidden_state_layer_ids (default 2,N//2,N-3,N)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-unread-bytes", type=int, default=200_000_000_000,
                    help="passed to `vllm-hidden serve` (0: not passed, its default)")
    ap.add_argument("--engine-arg", action="append", default=[], help="one more vLLM argument, every case (repeat)")
    ap.add_argument("--mooncake-segment-gib", type=float, default=16.0,
                    help="*-mooncake cases: the memory the server contributes to the store (speculators' "
                         "--mooncake-global-segment-gib)")
    ap.add_argument("--keep-plugins", action="store_true",
                    help="let plain vLLM load installed vLLM plugins (vllm-hidden's included)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to answer /health")
    ap.add_argument("--work", default=str(benchlib.ROOT / ".bench" / "online"), help="models, logs, kept files")
    ap.add_argument("--hs-dir", default=None, help="where the servers write their files (default <work>/hs)")
    ap.add_argument("--output", default=None,
                    help="result JSON, merged into if it exists (default benchmarks/results/gpu-online-<date>.json; "
                         "--tiny: <work>/online-tiny.json)")
    a = ap.parse_args()
    benchlib.exit_on_sigterm()  # `timeout`: the finally blocks stop the server
    try:
        cases = [parse_case(c) for c in a.cases.split(",") if c]
    except ValueError as e:
        ap.error(f"--cases: unknown case {e}; choose from {DEFAULT_CASES + OPTIONAL_CASES}")
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    import torch

    cuda = torch.cuda.is_available()  # no context made: the servers get the whole GPU
    if not cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ctx = setup(a, work, cuda)
    out = Path(a.output) if a.output else (
        work / "online-tiny.json" if a.tiny else benchlib.RESULTS / f"gpu-online-{benchlib.stamp('%Y%m%d')}.json")
    result = load_or_new(out, ctx, a)
    run = run_record(a, cuda, speculators_client()[1])
    ctx["run_id"] = len(result["runs"])
    result["runs"].append(run)
    ctx["gpu_baseline"] = gpu_used_mib() if cuda else None
    print(f"bench_online: {ctx['model_desc']}, {len(ctx['prompts'])} prompts, {ctx['tokens']} tokens, aux ids "
          f"{ctx['aux_ids']}, cases {[c['name'] for c in cases]} -> {out}", flush=True)
    for case in cases:
        name = case["name"]
        why = skip_reason(case, cuda)
        if why:  # a case measured by an earlier run stays
            result["cases"].setdefault(name, {"skipped": why, "run": ctx["run_id"]})
        else:
            run["cases"].append(name)
            print(f"bench_online: {name} ...", flush=True)
            result["cases"][name] = {**run_case(case, ctx, a), "run": ctx["run_id"], "gpu_names": run["gpu_names"]}
            update_comparisons(result, work, a.compare)
            summarize(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        benchlib.write_json_atomic(out, result)  # after every case: a later failure keeps the rest
        print(f"bench_online: {describe(name, result['cases'][name]) if not why else f'{name}: skipped: {why}'}",
              flush=True)
    for k, c in result.get("comparisons", {}).items():
        print(f"bench_online: states {k}: max rel L2 per layer {c['max_rel_l2_per_layer']}, tokens/shapes/dtypes "
              f"match {c['all_match_in_tokens_shapes_dtypes']}", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
