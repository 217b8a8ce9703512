"""The data-parallel coordinator (`vllm_hidden.extract.coordinator.run_parallel`) with fake
engines: no vLLM engine, no processes. The model's config, the prompt reader, the device
assignment and `LocalRanks` are replaced; the output (run.json, errors.jsonl, manifest.json)
is the real one, written under tmp_path.

`FakeRanks` simulates the ranks behind LocalRanks' interface: a bounded shared queue
(`put` answers False when it is full) and per-rank scripts. Ranks act only when the
coordinator calls `next_event`, and an event a rank puts becomes visible from the next call
on (as on a real queue, where an event can arrive just after a get timed out)."""

from __future__ import annotations

import json
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import vllm_hidden.devices as devices
import vllm_hidden.engine.caches as caches
import vllm_hidden.extract.coordinator as co
import vllm_hidden.extract.plan as plan
from vllm_hidden.config import ExtractConfig, ModelInfo, Plan
from vllm_hidden.extract.rank import RankDone, RankError, RankEvent, RankProgress, RankReady
from vllm_hidden.format.shard import FORMAT
from vllm_hidden.inputs import BadLine, InputScan, Prompt

PLAN = Plan(info=ModelInfo(num_layers=4, hidden_size=8, vocab_size=100, max_positions=64),
                layer_ids=[1, 2], max_prompt_len=64,
                identity={"format": FORMAT, "model": "m", "layer_ids": [1, 2], "hidden_size": 8})
SHARD_SAMPLES = 3  # a fake rank's shard holds at most this many samples
LOST = "its process exited with code -9 without reporting"


# -- fake ranks --------------------------------------------------------------------------------


@dataclass
class Script:
    """How one fake rank behaves; "call" counts the coordinator's next_event calls (from 1)."""

    ready_at: int | None = 1  # the call at which it reports ready (None: never on its own)
    ready_when: Callable[["FakeRanks"], bool] | None = None  # or: once this holds
    take_per_call: int = 1  # queue items it takes per call once ready
    done_after: int = 0  # calls between taking its end marker and reporting done
    fail_after_done: str | None = None  # a RankError right after its RankDone (its shutdown raised)
    fail_at: int | None = None  # reports a RankError at this call (before it is ready)
    die_after_taking: int | None = None  # its process dies silently once it has taken this many prompts
    error_exit_after_done: str | None = None  # ends with an error after RankDone, seen only by lost() (Ray)
    reject: frozenset = frozenset()  # ids its engine refuses


@dataclass
class RankState:
    ready: bool = False
    taken: list[tuple] = field(default_factory=list)
    got_end: bool = False
    done_at: int | None = None
    finished: bool = False
    dead: bool = False  # lost() reports it (LOST)
    errored: str | None = None  # lost() reports it (its error)


class FakeRanks:
    def __init__(self, specs: list[dict[str, Any]], scripts: list[Script], capacity: int) -> None:
        assert len(specs) == len(scripts)
        self.specs = specs
        self.scripts = scripts
        self.capacity = capacity
        self.queue: deque = deque()
        self.state = [RankState() for _ in specs]
        self.calls = 0
        self.pending: deque = deque()  # put by ranks, not yet returned by next_event
        self.delivered: list[tuple] = []  # returned by next_event, in order
        self.ready_delivered: set[int] = set()
        self.first_ready_delivered_at: float | None = None
        self.prompts: list[dict[str, Any]] = []  # every prompt put: item, when, which ready events had been delivered
        self.ends = 0  # end markers put
        self.trace: list[tuple] = []  # ("put", item) | ("event", ev) | ("close", force), in order
        self.closed: list[dict[str, Any]] = []
        self.first_prompt_call: int | None = None

    # -- the LocalRanks interface --

    def put(self, item: Any, timeout: float) -> bool:
        assert timeout > 0
        if self.closed:
            raise AssertionError("put after close")
        if len(self.queue) >= self.capacity:
            return False
        if item is None:
            self.ends += 1
        else:
            assert self.ends == 0, "a prompt was put after an end marker"
            assert isinstance(item, tuple) and len(item) == 6, item  # feed.pack: line, id, ids, spans, source, turns
            if self.first_prompt_call is None:
                self.first_prompt_call = self.calls
            self.prompts.append({"item": item, "at": time.perf_counter(), "call": self.calls,
                                 "ready": frozenset(self.ready_delivered)})
        self.queue.append(item)
        self.trace.append(("put", item))
        return True

    def next_event(self, timeout: float) -> RankEvent | None:
        assert not self.closed, "next_event after close"
        self.calls += 1
        ev = self.pending.popleft() if self.pending else None
        self._step()  # the ranks act; what they report now arrives from the next call on
        if ev is None:
            if timeout > 0:
                time.sleep(min(timeout, 0.002))
            return None
        self.delivered.append(ev)
        self.trace.append(("event", ev))
        if isinstance(ev, RankReady):
            self.ready_delivered.add(ev.rank)
            if self.first_ready_delivered_at is None:
                self.first_ready_delivered_at = time.perf_counter()
        return ev

    def lost(self, reported: set[int]) -> dict[int, str]:
        out = {}
        for r, st in enumerate(self.state):
            if r in reported:
                continue
            if st.dead:
                out[r] = LOST
            elif st.errored:
                out[r] = st.errored
        return out

    def close(self, force: bool) -> None:
        self.closed.append({"force": force, "calls": self.calls, "delivered": list(self.delivered)})
        self.trace.append(("close", force))

    # -- the simulated ranks --

    def nones_taken(self) -> int:
        return sum(st.got_end for st in self.state)

    def events_of(self, kind: type, rank: int | None = None) -> list[RankEvent]:
        return [e for e in self.delivered if isinstance(e, kind) and (rank is None or e.rank == rank)]

    def _emit(self, ev: RankEvent) -> None:
        self.pending.append(ev)

    def _step(self) -> None:
        for r, (s, st) in enumerate(zip(self.scripts, self.state)):
            if st.dead or st.finished:
                continue
            if not st.ready:
                if s.fail_at is not None and self.calls >= s.fail_at:
                    self._emit(RankError(r, "RuntimeError: CUDA out of memory while loading the model"))
                    st.finished = True
                elif (s.ready_at is not None and self.calls >= s.ready_at) or (s.ready_when and s.ready_when(self)):
                    st.ready = True
                    self._emit(RankReady(r, {"engine_init_seconds": 1.5 + r, "engine_start": {"warm": True},
                                             "ready_at": time.time(), "devices": self.specs[r]["env"]}))
                continue
            took = 0
            while not st.got_end and took < s.take_per_call and self.queue:
                item = self.queue.popleft()
                took += 1
                if item is None:
                    st.got_end = True
                    st.done_at = self.calls + s.done_after
                    break
                st.taken.append(item)
                if s.die_after_taking is not None and len(st.taken) >= s.die_after_taking:
                    st.dead = True
                    break
            if st.dead:
                continue
            if took:
                res = self.result(r)
                self._emit(RankProgress(r, res["samples"], res["tokens"]))
            if st.got_end and self.calls >= st.done_at:
                res = self.result(r)
                self._emit(RankProgress(r, res["samples"], res["tokens"]))
                self._emit(RankDone(r, res))
                if s.fail_after_done:
                    self._emit(RankError(r, s.fail_after_done))
                if s.error_exit_after_done:
                    st.errored = s.error_exit_after_done
                st.finished = True

    def result(self, r: int) -> dict[str, Any]:
        """What rank r's engine reports: its samples in shards of SHARD_SAMPLES (paths relative
        to its part), and the prompts its engine refused."""
        s, st = self.scripts[r], self.state[r]
        good = [it for it in st.taken if it[1] not in s.reject]
        shards = []
        for k in range(0, len(good), SHARD_SAMPLES):
            chunk = good[k:k + SHARD_SAMPLES]
            ntok = sum(len(it[2]) for it in chunk)
            shards.append({"file": f"shard-{k // SHARD_SAMPLES:05d}.safetensors", "bytes": 100 * ntok,
                           "blake3": f"{r:02d}{k:062d}", "num_samples": len(chunk), "num_tokens": ntok})
        return {"samples": len(good), "tokens": sum(len(it[2]) for it in good), "shards": shards,
                "rejected": [{"line": it[0], "id": it[1], "reason": "rejected by the engine: too long"}
                             for it in st.taken if it[1] in s.reject],
                "seconds": 2.0 + r, "flush_seconds": 0.25 * (r + 1), "capture_stats": {"rank": r},
                "engine": {"dtype": "bfloat16", "max_model_len": 65, "tensor_parallel_size": 1},
                "first_sample_seconds": (0.5 + r) if good else None, "finished_at": time.time()}


# -- the harness ---------------------------------------------------------------------------------


class Harness:
    def __init__(self, tmp_path, monkeypatch) -> None:
        self.tmp_path = tmp_path
        self.monkeypatch = monkeypatch
        self.out = tmp_path / "out"
        self.input = tmp_path / "in.jsonl"
        self.items: list[Prompt | BadLine] = []
        self.fakes: list[FakeRanks] = []
        self.envs_calls: list[tuple[int, int]] = []
        self.scripts: list[Script] = []
        self.capacity = 4
        monkeypatch.setattr(plan, "check_paths", lambda *a, **k: None)
        monkeypatch.setattr(plan, "plan_extract", lambda cfg: PLAN)
        monkeypatch.setattr(plan, "prompt_reader", lambda cfg, plan, input_path=None: _Reader(self.items))
        # the up-front pass over the input reads a real file: here its records are the harness's items
        monkeypatch.setattr(plan, "check_prompts",
                            lambda cfg, plan, input_path=None: InputScan(str(self.input), records=len(self.items)))
        monkeypatch.setattr(plan, "check_engine_options", lambda cfg, plan: None)  # vLLM's parser: test_bad_config

        def rank_envs(dp, tp, gpu=None):
            self.envs_calls.append((dp, tp))
            return [{"CUDA_VISIBLE_DEVICES": ",".join(str(r * tp + k) for k in range(tp))} for r in range(dp)]

        monkeypatch.setattr(devices, "rank_envs", rank_envs)

        def local_ranks(specs):
            fake = FakeRanks(specs, self.scripts, self.capacity)
            self.fakes.append(fake)
            return fake

        monkeypatch.setattr(co, "LocalRanks", local_ranks)

    @property
    def fake(self) -> FakeRanks:
        assert len(self.fakes) == 1, "LocalRanks was not created exactly once"
        return self.fakes[0]

    def prompts(self, n: int, bad: dict[int, str] | None = None) -> list[Prompt]:
        """n lines: a BadLine where `bad` says, a prompt (id "p<line>", 2..5 tokens) elsewhere."""
        bad = bad or {}
        self.items = [BadLine(i, i, bad[i]) if i in bad else Prompt(i, f"p{i}", list(range(1, 2 + i % 4 + 1)))
                      for i in range(n)]
        self.input.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(n)))
        return [p for p in self.items if isinstance(p, Prompt)]

    def cfg(self, **kw: Any) -> ExtractConfig:
        kw = {"dp": 2, **kw}
        return ExtractConfig(model="m", input_path=str(self.input), output_dir=str(self.out), progress=False,
                             cache_dir=str(self.tmp_path / "cache"), **kw)

    def run(self, scripts: list[Script], **kw: Any):
        self.scripts[:] = scripts
        if not self.input.exists():
            self.prompts(0)
        return co.run_parallel(self.cfg(dp=len(scripts), **kw))

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.out / "manifest.json").read_text())

    def errors(self) -> list[dict[str, Any]]:
        p = self.out / "errors.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


class _Reader(list):
    """The prompt reader's part the coordinator uses: its items, and what the manifest says of them."""

    def describe(self) -> dict[str, Any]:
        return {"format": "jsonl", "kinds": {"token_ids": len(self)}}


@pytest.fixture
def h(tmp_path, monkeypatch):
    # CacheDirs.apply (run_parallel's first step) sets these: restore them, present or absent
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "VHIDDEN_CACHE_DIR"):
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:
            monkeypatch.setenv(var, "x")
            monkeypatch.delenv(var)
    monkeypatch.setattr(caches, "_APPLIED", {})
    return Harness(tmp_path, monkeypatch)


def put_ids(fake: FakeRanks) -> list[Any]:
    return [p["item"][1] for p in fake.prompts]


# -- 1. success ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_two_ranks_every_prompt_once_then_one_end_marker_each_and_one_manifest(h):
    good = h.prompts(16, bad={3: "not JSON", 10: "token id 100 out of range"})
    rejected = frozenset({"p5", "p12"})  # whichever rank takes them refuses them
    summary = h.run([Script(reject=rejected), Script(reject=rejected)])
    fake = h.fake

    # every good prompt put exactly once, as (line, id, token_ids); no bad line put
    assert Counter(put_ids(fake)) == Counter(p.id for p in good)
    assert [p["item"] for p in fake.prompts] == [(p.line, p.id, p.token_ids, p.loss_spans, p.source, p.turns)
                                                    for p in good]
    # one end marker per engine, after every prompt, and no more
    assert fake.ends == 2
    assert [x for k, x in fake.trace if k == "put"][-2:] == [None, None]
    assert fake.nones_taken() == 2
    # both ranks did work, and together exactly the good prompts
    taken = [st.taken for st in fake.state]
    assert all(taken) and Counter(it[1] for t in taken for it in t) == Counter(p.id for p in good)

    # the reader's bad lines and the engines' rejections, all in errors.jsonl and counted
    errs = h.errors()
    assert sorted((e["line"], e["id"]) for e in errs) == [(3, 3), (5, "p5"), (10, 10), (12, "p12")]
    assert {e["id"]: e["reason"] for e in errs}[3] == "not JSON"
    assert summary.errors == 4
    m = h.manifest()
    assert m["num_errors"] == 4 and m["errors_file"] == "errors.jsonl"

    # the manifest lists each rank's shards under its part
    expect = sorted(f"rank-{r:03d}/{s['file']}" for r in range(2) for s in fake.result(r)["shards"])
    assert any(f.startswith("rank-000/") for f in expect) and any(f.startswith("rank-001/") for f in expect)
    assert sorted(s["file"] for s in m["shards"]) == expect
    assert sorted(s.file for s in summary.shards) == expect
    assert m["num_samples"] == len(good) - len(rejected)
    assert m["dtype"] == "bfloat16" and m["engine"]["data_parallel_size"] == 2
    assert m["layer_ids"] == PLAN.layer_ids and m["hidden_size"] == 8
    assert json.loads((h.out / "run.json").read_text()) == PLAN.identity

    # the summary adds the ranks up
    results = [fake.result(r) for r in range(2)]
    assert summary.samples == sum(r["samples"] for r in results) == len(good) - len(rejected)
    assert summary.tokens == sum(r["tokens"] for r in results)
    assert [r["rank"] for r in summary.ranks] == [0, 1]
    assert [r["samples"] for r in summary.ranks] == [r["samples"] for r in results]
    assert summary.engine_init_seconds == 2.5 and summary.flush_seconds == 0.5
    assert summary.first_sample_seconds == 0.5

    # each engine got its own part, devices, and a one-engine config; closed normally once
    assert [s["rank"] for s in fake.specs] == [0, 1]
    assert [s["env"] for s in fake.specs] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    assert [os.path.basename(s["shard"]["output_dir"]) for s in fake.specs] == ["rank-000", "rank-001"]
    assert all(s["cfg"]["dp"] == 1 and s["cfg"]["progress"] is False for s in fake.specs)
    assert [c["force"] for c in fake.closed] == [False]
    assert fake.trace[-1] == ("close", False)


# -- 2. start together ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_no_prompt_is_put_before_every_rank_is_ready(h):
    good = h.prompts(12)
    summary = h.run([Script(ready_at=1), Script(ready_at=8)])
    fake = h.fake
    ready1 = next(i for i, (k, x) in enumerate(fake.trace) if k == "event" and isinstance(x, RankReady) and x.rank == 1)
    first_put = next(i for i, (k, x) in enumerate(fake.trace) if k == "put")
    assert ready1 < first_put
    assert all(p["ready"] == {0, 1} for p in fake.prompts)
    assert fake.first_prompt_call >= 8
    assert summary.samples == len(good)
    assert all(st.taken for st in fake.state)  # both got a share from the first prompt on


@pytest.mark.timeout(20)
def test_dispatch_starts_start_together_s_after_the_first_ready_when_a_rank_is_late(h, monkeypatch):
    monkeypatch.setattr(co, "START_TOGETHER_S", 0.3)
    good = h.prompts(20)
    # rank 1 becomes ready only once prompts flow (it was compiling): waiting for it would hang
    late = Script(ready_at=None, ready_when=lambda f: f.first_prompt_call is not None
                  and f.calls >= f.first_prompt_call + 3)
    summary = h.run([Script(ready_at=1), late])
    fake = h.fake
    first = fake.prompts[0]
    assert first["ready"] == {0}
    waited = first["at"] - fake.first_ready_delivered_at
    assert 0.3 <= waited < 5.0
    # the late rank joins when ready and is part of the run
    assert fake.events_of(RankReady, 1) and fake.state[1].got_end
    assert summary.samples == len(good) and len(summary.ranks) == 2
    assert [c["force"] for c in fake.closed] == [False]


# -- 3. done, then failed -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_rank_that_fails_after_reporting_done_counts_as_done_and_the_run_waits_for_the_others(h):
    good = h.prompts(10)
    summary = h.run([Script(fail_after_done="RuntimeError: engine shutdown failed"),
                     Script(done_after=300)])
    fake = h.fake
    assert fake.events_of(RankError, 0)  # the coordinator did see rank 0's failure
    assert [c["force"] for c in fake.closed] == [False]
    # closed only after rank 1's own done, which came hundreds of calls after rank 0's
    seen = fake.closed[0]["delivered"]
    assert any(isinstance(e, RankDone) and e.rank == 1 for e in seen)
    assert fake.closed[0]["calls"] >= fake.state[1].done_at
    assert fake.state[1].done_at - fake.state[0].done_at > 200
    assert summary.samples == len(good) == sum(fake.result(r)["samples"] for r in range(2))
    m = h.manifest()
    assert m["num_samples"] == len(good)
    assert {s["file"].split("/")[0] for s in m["shards"]} == {"rank-000", "rank-001"}


# -- 4. a rank lost mid-dispatch ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_rank_lost_mid_dispatch_fails_the_run_and_the_others_still_get_end_markers(h):
    h.prompts(40)
    with pytest.raises(co.RankFailed) as exc:
        h.run([Script(), Script(die_after_taking=3)])
    fake = h.fake
    msg = str(exc.value)
    assert isinstance(exc.value, RuntimeError)
    assert "rank 1" in msg and LOST in msg and "--resume" in msg
    assert "rank 0" not in msg
    assert not (h.out / "manifest.json").exists()
    assert (h.out / "run.json").exists()  # --resume needs it
    assert [c["force"] for c in fake.closed] == [True]
    # dispatch stopped, and the survivor got an end marker, finished what it took, reported done
    assert len(fake.prompts) < 40
    assert fake.ends >= 1 and fake.state[0].got_end
    assert fake.events_of(RankDone, 0)


@pytest.mark.timeout(60)
def test_after_a_failure_ranks_that_go_quiet_are_stopped_instead_of_waited_for(h, monkeypatch):
    """A rank killed inside a queue read can leave the queue unusable for the others: they
    then take nothing and report nothing. The coordinator must not wait for them forever."""
    monkeypatch.setattr(co, "STALL_AFTER_FAILURE_S", 0.5)
    h.prompts(40)
    t0 = time.monotonic()
    with pytest.raises(co.RankFailed) as exc:
        h.run([Script(take_per_call=0), Script(die_after_taking=3)])
    assert "rank 1" in str(exc.value) and "--resume" in str(exc.value)
    assert not h.fake.events_of(RankDone, 0)
    assert [c["force"] for c in h.fake.closed] == [True]
    assert time.monotonic() - t0 < 30


# -- 5. a rank that fails before it is ready ----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ready0", [1, 10], ids=["other-ready-first", "other-ready-later"])
def test_a_rank_failing_before_ready_fails_the_run_before_any_prompt_is_put(h, ready0):
    h.prompts(10)
    with pytest.raises(co.RankFailed) as exc:
        h.run([Script(ready_at=ready0), Script(ready_at=None, fail_at=3)])
    fake = h.fake
    msg = str(exc.value)
    assert "rank 1" in msg and "CUDA out of memory" in msg and "--resume" in msg
    assert fake.prompts == []
    assert fake.ends >= 1 and fake.state[0].got_end  # rank 0 is told to stop, and does
    assert not (h.out / "manifest.json").exists()
    assert [c["force"] for c in fake.closed] == [True]


# -- 6. the engines' TP size -----------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp, args, match", [
    (2, ["--tensor-parallel-size", "4"], "disagree"),
    (2, ["-tp", "4"], "disagree"),
    (1, ["--tensor-parallel-size", "four"], "must be an int"),
])
def test_a_bad_tensor_parallel_size_fails_before_any_output_is_written(h, tp, args, match):
    h.prompts(4)
    with pytest.raises(ValueError, match=match):
        h.run([Script(), Script()], tp=tp, engine_args=args)
    assert not (h.out / "run.json").exists()
    assert h.envs_calls == [] and h.fakes == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp, args", [
    (1, ["-tp", "2"]),
    (1, ["--tensor-parallel-size", "2"]),
    (1, ["--enforce-eager", "--tensor-parallel-size=2"]),
    (2, ["-tp", "2"]),
])
def test_the_engine_args_tensor_parallel_size_decides_each_ranks_devices(h, tp, args):
    good = h.prompts(6)
    summary = h.run([Script(), Script()], tp=tp, engine_args=args)
    assert h.envs_calls == [(2, 2)]
    fake = h.fake
    assert [s["cfg"]["tp"] for s in fake.specs] == [2, 2]
    assert [s["env"] for s in fake.specs] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert summary.samples == len(good)


# -- a done event still queued when lost() reports its rank ------------------------------------------


@pytest.mark.timeout(60)
def test_a_done_still_queued_when_lost_reports_the_rank_is_not_a_failure(h):
    good = h.prompts(8)
    # rank 0 finishes last; right after putting its done, its process ends with an error
    summary = h.run([Script(done_after=20, error_exit_after_done="RuntimeError: engine shutdown failed"),
                     Script()])
    assert summary.samples == len(good)
    assert (h.out / "manifest.json").exists()


# -- the events cross process boundaries ------------------------------------------------------------


@pytest.mark.parametrize("ev", [RankReady(1, {"devices": {"CUDA_VISIBLE_DEVICES": "1"}}), RankProgress(1, 2, 30),
                                RankDone(0, {"samples": 2, "shards": []}), RankError(3, "RuntimeError: x\n")],
                         ids=lambda ev: type(ev).__name__)
def test_rank_events_survive_pickling(ev):
    import pickle

    assert pickle.loads(pickle.dumps(ev)) == ev
