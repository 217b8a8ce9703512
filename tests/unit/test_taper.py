"""The end of a prefill-only run: the step budget while a run drains (engine.scheduler), on a
stand-in for vLLM's scheduler (the real one runs in tests/integration/test_extract.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hidden.engine.scheduler import LAST_KEY, _Taper, taper_budget


def drain(remaining: int, full: int) -> list[int]:
    steps = []
    while remaining:
        n = min(remaining, taper_budget(remaining, full))
        steps.append(n)
        remaining -= n
    return steps


@pytest.mark.parametrize("full", [1, 2, 8, 64, 1000, 16384])
def test_budget_shape(full):
    for remaining in range(0, 5 * full + 3):
        b = taper_budget(remaining, full)
        assert 1 <= b <= full
        if remaining >= 2 * full or remaining == 0:
            assert b == full  # nothing to taper yet (or nothing left)
    for remaining in range(1, 3 * full + 3):
        steps = drain(remaining, full)
        assert sum(steps) == remaining and all(s <= full for s in steps)
        tail = [s for i, s in enumerate(steps) if sum(steps[i:]) < 2 * full]
        # once under two full steps: each step at most the one before it, and at least half of it
        # (its rows are written while the next, smaller step runs), the last under 2/16 of a full one
        assert all(b <= a <= 2 * b + 1 for a, b in zip(tail, tail[1:])), steps
        if full >= 16 and remaining >= full:
            assert steps[-1] <= max(1, 2 * (full // 16))


def test_budget_at_27b_steps():
    # W-chat's end at 16,384-token steps: a step of 3,435 rows after a full one, tapered
    assert drain(16384 + 3435, 16384) == [9910, 4955, 2477, 1239, 1238]
    assert drain(40000, 16384) == [16384, 11808, 5904, 2952, 1476, 1476]


class _Base:
    """What the mixin relies on in vLLM's Scheduler: add_request, schedule() reading its
    budget from max_num_scheduled_tokens, and the requests it holds."""

    def __init__(self, full: int) -> None:
        self.max_num_scheduled_tokens = full
        self.requests: dict[str, SimpleNamespace] = {}
        self.budgets: list[int] = []

    def add_request(self, request) -> None:
        self.requests[request.request_id] = request

    def schedule(self, *args, **kwargs):
        budget = self.max_num_scheduled_tokens
        self.budgets.append(budget)
        for r in self.requests.values():  # FCFS chunked prefill
            n = min(budget, r.num_prompt_tokens - r.num_computed_tokens)
            r.num_computed_tokens += n
            budget -= n
        self.requests = {k: r for k, r in self.requests.items() if r.num_computed_tokens < r.num_prompt_tokens}
        return (args, kwargs)


class _Sched(_Taper, _Base):
    pass


def _request(rid: str, n: int, last: bool = False, extra: bool = True) -> SimpleNamespace:
    params = SimpleNamespace(extra_args={"vllm_hidden_id": rid, **({LAST_KEY: True} if last else {})}
                             if extra else None)
    return SimpleNamespace(request_id=rid, num_prompt_tokens=n, num_computed_tokens=0, sampling_params=params)


def _run(s: _Sched) -> list[int]:
    s.budgets.clear()
    while s.requests:
        assert s.schedule(True, k=1) == ((True,), {"k": 1})  # arguments pass through
    return list(s.budgets)


def test_scheduler_tapers_only_after_the_last_request():
    s = _Sched(100)
    for i in range(5):
        s.add_request(_request(f"r{i}", 100))
    assert _run(s) == [100] * 5  # the feed goes on: full steps to the end
    for i in range(4):
        s.add_request(_request(f"a{i}", 100))
    s.add_request(_request("a4", 30, last=True))
    budgets = _run(s)
    assert budgets == [100, 100, 100, 65, 33, 16, 8, 8]  # 430 tokens: under 200 left, half of it
    assert s.max_num_scheduled_tokens == 100  # restored after every step


def test_scheduler_next_run_is_not_tapered():
    s = _Sched(100)
    s.add_request(_request("a", 150, last=True))
    assert _run(s) == [75, 38, 19, 9, 9]  # the last 9: half of it is under 100 // 16
    # the next run on the same engine: its requests come without the marker
    s.add_request(_request("b", 150))
    s.add_request(_request("c", 150, extra=False))  # a request with no extra args at all
    assert _run(s) == [100, 100, 100]


def test_taper_off_schedules_full_steps_to_the_end():
    class Untapered(_Sched):
        _vh_taper = False  # what taper_scheduler sets under VHIDDEN_TAPER=0

    s = Untapered(100)
    s.add_request(_request("a", 150, last=True))
    assert _run(s) == [100, 100]


def test_the_step_trace_has_a_line_per_step_with_its_tokens_requests_and_queues(tmp_path):
    from vllm_hidden.engine.scheduler import TRACE_COLUMNS

    class OutBase(_Base):  # what vLLM's schedule() returns, and its queues, as far as the trace reads them
        kv_cache_manager = SimpleNamespace(block_pool=SimpleNamespace(get_num_free_blocks=lambda: 7))

        @property
        def running(self):  # started, not finished
            return [r for r in self.requests.values() if r.num_computed_tokens]

        @property
        def waiting(self):
            return [r for r in self.requests.values() if not r.num_computed_tokens]

        def schedule(self, *args, **kwargs):
            budget = self.max_num_scheduled_tokens
            sizes = {}
            for r in self.requests.values():
                n = min(budget, r.num_prompt_tokens - r.num_computed_tokens)
                if n:
                    sizes[r.request_id] = n
                r.num_computed_tokens += n
                budget -= n
            self.requests = {k: r for k, r in self.requests.items() if r.num_computed_tokens < r.num_prompt_tokens}
            return SimpleNamespace(total_num_scheduled_tokens=sum(sizes.values()), num_scheduled_tokens=sizes)

    class Traced(_Taper, OutBase):
        pass

    s = Traced(100)
    trace = tmp_path / "steps.txt"
    s._vh_trace = str(trace)
    for i, n in enumerate((60, 60, 30)):
        s.add_request(_request(f"r{i}", n))
    while s.requests:
        s.schedule()
    s.schedule()  # an idle step (nothing scheduled) is not a step
    rows = [line.split() for line in trace.read_text().splitlines()]
    assert all(len(r) == len(TRACE_COLUMNS) for r in rows)
    # 100 tokens of r0 (60) and r1 (40 of 60), then r1's last 20 and r2's 30: running and
    # waiting as each step was made (r1 started, r2 not), free blocks as the pool said
    assert [[int(x) for x in r[1:]] for r in rows] == [[100, 2, 0, 3, 7], [50, 2, 1, 1, 7]]
    assert float(rows[0][0]) <= float(rows[1][0])  # perf_counter times, in order


def test_the_done_trace_has_a_line_per_step_whose_output_came_back(tmp_path):
    from vllm_hidden.engine.scheduler import DONE_COLUMNS, DONE_SUFFIX

    class OutBase(_Base):  # vLLM's update_from_output, as far as the trace reads its argument
        def update_from_output(self, scheduler_output, model_runner_output):
            return {"handled": scheduler_output.total_num_scheduled_tokens}

    class Traced(_Taper, OutBase):
        pass

    s = Traced(100)
    step = lambda n: SimpleNamespace(total_num_scheduled_tokens=n)  # noqa: E731
    assert s.update_from_output(step(5), None) == {"handled": 5}  # untraced: vLLM's result, no file
    s._vh_trace = str(tmp_path / "steps.txt")
    outs = [s.update_from_output(step(n), None) for n in (100, 0, 37)]
    assert outs == [{"handled": 100}, {"handled": 0}, {"handled": 37}]  # vLLM's own result passed on
    rows = [line.split() for line in (tmp_path / ("steps.txt" + DONE_SUFFIX)).read_text().splitlines()]
    # an output of no scheduled tokens is not a step's
    assert [int(r[1]) for r in rows] == [100, 37] and all(len(r) == len(DONE_COLUMNS) for r in rows)
    assert float(rows[0][0]) <= float(rows[1][0])
    assert not (tmp_path / "steps.txt").exists()  # schedule()'s own file is written by schedule() only
