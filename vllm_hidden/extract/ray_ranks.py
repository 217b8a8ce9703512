"""The dp engines as actors of a Ray cluster (as vLLM itself spreads over machines).

Each actor holds one engine of `tp` GPUs (on a cluster without GPUs: `tp` CPUs) wherever
Ray places it; the prompts come from one Ray queue, the events go back on another. Every
node needs this package and vLLM installed, the model at the same path (or a hub id), and
the output must be reachable from all of them: s3://, or a shared file system. On CPU nodes
the actors on one node split its cores between them (devices.cpu_bind).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import vllm_hidden.envs as envs
from vllm_hidden.config import ExtractConfig
from vllm_hidden.extract.feed import QUEUE_PER_ENGINE
from vllm_hidden.extract.rank import RankEvent


class RankActor:
    """Ray actor: where it runs, then one rank's work (extract.rank)."""

    def where(self) -> tuple[str, list[int]]:
        """The host (several Ray nodes may share one) and the cores this process may use."""
        import ray

        from vllm_hidden.devices import allowed_cpus

        return ray.util.get_node_ip_address(), allowed_cpus()

    def run(self, spec: dict[str, Any], work: Any, events: Any) -> None:
        import logging

        from vllm_hidden.extract.rank import run_rank

        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {spec['rank']} %(name)s: %(message)s")
        run_rank(spec, work, events)


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("--ray needs Ray: pip install 'ray>=2.40,<3' (in a clone of vllm-hidden: "
                          "pip install -e '.[ray]')") from None
    return ray


class RayRanks:
    """Connects to the cluster and checks it can hold the engines (before any output is
    written); `start` then places the actors and starts their work."""

    PLACE_TIMEOUT_S = 600.0

    def __init__(self, cfg: ExtractConfig) -> None:
        ray = _ray()
        self.ray, self.cfg = ray, cfg
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        self.work: Any = None  # ray.util.queue.Queue once started
        self.events: Any = None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            try:
                ray.init(address=cfg.ray_address, log_to_driver=True)
            except Exception as e:  # noqa: BLE001 - re-raised with the address named
                raise ValueError(f"--ray {cfg.ray_address!r}: cannot connect to the Ray cluster: {e}") from None
        res = ray.cluster_resources()
        self.gpu = res.get("GPU", 0) > 0
        kind, have = ("GPU", res.get("GPU", 0)) if self.gpu else ("CPU", res.get("CPU", 0))
        if have < cfg.dp * cfg.tp:
            self.close(force=True)
            raise ValueError(f"--dp {cfg.dp} --tp {cfg.tp} needs {cfg.dp * cfg.tp} {kind}s; the Ray cluster at "
                             f"{cfg.ray_address!r} has {have:g}")

    def start(self, make_specs: Callable[[list[dict[str, str]]], list[dict[str, Any]]]) -> "RayRanks":
        from ray.util.queue import Queue

        from vllm_hidden.devices import CPU_BIND, cpu_bind

        ray, cfg = self.ray, self.cfg
        opts = {"num_gpus": cfg.tp} if self.gpu else {"num_cpus": cfg.tp}
        # the caches and the engine's settings travel with the actors; devices are Ray's to give
        env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", envs.PREFIX, "HF_", "AWS_", "TRITON_"))}
        env.pop(CPU_BIND, None)
        actor_cls = ray.remote(RankActor)
        self.actors = [actor_cls.options(**opts, runtime_env={"env_vars": env}).remote() for _ in range(cfg.dp)]
        try:
            where = ray.get([a.where.remote() for a in self.actors], timeout=self.PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ValueError(f"Ray could not place {cfg.dp} engine actors of {opts} within "
                             f"{self.PLACE_TIMEOUT_S:.0f} s (resources taken by other work?)") from None
        actor_envs: list[dict[str, str]] = [{} for _ in self.actors]
        if not self.gpu:  # actors sharing a host get disjoint cores
            by_host: dict[str, list[int]] = {}
            for r, (host, _) in enumerate(where):
                by_host.setdefault(host, []).append(r)
            for ranks in by_host.values():
                cpus = where[ranks[0]][1]
                share = max(1, len(cpus) // len(ranks))
                for k, r in enumerate(ranks):
                    mine = cpus[k * share:(k + 1) * share] or cpus[-share:]
                    actor_envs[r] = {CPU_BIND: cpu_bind(mine, cfg.tp)}
        self.work = Queue(QUEUE_PER_ENGINE * cfg.dp)
        self.events = Queue()
        self.refs = [a.run.remote(spec, self.work, self.events) for a, spec in zip(self.actors, make_specs(actor_envs))]
        return self

    def put(self, item: Any, timeout: float) -> bool:
        from ray.util.queue import Full

        try:
            self.work.put(item, timeout=timeout)
            return True
        except Full:
            return False

    def next_event(self, timeout: float) -> RankEvent | None:
        from ray.util.queue import Empty

        try:
            return self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait()
        except Empty:
            return None

    def lost(self, reported: set[int]) -> dict[int, str]:
        """Actors whose run ended in an error (a dead actor, or an exception before it could report)."""
        ready, _ = self.ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
        out = {}
        for r, ref in enumerate(self.refs):
            if r in reported or ref not in ready:
                continue
            try:
                self.ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the actor's failure, reported as the rank's
                out[r] = f"{type(e).__name__}: {str(e)[-2000:]}"
        return out

    def close(self, force: bool) -> None:
        if not force and self.refs:
            self.ray.wait(list(self.refs), num_returns=len(self.refs), timeout=60)
        for a in self.actors:
            self.ray.kill(a)
        for q in (self.work, self.events):
            if q is not None:
                q.shutdown()
        if self._owns_ray:  # flushes the actors' logs, so that the run's summary prints after them
            self.ray.shutdown()
