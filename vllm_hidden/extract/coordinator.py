"""Data-parallel extract: N engines (local processes, or Ray actors) fed from one shared queue.

The coordinator (this process; it starts no engine) reads and checks the prompt file once,
so bad lines, duplicate ids and samples done by an earlier attempt are handled as in a
one-engine run, and puts each good prompt on a bounded queue. Each engine takes prompts
only when it has room (a few steps' worth), so the engines finish within a prompt of each
other whatever the lengths. They start taking prompts together (an engine more than a
minute later than the first joins when ready). Rank r writes
its shards, and its own journal, under rank-NNN/ (storage.output); the coordinator writes
run.json first and the one manifest last, after every engine reported its shards durable.
A failed engine stops the run: the others finish what they took (it becomes durable), no
manifest is written, and `--resume` redoes exactly what is missing.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from vllm_hidden.config import ExtractConfig
from vllm_hidden.extract.feed import QUEUE_PER_ENGINE, ReaderFeed, pack
from vllm_hidden.extract.rank import rank_process
from vllm_hidden.inputs import count_records

if TYPE_CHECKING:
    from vllm_hidden.storage.output import Output

log = logging.getLogger("vllm_hidden")

START_TOGETHER_S = 60.0
STALL_AFTER_FAILURE_S = 120.0  # after a failure, how long the others may send nothing before they are stopped


class RankFailed(RuntimeError):
    pass


class LocalRanks:
    """dp engine processes on this host, each with its own devices (vllm_hidden.devices.rank_envs)."""

    def __init__(self, specs: list[dict[str, Any]]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # CUDA cannot be forked; vLLM spawns on GPU hosts too
        self.work = ctx.Queue(QUEUE_PER_ENGINE * len(specs))
        self.events = ctx.Queue()
        # not daemonic: a rank starts vLLM's own processes
        self.procs = [ctx.Process(target=rank_process, args=(s, self.work, self.events, os.getpid()),
                                  name=f"vllm-hidden-rank-{s['rank']}") for s in specs]
        self._dead_since: dict[int, float] = {}
        for p in self.procs:
            p.start()

    def put(self, item: Any, timeout: float) -> bool:
        try:
            self.work.put(item, timeout=timeout)
            return True
        except queue.Full:
            return False

    def next_event(self, timeout: float) -> tuple | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def lost(self, reported: set[int]) -> dict[int, str]:
        """Ranks that ended without reporting (killed, out of memory), once their last events
        have had time to arrive."""
        now = time.monotonic()
        out = {}
        for r, p in enumerate(self.procs):
            if r in reported or p.is_alive():
                continue
            since = self._dead_since.setdefault(r, now)
            if now - since > 2.0:
                _killpg(p.pid, signal.SIGKILL)  # its engine processes, orphaned
                out[r] = f"its process exited with code {p.exitcode} without reporting"
        return out

    def close(self, force: bool) -> None:
        """Each rank is a process group (the rank and vLLM's engine processes): after a normal
        end they have exited; otherwise, or if anything is left, the group is ended."""
        deadline = time.monotonic() + (10 if force else 120)
        for p in self.procs:
            if force and p.is_alive():
                _killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            _killpg(p.pid, signal.SIGKILL)
            p.join(5)
        self.work.cancel_join_thread()  # prompts nobody will take must not block our exit


def _killpg(pgid: int | None, sig: int) -> None:
    if pgid is None:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group has already gone
        pass


def rank_specs(cfg: ExtractConfig, output: Output, envs: list[dict[str, str]]) -> list[dict[str, Any]]:
    specs = []
    for r, env in enumerate(envs):
        shard = output.shard_config(r, **cfg.shard_options())
        rank_cfg = {**asdict(cfg), "progress": False, "dp": 1, "ray_address": None}
        specs.append({"rank": r, "cfg": rank_cfg, "shard": shard.to_dict(), "env": env})
    return specs


def run_parallel(cfg: ExtractConfig):
    """`vllm-hidden extract --dp N [--tp M] [--ray ADDRESS]`; returns the job's Summary (extract.job)."""
    from vllm_hidden.engine.caches import CacheDirs, resolve_tp
    from vllm_hidden.extract.job import ProgressBar, Summary, manifest_fields
    from vllm_hidden.extract.plan import check_paths, plan_extract, prompt_reader
    from vllm_hidden.extract.run import EngineResult
    from vllm_hidden.storage.output import Output, in_part

    CacheDirs.resolve(cfg.cache_dir).apply()  # every engine inherits the cache locations
    check_paths(cfg.model, cfg.input_path, cfg.output_dir, cfg.resume, cfg.s3_endpoint_url, cfg.input_columns)
    cfg = replace(cfg, tp=resolve_tp(cfg.engine_args, cfg.tp))  # each rank's devices depend on it
    plan = plan_extract(cfg)
    # devices (or the cluster) first: a bad --dp/--tp fails before any output is written
    if cfg.ray_address is None:
        from vllm_hidden.devices import rank_envs
        from vllm_hidden.engine.quant import check_host

        check_host(cfg.model, cfg.engine_args)  # the ranks run here: FP8 weights need this host to have kernels
        envs = rank_envs(cfg.dp, cfg.tp)
    else:
        from vllm_hidden.extract.ray_ranks import RayRanks

        ray_ranks = RayRanks(cfg)
    output = Output(cfg.output_dir, plan.identity, s3_endpoint_url=cfg.s3_endpoint_url, staging_dir=cfg.staging_dir,
                    s3_retry_s=cfg.s3_retry_s)
    state = output.begin(cfg.resume)
    reader = prompt_reader(cfg, plan)
    feed = ReaderFeed(reader, state.done_ids, output.record_error)
    total = count_records(cfg.input_path)
    t0 = time.perf_counter()
    ready: dict[int, dict[str, Any]] = {}
    done: dict[int, dict[str, Any]] = {}
    failed: dict[int, str] = {}
    progress: dict[int, tuple[int, int]] = {}
    first_ready: list[float] = []

    last_event = [time.perf_counter()]

    def handle(ev: tuple) -> None:
        kind, rank = ev[0], ev[1]
        last_event[0] = time.perf_counter()
        if kind == "ready":
            ready[rank] = ev[2]
            first_ready.append(time.perf_counter())
            log.info("vllm-hidden: rank %d ready (%s) after %.1f s", rank, ev[2].get("devices"),
                     time.perf_counter() - t0)
        elif kind == "progress":
            progress[rank] = (ev[2], ev[3])
            bar.update(sum(p[0] for p in progress.values()) + feed.resumed,
                       sum(p[1] for p in progress.values()), output.num_errors)
        elif kind == "done":
            done[rank] = ev[2]
            failed.pop(rank, None)
            log.info("vllm-hidden: rank %d done after %.1f s: %d samples in %d durable shards", rank,
                     time.perf_counter() - t0, ev[2]["samples"], len(ev[2]["shards"]))
        elif kind == "failed":
            if rank in done:  # e.g. its engine's shutdown failed: its shards are durable already
                log.warning("vllm-hidden: rank %d failed after finishing its work: %s", rank, ev[2])
            else:
                failed[rank] = ev[2]

    def pump(timeout: float) -> None:
        ev = ranks.next_event(timeout)
        while ev is not None:
            handle(ev)
            ev = ranks.next_event(0)
        for rank, why in ranks.lost(set(done) | set(failed)).items():
            if rank not in done:
                failed[rank] = why

    ok = False
    ends = 0
    ranks: Any = None
    bar = ProgressBar(total, cfg.progress)
    try:
        if cfg.ray_address is None:
            ranks = LocalRanks(rank_specs(cfg, output, envs))
        else:
            ranks = ray_ranks.start(lambda envs: rank_specs(cfg, output, envs))
        # engines start taking prompts together, so each gets its share from the first prompt
        # on; one that is later than START_TOGETHER_S (e.g. waiting on another's compile) joins
        # when it is ready
        while len(ready) < cfg.dp and not failed and (
                not first_ready or time.perf_counter() - first_ready[0] < START_TOGETHER_S):
            pump(0.5)
        t_dispatch = time.perf_counter()
        dispatched = 0
        while not failed:
            item = feed.next()
            if item is None:
                break
            while not failed and not ranks.put(pack(item), timeout=0.2):
                pump(0)
            dispatched += 1
            if dispatched % 64 == 0:
                pump(0)
        # one end marker per engine; after a failure the others drain what is queued, then stop
        while len(set(done) | set(failed)) < cfg.dp:
            while ends < cfg.dp and ranks.put(None, timeout=0.05):
                ends += 1
            pump(0.5)
            if failed and time.perf_counter() - last_event[0] > STALL_AFTER_FAILURE_S:
                break  # the others went quiet (e.g. the dead engine took the queue down with it)
        ev = ranks.next_event(1.0) if failed else None
        while ev is not None:  # a "done" may still be on its way behind a failure report (Ray)
            handle(ev)
            ev = ranks.next_event(0.2)
        if failed:
            raise RankFailed(f"{len(failed)} of {cfg.dp} engines failed; the shards the others made durable are "
                             "kept, and `--resume` extracts the rest exactly once. "
                             + " | ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())))
        ok = True
        finished = time.perf_counter()
    finally:
        bar.close()
        if ranks is not None:
            ranks.close(force=not ok)
        elif cfg.ray_address is not None:
            ray_ranks.close(force=True)
        output.close_errors()
    results = [EngineResult.from_dict(done[r]) for r in range(cfg.dp)]
    summary = Summary(output_dir=output.where, resumed=feed.resumed)
    for r, res in enumerate(results):
        for bad in res.rejected:
            output.record_error(bad)
        summary.samples += res.samples
        summary.tokens += res.tokens
        summary.generated_tokens += res.generated_tokens
        summary.shards += in_part(r, res.shards)
    summary.errors = output.num_errors
    summary.seconds = finished - t_dispatch  # the first prompt handed out .. every shard durable
    summary.engine_init_seconds = max(r["engine_init_seconds"] for r in ready.values())
    summary.first_sample_seconds = min((done[r]["first_sample_seconds"] for r in done
                                        if done[r]["first_sample_seconds"]), default=0.0)
    summary.flush_seconds = max(res.flush_seconds for res in results)
    summary.engine_start = {"warm": all(r.get("engine_start", {}).get("warm") for r in ready.values())}
    summary.ranks = [{"rank": r, **ready[r], "samples": res.samples, "tokens": res.tokens,
                      "seconds": round(res.seconds, 3), "shards": len(res.shards), "capture_stats": res.capture_stats}
                     for r, res in enumerate(results)]
    engine = dict(done[0]["engine"])
    engine["data_parallel_size"] = cfg.dp
    output.finish(summary.shards, **manifest_fields(cfg, plan, engine, reader))
    return summary
