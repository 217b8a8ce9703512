"""One engine of a data-parallel run (a local process or a Ray actor): start it, then
extract from the shared prompt queue into its own part of the output, and report.

Events it puts on the coordinator's queue: `RankReady` once its engine is up, `RankProgress`
about twice a second, then `RankDone` or `RankError`. They cross process boundaries (a
multiprocessing or Ray queue), so they are plain picklable records."""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

PROGRESS_EVERY_S = 0.5


@dataclass(frozen=True)
class RankReady:
    """Its engine is up: `info` holds engine_init_seconds, engine_start, ready_at and devices."""

    rank: int
    info: dict[str, Any]


@dataclass(frozen=True)
class RankProgress:
    """Samples and tokens extracted so far (totals, not increments)."""

    rank: int
    samples: int
    tokens: int


@dataclass(frozen=True)
class RankDone:
    """Every shard it wrote is durable: `result` is its EngineResult.to_dict() plus engine,
    first_sample_seconds and finished_at."""

    rank: int
    result: dict[str, Any]


@dataclass(frozen=True)
class RankError:
    """Its run raised: the exception and its traceback, as text."""

    rank: int
    message: str


RankEvent = RankReady | RankProgress | RankDone | RankError


def run_rank(spec: dict[str, Any], work: Any, events: Any) -> dict[str, Any]:
    os.environ.update(spec["env"])  # its devices, before anything touches them
    from vllm_hidden.devices import bind_cores

    bind_cores(spec["env"])
    from vllm_hidden.config import ExtractConfig, ShardConfig
    from vllm_hidden.extract.feed import QueueFeed
    from vllm_hidden.extract.job import start_extractor

    rank = spec["rank"]
    cfg = ExtractConfig(**spec["cfg"])
    with start_extractor(cfg, check_io=False) as ex:
        events.put(RankReady(rank, {"engine_init_seconds": round(ex.engine_init_seconds, 3),
                                    "engine_start": ex.start_report, "ready_at": time.time(),
                                    "devices": spec["env"]}))
        last_sent = 0.0

        def progress(samples: int, tokens: int) -> None:
            nonlocal last_sent
            now = time.monotonic()
            if now - last_sent >= PROGRESS_EVERY_S:
                last_sent = now
                events.put(RankProgress(rank, samples, tokens))

        sc = ex.engine.vllm_config.scheduler_config
        # a few steps' worth in flight keeps every step full; more would leave one engine
        # with a long tail while the others, their share done, sit idle
        res = ex.extract(QueueFeed(work), ShardConfig(**spec["shard"]), progress,
                         max_inflight_tokens=spec.get("inflight_steps", 4) * sc.max_num_batched_tokens)
        out = {**res.to_dict(), "engine": ex.engine_info(), "first_sample_seconds": ex.first_sample_at,
               "finished_at": time.time()}
        # reported before the engine shuts down (seconds): its shards are durable already
        events.put(RankProgress(rank, res.samples, res.tokens))
        events.put(RankDone(rank, out))
    return out


def _follow_parent(parent: int) -> None:
    """This rank runs in a process group of its own, with vLLM's engine processes: if the
    coordinator dies (even by kill -9), the whole group goes, instead of engines idling on a
    queue nobody feeds while they hold their devices."""
    import signal
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="vllm-hidden-parent-watch", daemon=True).start()


def rank_process(spec: dict[str, Any], work: Any, events: Any, parent: int) -> None:
    """multiprocessing target: a failure is reported as an event, then the exit code says so."""
    os.setsid()  # the coordinator ends this rank with its engine processes by one killpg
    _follow_parent(parent)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {spec['rank']} %(name)s: %(message)s")
    try:
        run_rank(spec, work, events)
    except BaseException as e:  # noqa: BLE001 - reported to the coordinator, then re-raised as an exit code
        events.put(RankError(spec["rank"], f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
