"""Data-parallel extract: N engines (local processes, or Ray actors) fed from one shared queue.

The coordinator (this process; it starts no engine) checks the prompt file and the engine
options before anything is written (extract.plan), then reads the prompt file once, so bad
lines, duplicate ids and samples done by an earlier attempt are handled as in a one-engine
run, and puts each good prompt on a bounded queue. Each engine takes prompts
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
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from vllm_hidden.config import ExtractConfig
from vllm_hidden.errors import VllmHiddenError
from vllm_hidden.extract.feed import QUEUE_PER_ENGINE, ReaderFeed, pack
from vllm_hidden.extract.rank import RankDone, RankError, RankEvent, RankProgress, RankReady, rank_process

if TYPE_CHECKING:
    from vllm_hidden.extract.job import ProgressBar, Summary
    from vllm_hidden.extract.ray_ranks import RayRanks
    from vllm_hidden.storage.output import Output

log = logging.getLogger("vllm_hidden")

START_TOGETHER_S = 60.0
STALL_AFTER_FAILURE_S = 120.0  # after a failure, how long the others may send nothing before they are stopped


class RankFailed(VllmHiddenError, RuntimeError):
    """A rank failed: the run stops without a manifest; what the others made durable is kept."""


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

    def next_event(self, timeout: float) -> RankEvent | None:
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


class Ranks(Protocol):
    """The ranks as the coordinator drives them: LocalRanks, or a started RayRanks."""

    def put(self, item: Any, timeout: float) -> bool: ...
    def next_event(self, timeout: float) -> RankEvent | None: ...
    def lost(self, reported: set[int]) -> dict[int, str]: ...
    def close(self, force: bool) -> None: ...


class Engines:
    """Where the ranks will run, checked before any output is written (a bad --dp/--tp, or a
    cluster too small, fails first): this host's devices, or a Ray cluster connected to."""

    def __init__(self, cfg: ExtractConfig) -> None:
        self.cfg = cfg
        self.envs: list[dict[str, str]] = []
        self.cluster: RayRanks | None = None
        if cfg.ray_address is None:
            from vllm_hidden.devices import rank_envs
            from vllm_hidden.engine.quant import check_host

            check_host(cfg.model, cfg.engine_args)  # the ranks run here: FP8 weights need this host to have kernels
            self.envs = rank_envs(cfg.dp, cfg.tp)
        else:
            from vllm_hidden.extract.ray_ranks import RayRanks

            self.cluster = RayRanks(cfg)

    def start(self, output: Output) -> Ranks:
        if self.cluster is None:
            return LocalRanks(rank_specs(self.cfg, output, self.envs))
        return self.cluster.start(lambda envs: rank_specs(self.cfg, output, envs))

    def abandon(self) -> None:
        """The ranks never started: let go of the cluster."""
        if self.cluster is not None:
            self.cluster.close(force=True)


@dataclass
class RankReports:
    """What the ranks have reported so far, and what `Ranks.lost` found."""

    t0: float  # the run's start, for the log
    ready: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> RankReady.info
    done: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> RankDone.result
    failed: dict[int, str] = field(default_factory=dict)  # rank -> why
    progress: dict[int, RankProgress] = field(default_factory=dict)  # rank -> its latest
    first_ready_at: float | None = None
    last_event_at: float = field(default_factory=time.perf_counter)  # after a failure: are the others still busy?

    @property
    def reported(self) -> set[int]:
        """Ranks that will report nothing more."""
        return set(self.done) | set(self.failed)

    def samples_tokens(self) -> tuple[int, int]:
        return (sum(p.samples for p in self.progress.values()), sum(p.tokens for p in self.progress.values()))

    def record(self, ev: RankEvent) -> None:
        now = self.last_event_at = time.perf_counter()
        match ev:
            case RankReady(rank, info):
                self.ready[rank] = info
                if self.first_ready_at is None:
                    self.first_ready_at = now
                log.info("vllm-hidden: rank %d ready (%s) after %.1f s", rank, info.get("devices"),
                         time.perf_counter() - self.t0)
            case RankProgress(rank):
                self.progress[rank] = ev
            case RankDone(rank, result):
                self.done[rank] = result
                self.failed.pop(rank, None)
                log.info("vllm-hidden: rank %d done after %.1f s: %d samples in %d durable shards", rank,
                         time.perf_counter() - self.t0, result["samples"], len(result["shards"]))
            case RankError(rank, message):
                if rank in self.done:  # e.g. its engine's shutdown failed: its shards are durable already
                    log.warning("vllm-hidden: rank %d failed after finishing its work: %s", rank, message)
                else:
                    self.failed[rank] = message

    def record_lost(self, lost: dict[int, str]) -> None:
        for rank, why in lost.items():
            if rank not in self.done:
                self.failed[rank] = why


class Dispatch:
    """One data-parallel run's prompts through its started ranks: wait for the ranks to start
    together, hand out every prompt, then one end marker per rank and wait for each report."""

    def __init__(self, cfg: ExtractConfig, ranks: Ranks, reports: RankReports, feed: ReaderFeed,
                 output: Output, bar: ProgressBar) -> None:
        self.cfg, self.ranks, self.reports, self.feed, self.output, self.bar = cfg, ranks, reports, feed, output, bar

    def run(self) -> float:
        """Returns the seconds from the first prompt handed out to every shard durable; raises
        RankFailed if a rank failed (after the others finished what they took)."""
        self.start_together()
        started = time.perf_counter()
        self.hand_out()
        self.end_ranks()
        self.raise_if_failed()
        return time.perf_counter() - started

    def pump(self, timeout: float) -> None:
        """Take every event that has arrived (waiting up to `timeout` for the first), then the lost ranks."""
        ev = self.ranks.next_event(timeout)
        while ev is not None:
            self.take(ev)
            ev = self.ranks.next_event(0)
        self.reports.record_lost(self.ranks.lost(self.reports.reported))

    def take(self, ev: RankEvent) -> None:
        self.reports.record(ev)
        if isinstance(ev, RankProgress):
            samples, tokens = self.reports.samples_tokens()
            self.bar.update(samples + self.feed.resumed, tokens, self.output.num_errors)

    def start_together(self) -> None:
        """Engines start taking prompts together, so each gets its share from the first prompt
        on; one that is later than START_TOGETHER_S (e.g. waiting on another's compile) joins
        when it is ready."""
        r = self.reports
        while len(r.ready) < self.cfg.dp and not r.failed and (
                r.first_ready_at is None or time.perf_counter() - r.first_ready_at < START_TOGETHER_S):
            self.pump(0.5)

    def hand_out(self) -> None:
        """Every prompt of the feed onto the shared queue, until a rank fails."""
        r = self.reports
        handed = 0
        while not r.failed:
            item = self.feed.next()
            if item is None:
                break
            while not r.failed and not self.ranks.put(pack(item), timeout=0.2):
                self.pump(0)
            handed += 1
            if handed % 64 == 0:
                self.pump(0)

    def end_ranks(self) -> None:
        """One end marker per engine; after a failure the others drain what is queued, then stop."""
        r = self.reports
        ends = 0
        while len(r.reported) < self.cfg.dp:
            while ends < self.cfg.dp and self.ranks.put(None, timeout=0.05):
                ends += 1
            self.pump(0.5)
            if r.failed and time.perf_counter() - r.last_event_at > STALL_AFTER_FAILURE_S:
                break  # the others went quiet (e.g. the dead engine took the queue down with it)
        ev = self.ranks.next_event(1.0) if r.failed else None
        while ev is not None:  # a RankDone may still be on its way behind a failure report (Ray)
            self.take(ev)
            ev = self.ranks.next_event(0.2)

    def raise_if_failed(self) -> None:
        failed = self.reports.failed
        if failed:
            raise RankFailed(f"{len(failed)} of {self.cfg.dp} engines failed; the shards the others made durable "
                             "are kept, and `--resume` extracts the rest exactly once. "
                             + " | ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())))


def run_parallel(cfg: ExtractConfig) -> Summary:
    """`vllm-hidden extract --dp N [--tp M] [--ray ADDRESS]`; returns the job's Summary (extract.job)."""
    from vllm_hidden.engine.caches import CacheDirs, resolve_tp
    from vllm_hidden.extract.job import ProgressBar, manifest_fields
    from vllm_hidden.extract.plan import check_engine_options, check_paths, check_prompts, plan_extract, prompt_reader
    from vllm_hidden.storage.output import Output

    CacheDirs.resolve(cfg.cache_dir).apply()  # every engine inherits the cache locations
    check_paths(cfg.model, cfg.input_path, cfg.output_dir, cfg.resume, cfg.s3_endpoint_url, cfg.input_columns)
    cfg = replace(cfg, tp=resolve_tp(cfg.engine_args, cfg.tp))  # each rank's devices depend on it
    plan = plan_extract(cfg)
    # what each rank would refuse only after run.json exists, refused here, before anything is written
    check_engine_options(cfg, plan)
    scan = check_prompts(cfg, plan)
    engines = Engines(cfg)
    output = Output(cfg.output_dir, plan.identity, s3_endpoint_url=cfg.s3_endpoint_url, staging_dir=cfg.staging_dir,
                    s3_retry_s=cfg.s3_retry_s)
    state = output.begin(cfg.resume)
    reader = prompt_reader(cfg, plan)
    feed = ReaderFeed(reader, state.done_ids, output.record_error)
    total = scan.records
    reports = RankReports(t0=time.perf_counter())
    ok = False
    ranks: Ranks | None = None
    bar = ProgressBar(total, cfg.progress)
    try:
        ranks = engines.start(output)
        seconds = Dispatch(cfg, ranks, reports, feed, output, bar).run()
        ok = True
    finally:
        bar.close()
        if ranks is not None:
            ranks.close(force=not ok)
        else:
            engines.abandon()
        output.close_errors()
    summary = _summary(cfg, output, reports, resumed=feed.resumed)
    summary.seconds = seconds
    engine = dict(reports.done[0]["engine"])
    engine["data_parallel_size"] = cfg.dp
    output.finish(summary.shards, **manifest_fields(cfg, plan, engine, reader))
    return summary


def _summary(cfg: ExtractConfig, output: Output, reports: RankReports, resumed: int) -> Summary:
    """Every rank's result added up; the prompts their engines refused go to errors.jsonl."""
    from vllm_hidden.extract.job import Summary
    from vllm_hidden.extract.run import EngineResult
    from vllm_hidden.storage.output import in_part

    ready, done = reports.ready, reports.done
    results = [EngineResult.from_dict(done[r]) for r in range(cfg.dp)]
    summary = Summary(output_dir=output.where, resumed=resumed)
    for r, res in enumerate(results):
        for bad in res.rejected:
            output.record_error(bad)
        summary.samples += res.samples
        summary.tokens += res.tokens
        summary.generated_tokens += res.generated_tokens
        summary.shards += in_part(r, res.shards)
    summary.errors = output.num_errors
    summary.engine_init_seconds = max(r["engine_init_seconds"] for r in ready.values())
    summary.first_sample_seconds = min((done[r]["first_sample_seconds"] for r in done
                                        if done[r]["first_sample_seconds"]), default=0.0)
    summary.flush_seconds = max(res.flush_seconds for res in results)
    summary.engine_start = {"warm": all(r.get("engine_start", {}).get("warm") for r in ready.values())}
    summary.ranks = [{"rank": r, **ready[r], "samples": res.samples, "tokens": res.tokens,
                      "seconds": round(res.seconds, 3), "shards": len(res.shards), "capture_stats": res.capture_stats}
                     for r, res in enumerate(results)]
    return summary
