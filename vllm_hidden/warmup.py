"""`vllm-hidden warmup`: start an engine with the settings a later `extract` (or `serve`) will
use, run prompts of assorted lengths through it so that every kernel those runs need is
compiled and tuned into the cache directory (`caches.CacheDirs`), and leave a warm stamp.
A second warmup with the same settings finds the stamp and returns at once."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hidden.config import ExtractConfig
from vllm_hidden.engine import flags
from vllm_hidden.engine.caches import cache_files, new_kernels

log = logging.getLogger("vllm_hidden")

# Prompt lengths around the powers of two: Triton specializes integer arguments on
# divisibility by 16, and the GDN kernels work in chunks of 64 tokens.
_LENGTHS = (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 511, 512, 513,
            1000, 1024, 2047, 4096, 8191)


def warm_lengths(max_prompt_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths covering the shapes a run meets: short and odd lengths, a step's full
    token budget, a prompt split over steps (chunked prefill carries the GDN state), and a
    step of many short prompts at once."""
    lengths = [n for n in _LENGTHS if n <= max_prompt_len]
    # (a longer prompt only repeats the chunked steps: its kernels are the same)
    lengths += [n for n in (max_num_batched_tokens - 1, max_num_batched_tokens, max_num_batched_tokens + 1,
                            2 * max_num_batched_tokens + 7, min(max_prompt_len, 4 * max_num_batched_tokens))
                if 1 <= n <= max_prompt_len]
    lengths += [min(9, max_prompt_len)] * max_num_seqs
    return lengths


@dataclass
class WarmupReport:
    fingerprint: str
    noop: bool  # the stamp was there: nothing was started
    stamp: str
    seconds: float = 0.0
    start: dict[str, Any] = field(default_factory=dict)  # what the engine start compiled (caches.StartProbe)
    workload: dict[str, Any] = field(default_factory=dict)
    warmed_at: float | None = None
    packed: dict[str, Any] | None = None  # --pack: the archive written (cache_archive.Packed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for a person: warm already, or what the warmup ran and compiled (and packed)."""
        line = self._what_ran()
        p = self.packed
        if p:
            line += (f"; packed {p['files']} cache files ({p['bytes'] / 1e6:.1f} MB) into {p['path']} "
                     f"({p['archive_bytes'] / 1e6:.1f} MB) in {p['seconds']:.1f} s")
        return line

    def _what_ran(self) -> str:
        w = self.workload
        if self.noop:
            return (f"already warm: these settings were warmed up on {_when(self.warmed_at)} ({self.stamp}); "
                    f"checked in {self.seconds:.1f} s. --force warms up again")
        if "samples" in w:
            return (f"warmed up in {self.seconds:.1f} s: the engine started "
                    f"{'warm' if self.start.get('warm') else 'cold'}, then {w['samples']} prompts ({w['tokens']} "
                    f"tokens, lengths {w['lengths'][0]}..{w['lengths'][-1]}) in {w['seconds']:.1f} s compiled "
                    f"{w['kernels_compiled']} more kernels and stored {w['autotune_results_stored']} autotune "
                    f"results; stamp {self.stamp}")
        return (f"warmed up in {self.seconds:.1f} s: the server started in {w['server_start_seconds']:.1f} s "
                f"({self.start.get('log') or 'no start report in its log'}), then answered {w['requests']} "
                f"requests ({w['tokens']} tokens) in {w['seconds']:.1f} s; stamp {self.stamp}")


def _when(t: float | None) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t).isoformat(timespec="seconds") if t else "?"


def warmup_config(*, generate: bool, max_tokens: int | None, **fields: Any) -> ExtractConfig:
    """The config `vllm-hidden warmup` runs: `fields` as its extract's would be (input and
    output are the warmup's own)."""
    from vllm_hidden.config import GenerateConfig

    cfg = ExtractConfig(
        input_path="", output_dir="-", progress=False,
        # every response to --max-tokens: decode steps at every batch size the workload reaches
        generate=GenerateConfig(max_tokens=max_tokens or GenerateConfig.max_tokens, ignore_eos=True)
        if generate else None,
        **fields,
    )
    if max_tokens is not None and not generate:
        raise ValueError("--max-tokens goes with --generate")
    return cfg


def run_warmup(cfg: ExtractConfig, *, force: bool = False) -> WarmupReport:
    """Warm the caches for `vllm-hidden extract` with these settings (cfg's input and output
    are ignored)."""
    from vllm_hidden.extract.job import extract_file, start_extractor

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-hidden-warmup-") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.touch()
        cfg = dataclasses.replace(cfg, input_path=str(prompts), output_dir=str(Path(tmp) / "out"), resume=False,
                                  s3_endpoint_url=None, staging_dir=None)
        ex = start_extractor(cfg, start=False)
        fp, stamp = ex.fingerprint, ex.cache.stamp_path(ex.fingerprint)
        prev = ex.cache.warm_stamp(fp, ex.cache_dirs)
        if prev is not None and not force:
            return WarmupReport(fingerprint=fp, noop=True, stamp=str(stamp), seconds=time.perf_counter() - t0,
                                warmed_at=prev.get("created"))
        with ex:
            ex.start()
            sc = ex.engine.vllm_config.scheduler_config
            lengths = warm_lengths(ex.max_prompt_len, sc.max_num_batched_tokens, sc.max_num_seqs)
            rng = random.Random(0)
            with open(prompts, "w") as f:
                for i, n in enumerate(lengths):
                    ids = [rng.randrange(ex.info.vocab_size) for _ in range(n)]
                    f.write(json.dumps({"id": f"warmup-{i}", "token_ids": ids}) + "\n")
            files = cache_files()
            summary = extract_file(ex, str(prompts), cfg.output_dir, progress=False, resume=False)
            workload = {"samples": summary.samples, "tokens": summary.tokens, "seconds": round(summary.seconds, 2),
                        **new_kernels(files, cache_files()),
                        "lengths": sorted(set(lengths))}
            report = WarmupReport(fingerprint=fp, noop=False, stamp=str(stamp), start=ex.start_report,
                                  workload=workload)
        report.seconds = round(time.perf_counter() - t0, 2)
        report.warmed_at = ex.cache.write_warm_stamp(fp, ex.fingerprint_ident, seconds=report.seconds,
                                                     start=report.start, workload=workload)
    return report


# `vllm serve` flags that do not change what the engine compiles (left out of the key).
SERVER_ONLY = frozenset({"--host", "--port", "--api-key", "--uvicorn-log-level", "--root-path", "--ssl-keyfile",
                         "--ssl-certfile", "--allowed-origins"})


def serve_fingerprint(model: str, layer_ids: list[int], vllm_args: list[str],
                      cache_dirs: dict[str, str]) -> tuple[str, dict[str, Any]]:
    from vllm_hidden.engine import compat
    from vllm_hidden.engine.caches import fingerprint

    return fingerprint(mode="serve", model=model,
                       settings={"layer_ids": list(layer_ids), "model_runner": compat.requested_runner()},
                       engine_args=flags.without(vllm_args, SERVER_ONLY), device=compat.device_name(),
                       cache_dirs=cache_dirs, env_digest=compat.compile_env_digest())


def _max_hidden_tokens(args: list[str]) -> int:
    from vllm_hidden.config import ServeConfig

    raw = flags.last(args, ("--max-hidden-tokens",))
    if raw is None:
        return ServeConfig.max_hidden_tokens
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"--max-hidden-tokens must be an int, got {raw!r}") from None


def _stop(proc) -> None:
    """Stop the server's process group (SIGINT, then SIGKILL); it may have exited already."""
    import os
    import signal
    import subprocess

    for sig, wait in ((signal.SIGINT, 120), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def warmup_serve(model: str, layers: str | None, aux_layers: str | None, layers_from: str | None,
                 engine_flags: dict[str, Any], engine_args: list[str], tp: int, *, cache_dir: str | None = None,
                 force: bool = False) -> WarmupReport:
    """`vllm-hidden warmup --serve`: the layer ids and `vllm serve` arguments that server will
    get, then run_serve_warmup. `engine_flags`: vLLM flag -> value (None: not given)."""
    from vllm_hidden.engine.args import with_tp
    from vllm_hidden.extract.plan import model_info
    from vllm_hidden.layers import resolve_layer_ids

    ids = resolve_layer_ids(model_info(model).num_layers, layers, aux_layers, layers_from)
    vllm_args = with_tp([x for k, v in engine_flags.items() if v is not None for x in (k, str(v))] + engine_args, tp)
    return run_serve_warmup(model, ids, vllm_args, cache_dir=cache_dir, force=force)


def run_serve_warmup(model: str, layer_ids: list[int], vllm_args: list[str], *, cache_dir: str | None = None,
                     force: bool = False, start_timeout: float = 3600) -> WarmupReport:
    """Warm the caches for `vllm-hidden serve` with these arguments: start that server on a
    free local port, send completions of assorted lengths (prompt and generated states,
    several at once), stop it."""
    import os
    import subprocess
    import sys
    import urllib.error
    from concurrent.futures import ThreadPoolExecutor

    from vllm_hidden.engine.caches import CacheDirs

    t0 = time.perf_counter()
    cache = CacheDirs.resolve(cache_dir)
    dirs = cache.apply()
    fp, ident = serve_fingerprint(model, layer_ids, vllm_args, dirs)
    stamp = cache.stamp_path(fp)
    prev = cache.warm_stamp(fp, dirs)
    if prev is not None and not force:
        return WarmupReport(fingerprint=fp, noop=True, stamp=str(stamp), seconds=time.perf_counter() - t0,
                            warmed_at=prev.get("created"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm_hidden.cli", "serve", model, "--layers", ",".join(map(str, layer_ids)),
           "--cache-dir", str(cache.root), *flags.without(vllm_args, SERVER_ONLY),
           "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryDirectory(prefix="vllm-hidden-warmup-") as tmp:
        log_path = Path(tmp) / "server.log"
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}  # a private server: no key to send
        with open(log_path, "w") as log_f:
            proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"the server exited with {proc.returncode} during warmup:\n{tail}")
                if time.perf_counter() - t0 > start_timeout:
                    raise RuntimeError(f"the server did not start within {start_timeout:.0f} s")
                try:
                    _http(url + "/health", timeout=5)
                    break
                except (urllib.error.URLError, OSError, ValueError):
                    time.sleep(2)
            started = time.perf_counter() - t0
            info = _http(url + "/v1/models")["data"][0]
            name, max_len = info["id"], int(info.get("max_model_len") or 2048)
            rng = random.Random(0)
            # within the context and the server's per-response row limit (prompt + 8 - 1 rows)
            lengths = [n for n in _LENGTHS if n + 8 <= max_len and n + 7 <= _max_hidden_tokens(vllm_args)]

            def one(n: int) -> int:
                ids = [rng.randrange(1, 1000) for _ in range(n)]
                body = {"model": name, "prompt": ids, "max_tokens": 8, "temperature": 0,
                        "hidden_states": {"tokens": "all"}}
                return _http(url + "/v1/completions", body)["usage"]["total_tokens"]

            t1 = time.perf_counter()
            try:
                tokens = sum(one(n) for n in lengths)  # one at a time: each prompt shape on its own
                with ThreadPoolExecutor(16) as pool:  # then many at once: batched decode steps
                    tokens += sum(pool.map(one, [min(n, 64) for n in lengths] * 2))
            except urllib.error.HTTPError as e:
                raise RuntimeError(f"the warmup server answered {e.code}: {e.read()[:1000]!r}; its log ends:\n"
                                   f"{log_path.read_text(errors='replace')[-2000:]}") from None
            workload = {"requests": 3 * len(lengths), "tokens": tokens, "seconds": round(time.perf_counter() - t1, 2),
                        "lengths": lengths, "server_start_seconds": round(started, 2)}
        finally:
            _stop(proc)
        text = log_path.read_text(errors="replace")
    start: dict[str, Any] = {
        "log": next((ln.split("vllm-hidden: ", 1)[1] for ln in text.splitlines() if "engine started" in ln), "")}
    start["warm"] = start["log"].startswith("engine started WARM")
    runner = re.search(r"\(model runner (V\d)\)", start["log"])
    start["model_runner"] = runner.group(1).lower() if runner else None
    report = WarmupReport(fingerprint=fp, noop=False, stamp=str(stamp), start=start, workload=workload,
                          seconds=round(time.perf_counter() - t0, 2))
    report.warmed_at = cache.write_warm_stamp(fp, ident, seconds=report.seconds, start=start, workload=workload)
    return report
