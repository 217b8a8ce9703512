"""One run of prompts through a started engine into the worker's shards: the worker's sink opened
before and closed after (also on a failure), requests fed in a window, finished samples counted
and the written shards checked against them. Prefill-only (`_PrefillRun`: each request ends
after its one sampled token) or `--generate` (`_GenerateRun`: extract.generate decides where
each response ends, and the worker learns of the ends in batches)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm_hidden.capture.records import ResponseEnd
from vllm_hidden.errors import VllmHiddenError
from vllm_hidden.format.shard import ShardInfo
from vllm_hidden.inputs import BadLine

log = logging.getLogger("vllm_hidden")

STATUS_EVERY_S = 1.0  # how often a running extract asks the workers whether capture failed
DEFAULT_INFLIGHT_CAP = 32 << 30  # --generate: host memory for in-flight rows, at most (default)
END_EVERY_S = 0.25  # --generate: how often the ends of finished responses go to the worker (one RPC)


class CaptureFailed(VllmHiddenError, RuntimeError):
    """Capture stopped in the worker: the storage failed (`storage`: disk full, S3 unreachable
    past its retries; exit 2) or a bug (a traceback). The engine is still up."""

    def __init__(self, failure: dict[str, Any]) -> None:
        self.storage = bool(failure.get("storage"))
        self.exit_code = 2 if self.storage else None
        msg = failure["message"]
        if self.storage:
            msg += "; the shards made durable before it are kept: fix it, then rerun with --resume"
        super().__init__(msg)


def _check_capture(replies: list[Any]) -> None:
    for r in replies:
        if r:
            raise CaptureFailed(r)


class EngineDied(VllmHiddenError, RuntimeError):
    """The engine's core process died under a run (killed, out of memory, a crash in a kernel)."""


@dataclass
class EngineResult:
    """What one engine extracted from its feed (shard paths relative to its part)."""

    samples: int = 0
    tokens: int = 0
    generated_tokens: int = 0  # --generate: response tokens kept (counted in `tokens` too)
    shards: list[ShardInfo] = field(default_factory=list)
    rejected: list[BadLine] = field(default_factory=list)  # prompts the engine's own validation refused
    seconds: float = 0.0  # first prompt added .. every shard durable
    flush_seconds: float = 0.0
    capture_stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "tokens": self.tokens, "generated_tokens": self.generated_tokens,
                "shards": [s.to_dict() for s in self.shards],
                "rejected": [b.to_dict() for b in self.rejected], "seconds": self.seconds,
                "flush_seconds": self.flush_seconds, "capture_stats": self.capture_stats}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineResult:
        return cls(samples=d["samples"], tokens=d["tokens"], generated_tokens=d.get("generated_tokens", 0),
                   shards=[ShardInfo(**s) for s in d["shards"]],
                   rejected=[BadLine(b["line"], b["id"], b["reason"]) for b in d["rejected"]],
                   seconds=d["seconds"], flush_seconds=d["flush_seconds"], capture_stats=d["capture_stats"])


def run_feed(ex, feed, shard_cfg, on_progress=None, max_inflight_tokens: int | None = None) -> EngineResult:
    """`Extractor.extract`: every prompt of `feed` through `ex`'s engine into shards."""
    if ex.engine is None:
        raise RuntimeError("the extractor is closed")
    if ex.cfg.generate is not None:
        return _GenerateRun(ex, feed, shard_cfg).run(on_progress)
    return _PrefillRun(ex, feed, shard_cfg, max_inflight_tokens).run(on_progress)


class _Run:
    """The loop both modes share; a mode says what a request is and what a step's outputs mean."""

    generated_unknown = 0  # generated_tokens once samples were dropped (not known per sample)

    def __init__(self, ex, feed, shard_cfg, max_inflight_tokens: int | None) -> None:
        self.ex, self.engine, self.feed, self.shard_cfg = ex, ex.engine, feed, shard_cfg
        self.res = EngineResult()
        self.inflight: dict[str, int] = {}  # request id -> its rows
        self.tokens_inflight = 0
        self.max_tokens = max_inflight_tokens or float("inf")

    # -- what a mode defines ----------------------------------------------------------
    def _request(self, rid: str, item, extra: dict[str, Any]):
        """(sampling params, rows it holds in flight) of a prompt's request."""
        raise NotImplementedError

    def _collect(self, outputs) -> None:
        """One step's outputs: finished samples counted, their rows out of the window."""
        raise NotImplementedError

    def _begin(self, t: float) -> None:
        """The sink is open and the first request is about to go in, at time `t`."""

    def _forget(self, rid: str) -> None:
        """The engine refused this request."""

    def _idle(self) -> None:
        """Nothing in flight (the feed is waiting or done)."""

    # -- the loop -------------------------------------------------------------------------
    def _done(self, rows: int) -> int:
        ex = self.ex
        if ex.first_sample_at is None:
            ex.first_sample_at = time.perf_counter() - ex.t_created
        self.res.tokens += rows
        self.res.samples += 1
        return rows

    def _fill(self, max_inflight: int) -> None:
        """Requests into the engine up to the window (requests and rows)."""
        from vllm_hidden.engine.runner import LINE_KEY, REQUEST_KEY

        feed = self.feed
        while not feed.exhausted and len(self.inflight) < max_inflight and self.tokens_inflight < self.max_tokens:
            item = feed.next(wait=not self.inflight)
            if item is None:
                break
            rid = str(item.line)
            params, rows = self._request(rid, item, {REQUEST_KEY: item.id, LINE_KEY: item.line})
            self._submit(rid, item, item.token_ids, params, rows)

    def _submit(self, rid: str, item, token_ids: list[int], params, rows: int) -> None:
        try:
            self.engine.add_request(rid, {"prompt_token_ids": token_ids}, params)
        except ValueError as e:  # the engine's own validation
            self.res.rejected.append(BadLine(item.line, item.id, f"rejected by the engine: {e}"))
            self._forget(rid)
            return
        self.inflight[rid] = rows
        self.tokens_inflight += rows

    def run(self, on_progress) -> EngineResult:
        from vllm_hidden.engine import compat

        engine, res = self.engine, self.res
        opened = False
        try:
            opened = any(engine.collective_rpc("vllm_hidden_open", args=(self.shard_cfg.to_dict(),)))
            if not opened:
                raise RuntimeError("no worker opened a capture sink")
            max_inflight = 2 * engine.vllm_config.scheduler_config.max_num_seqs
            t1 = time.perf_counter()
            next_check = t1 + STATUS_EVERY_S
            self._begin(t1)
            while True:
                self._fill(max_inflight)
                if not self.inflight:
                    self._idle()
                    if self.feed.exhausted:
                        break
                    continue
                self._collect(engine.step())
                if on_progress is not None:
                    on_progress(res.samples, res.tokens)
                if time.perf_counter() >= next_check:  # one small RPC a second: stop soon after a failure
                    _check_capture(engine.collective_rpc("vllm_hidden_status"))
                    next_check = time.perf_counter() + STATUS_EVERY_S
            t2 = time.perf_counter()
            opened = False
            result = engine.collective_rpc("vllm_hidden_close")
            _check_capture([r.get("error") for r in result if r])
            res.seconds = time.perf_counter() - t1
            res.flush_seconds = time.perf_counter() - t2
        except Exception as e:
            if not compat.engine_dead(engine):
                raise
            opened = False  # the writer died with it; only what it had made durable counts
            raise EngineDied(f"the vLLM engine process died mid-run ({type(e).__name__}; killed, or out of memory: "
                             "see the log above); the shards made durable before it are kept: rerun with --resume "
                             "to finish") from e
        finally:
            if opened:  # failed mid-run: drop its requests, stop the writer threads, keep the engine usable
                try:
                    if self.inflight:
                        engine.abort_request(list(self.inflight))
                    engine.collective_rpc("vllm_hidden_close")  # its error, if any, is the one raised
                except Exception:  # the original error is what matters
                    log.exception("vllm-hidden: closing the capture sink after a failure")
        return self._result(result)

    def _result(self, result: list[Any]) -> EngineResult:
        """The run's result from the workers' close replies: its shards, and its counts checked
        against what was written."""
        res = self.res
        out = next(r for r in result if r is not None)
        res.shards = [ShardInfo(**s) for s in out["shards"]]
        res.capture_stats = out.get("counters", {})
        # NaN/Inf samples are not written: each becomes an error record and does not count as done
        bad = [BadLine(line, sid, why) for sid, line, why in out["not_finite"]]
        res.rejected.extend(bad)
        if bad:
            res.samples -= len(bad)
            res.tokens = sum(s.num_tokens for s in res.shards)
            res.generated_tokens = self.generated_unknown
        written = sum(s.num_samples for s in res.shards)
        if written != res.samples or out["incomplete"]:
            raise RuntimeError(f"engine finished {res.samples} samples but {written} were written "
                               f"(incomplete: {out['incomplete'][:5]}, still assembling: {out['in_flight']})")
        return res


class _PrefillRun(_Run):
    """Each request: its prompt and one sampled (discarded) token; done when the engine finishes it."""

    def _request(self, rid: str, item, extra: dict[str, Any]):
        from vllm_hidden.engine import compat
        from vllm_hidden.engine.runner import LOSS_KEY
        from vllm_hidden.engine.scheduler import LAST_KEY

        if self.shard_cfg.loss_mask:  # a few [start, end) pairs, not a per-token list
            spans = item.loss_spans if item.loss_spans is not None else [(0, len(item.token_ids))]
            extra[LOSS_KEY] = [list(s) for s in spans]  # a prompt without one: every token
        if self.feed.exhausted:  # the run's last prompt: its last steps taper (engine.scheduler)
            extra[LAST_KEY] = True
        return compat.prefill_sampling_params(extra), len(item.token_ids)

    def _collect(self, outputs) -> None:
        for o in outputs:
            if o.finished and o.request_id in self.inflight:
                self.tokens_inflight -= self._done(self.inflight.pop(o.request_id))


class _GenerateRun(_Run):
    """Each request: a response sampled by the engine (extract.generate says where it ends, one
    token later it is aborted); the worker writes a sample once it has its end. A conversation's
    later turns (--regenerate all) go in as their previous turn ends, ahead of new prompts."""

    generated_unknown = -1

    def __init__(self, ex, feed, shard_cfg) -> None:
        responses = ex.responses()
        # responses hold their rows for hundreds of steps: memory, not step-filling, sets the window
        super().__init__(ex, feed, shard_cfg, ex.generate_window(shard_cfg.final_state))
        self.responses = responses
        self.ends: list[ResponseEnd] = []  # ends not yet sent to the worker
        self.next_ends = 0.0
        self.turns: deque = deque()  # requests of conversations' next turns

    def _request(self, rid: str, item, extra: dict[str, Any]):
        req = self.responses.first(item)  # its capture keys are the responses' to give (or not)
        return req.params, req.rows

    def _fill(self, max_inflight: int) -> None:
        while self.turns:  # each takes the place of its conversation's previous turn
            req = self.turns.popleft()
            self._submit(req.rid, req.item, req.token_ids, req.params, req.rows)
        super()._fill(max_inflight)

    def _begin(self, t: float) -> None:
        self.next_ends = t + STATUS_EVERY_S

    def _forget(self, rid: str) -> None:
        self.responses.forget(rid)

    def _idle(self) -> None:
        if self.ends:
            self._send_ends()

    def _send_ends(self) -> None:
        self.engine.collective_rpc("vllm_hidden_generated", args=([e.to_dict() for e in self.ends],))
        self.ends.clear()

    def _collect(self, outputs) -> None:
        res, aborts = self.res, []
        for o in outputs:
            if o.request_id not in self.inflight:
                continue  # aborted a step ago: its last output
            got = self.responses.update(o.request_id, list(o.outputs[0].token_ids), o.finished)
            if got is None:
                continue
            self.tokens_inflight -= self.inflight.pop(o.request_id)
            if got.bad is not None:
                res.rejected.append(got.bad)
            if got.abort:
                aborts.append(got.rid)
            if got.end is not None:  # where its sample ends, or that its rows go
                self.ends.append(got.end)
            if got.next is not None:
                self.turns.append(got.next)
            if got.rows:  # the sample is complete
                self._done(got.rows)
                res.generated_tokens += got.generated
        if aborts:
            self.engine.abort_request(aborts)
        # one RPC for many samples; the worker writes a sample only once it knows its end
        if self.ends and time.perf_counter() >= self.next_ends:
            self._send_ends()
            self.next_ends = time.perf_counter() + END_EVERY_S
