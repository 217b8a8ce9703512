"""The end of a prefill-only extract, shaped so that its rows are on disk soon after the GPU
finishes.

A step of N rows leaves N rows for the writers, written while later steps run. At the end of
a run there is no later step: a full last step (16,384 rows of 51 KB at 27B widths, 0.8 GB)
leaves the disk (about 2 GB/s on our GPU host) ~0.4 s of writing after the GPU is done. So once
the driver has said that no more prompts will come (`LAST_KEY` on its last request) and
fewer than two full steps of prompt tokens are left, each step takes half of what is left
(rounded up). A halved step is never under a sixteenth of a full step (`FLOOR_FRACTION`): once
half of what is left would be (under about an eighth of a full step left), the rest goes in one
step. Every step's rows are written while the next, half-size step runs, and the last step is
small. The GPU does the same work in a few more steps (mostly 3 more at the end of a run: 30,000
tokens left of 16,384-token steps go as 15,000, 7,500, 3,750, 1,875 and 1,875).

Under async scheduling the next step is made while the GPU runs this one. A prompt-only request
(`PREFILL_ONLY_KEY`: one discarded sampled token, so no later step reads its KV cache or its
recurrent state) whose last prompt token is in this step holds its blocks until this step's
output comes back, so the step made meanwhile finds the cache full: with short prompts vLLM
alternates a step that fills the cache with one of a request or two (W-short on the 27B: 44
steps, 22 of them small). Its blocks go back to the pool as soon as the step is made instead
(`_release`): every later GPU write to them is queued on the same stream after this step's own
reads and writes, and vLLM's scheduler makes no further step for a request whose max_tokens a
step in flight reaches. Only where that reasoning holds (`compat.early_release_blocker`): async
scheduling, no prefix caching (a freed block could be found by its hash), no KV connector (it
reads a finished request's blocks), no speculative decoding, one pipeline stage.

`taper_scheduler` is what the engine is given as its `scheduler_cls`: it builds the scheduler
vLLM would have picked (async or not) with these two changes. A plain vLLM engine given it
(`--scheduler-cls vllm_hidden.engine.scheduler.taper_scheduler`) schedules exactly as vLLM's, as
no request of its says it is a run's last or prompt-only; with VHIDDEN_STEP_TRACE set it records each step
as it is scheduled and as its output comes back (scripts/bench.py --step-trace, plain and
extract alike). The vLLM methods the subclass
overrides and the budget attribute it lowers are rows of `hooks.HOOKS`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import vllm_hidden.envs as envs
from vllm_hidden.engine import compat

log = logging.getLogger("vllm.vllm_hidden")  # in the engine core process: through vLLM's logging

# SamplingParams.extra_args key on the driver's last request of a run: no more will come
LAST_KEY = "vllm_hidden_last"
# SamplingParams.extra_args key of a prompt-only request (compat.prefill_sampling_params sets it)
PREFILL_ONLY_KEY = compat.PREFILL_ONLY_KEY
QUALNAME = f"{__name__}.taper_scheduler"
FLOOR_FRACTION = 16  # no halved step below this fraction of a full step (the last step, the rest, may be)
# a VHIDDEN_STEP_TRACE line: one scheduled step, and the scheduler's queues as the step was being made
TRACE_COLUMNS = ("time", "tokens", "requests", "running_before", "waiting_before", "free_blocks_before")
# a line of the trace's DONE_SUFFIX file: one step's output taken in by the scheduler (vLLM's
# update_from_output), so the GPU had finished it: the time between two is a step's own time
# where the GPU is the bottleneck, under async scheduling too (where schedule times run ahead)
DONE_SUFFIX, DONE_COLUMNS = ".done", ("time", "tokens")


def taper_budget(remaining: int, full: int) -> int:
    """Tokens the next step may take when `remaining` prompt tokens are all that is left of a
    run and a full step is `full` tokens."""
    if remaining >= 2 * full or remaining <= 0:
        return full
    half = -(-remaining // 2)
    # below the floor, the rest goes in one step rather than a full-floor one and a sliver
    return min(full, half if half >= max(1, full // FLOOR_FRACTION) else remaining)


class _Taper:
    """Mixed into vLLM's scheduler: `max_num_scheduled_tokens` (every schedule() reads its
    budget from it) follows `taper_budget` while a run drains."""

    _vh_draining = False
    _vh_taper = True  # VHIDDEN_TAPER=0: never drains (a benchmark of the taper's cost)
    _vh_trace: str | None = None  # VHIDDEN_STEP_TRACE's path (opened per step: a benchmark's, and never left open)
    _vh_release = False  # prompt-only requests' blocks freed at scheduling (taper_scheduler decides)
    _vh_releasable: set[str]  # prompt-only requests' ids whose blocks are not yet released
    max_num_scheduled_tokens: int  # vLLM's Scheduler's, which every schedule() reads its budget from
    requests: dict[str, Any]  # vLLM's Scheduler's: every request it holds, by id
    kv_cache_manager: Any  # vLLM's Scheduler's

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._vh_releasable = set()

    def add_request(self, request: Any) -> None:
        super().add_request(request)  # type: ignore[misc]
        extra = compat.request_extra_args(request)
        # the last request of a run starts its end; any other request belongs to a run still
        # being fed (or the next run on this engine)
        self._vh_draining = self._vh_taper and bool(extra.get(LAST_KEY))
        if self._vh_release and extra.get(PREFILL_ONLY_KEY) and compat.request_max_tokens(request) == 1:
            self._vh_releasable.add(request.request_id)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        trace = self._vh_trace
        before = compat.scheduler_queues(self) if trace is not None else None
        if not self._vh_draining:
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        else:
            full = self.max_num_scheduled_tokens
            self.max_num_scheduled_tokens = taper_budget(compat.prompt_tokens_left(self), full)
            try:
                out = super().schedule(*args, **kwargs)  # type: ignore[misc]
            finally:
                self.max_num_scheduled_tokens = full
        if self._vh_release and self._vh_releasable:
            self._release(out.num_scheduled_tokens)
        if trace is not None and before is not None and out.total_num_scheduled_tokens:  # see TRACE_COLUMNS
            with open(trace, "a") as f:
                f.write(f"{time.perf_counter():.6f} {out.total_num_scheduled_tokens} "
                        f"{len(out.num_scheduled_tokens)} {' '.join(map(str, before))}\n")
        return out

    def _release(self, scheduled: dict[str, int]) -> None:
        """Free the blocks of the prompt-only requests whose prompts this step completes (see the
        module's docstring); vLLM's own free when the request finishes then finds none."""
        releasable, requests, free = self._vh_releasable, self.requests, self.kv_cache_manager.free
        for rid in scheduled:
            if rid in releasable:
                request = requests[rid]
                if request.num_computed_tokens >= request.num_prompt_tokens:  # the step's tokens counted
                    releasable.discard(rid)
                    free(request)
        if len(releasable) > 2 * len(requests) + 64:  # ids of requests aborted before their last chunk
            releasable.intersection_update(requests)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        out = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._vh_trace is not None and scheduler_output.total_num_scheduled_tokens:  # see DONE_COLUMNS
            with open(self._vh_trace + DONE_SUFFIX, "a") as f:
                f.write(f"{time.perf_counter():.6f} {scheduler_output.total_num_scheduled_tokens}\n")
        return out


def taper_scheduler(*args: Any, **kwargs: Any) -> Any:
    """vLLM's scheduler for this engine (async or not, as vLLM decided), tapering at the end."""
    from vllm_hidden.engine import hooks

    base = compat.scheduler_base(*args, **kwargs)
    attrs: dict[str, Any] = {"__module__": __name__}
    trace = os.environ.get(envs.STEP_TRACE)
    if trace:  # a benchmark's record of every step, readable while the engine runs
        attrs["_vh_trace"] = trace
    attrs["_vh_taper"] = envs.get(envs.TAPER) != "0"
    blocker = "turned off (VHIDDEN_RELEASE=0)" if envs.get(envs.RELEASE) == "0" \
        else compat.early_release_blocker(compat.scheduler_vllm_config(*args, **kwargs))
    attrs["_vh_release"] = blocker is None
    cls = type(f"Tapering{base.__name__}", (_Taper, base), attrs)
    # vLLM warns about every scheduler class it did not name; say that this one is its own
    log.info("vllm-hidden: %s, with the last steps of each extract run %s and prompt-only requests' KV blocks "
             "freed %s (vLLM's own scheduler, async or not as vLLM chose: its warning about a custom scheduler class "
             "does not apply)", base.__name__,
             "tapered" if attrs["_vh_taper"] else f"not tapered ({envs.TAPER}=0)",
             "once their last prompt token is scheduled" if blocker is None else f"when they finish: {blocker}")
    scheduler = cls(*args, **kwargs)
    hooks.check_scheduler(scheduler)  # the budget it lowers while a run drains
    return scheduler
