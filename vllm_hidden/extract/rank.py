"""One engine of a data-parallel run (a local process or a Ray actor): start it, then
extract from the shared prompt queue into its own part of the output, and report.

Events it puts on the coordinator's queue: ("ready", rank, info) once its engine is up,
("progress", rank, samples, tokens) about twice a second, then ("done", rank, result)
or ("failed", rank, message)."""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any

PROGRESS_EVERY_S = 0.5


def run_rank(spec: dict[str, Any], work: Any, events: Any) -> dict[str, Any]:
    os.environ.update(spec["env"])  # its devices, before anything touches them
    from vllm_hidden.config import ExtractConfig, ShardConfig
    from vllm_hidden.extract.feed import QueueFeed
    from vllm_hidden.extract.job import start_extractor

    rank = spec["rank"]
    cfg = ExtractConfig(**spec["cfg"])
    with start_extractor(cfg, check_io=False) as ex:
        events.put(("ready", rank, {"engine_init_seconds": round(ex.engine_init_seconds, 3),
                                    "engine_start": ex.start_report, "ready_at": time.time(),
                                    "devices": spec["env"]}))
        last = [0.0]

        def progress(samples: int, tokens: int) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S:
                last[0] = now
                events.put(("progress", rank, samples, tokens))

        sc = ex.engine.vllm_config.scheduler_config
        # a few steps' worth in flight keeps every step full; more would leave one engine
        # with a long tail while the others, their share done, sit idle
        res = ex.extract(QueueFeed(work), ShardConfig(**spec["shard"]), progress,
                         max_inflight_tokens=spec.get("inflight_steps", 4) * sc.max_num_batched_tokens)
        out = {**res.to_dict(), "engine": ex.engine_info(), "first_sample_seconds": ex.first_sample_at,
               "finished_at": time.time()}
        # reported before the engine shuts down (seconds): its shards are durable already
        events.put(("progress", rank, res.samples, res.tokens))
        events.put(("done", rank, out))
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
        events.put(("failed", spec["rank"], f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
