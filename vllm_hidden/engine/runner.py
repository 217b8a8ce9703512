"""The capture hook inside vLLM's (V1) model runner.

At load: switch on the model's aux hidden-state outputs for the selected layers (before
torch.compile / CUDA-graph capture) and, on the writer rank, allocate the device buffer
[max_num_batched_tokens, K, H] and the host ring. Per step, after the forward: one gather
into the device buffer, one async D2H copy, and a small host record of which rows belong
to which request; assembly and writing run on a separate thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_hidden.capture.assembler import Assembler, AssemblerThread, CaptureError, NewRequest, Segment, StepRecord
from vllm_hidden.capture.ring import StepTransfer
from vllm_hidden.config import CaptureConfig, ShardConfig
from vllm_hidden.engine import compat
from vllm_hidden.storage.shards import ShardWriter

log = logging.getLogger("vllm_hidden")

# SamplingParams.extra_args key marking a request for capture; its value is the sample id.
REQUEST_KEY = "vllm_hidden_id"


class Capture:
    def __init__(self, runner: Any, cfg: CaptureConfig) -> None:
        self.runner = runner
        self.cfg = cfg
        mc = runner.model_config
        self.hidden_size = mc.get_hidden_size()
        self.writer_rank = compat.is_writer_rank()
        self.transfer: StepTransfer | None = None
        if self.writer_rank:
            self.transfer = StepTransfer(
                runner.scheduler_config.max_num_batched_tokens,
                len(cfg.layer_ids),
                self.hidden_size,
                mc.dtype,
                runner.device,
                cfg.ring_slots,
            )
        self.thread: AssemblerThread | None = None
        self.writer: ShardWriter | None = None
        self._tracked: set[str] = set()
        self.order = cfg.emit_order
        self._stats = _StepStats()

    # -- control (via worker RPC) ---------------------------------------------------
    def open(self, shard_cfg: ShardConfig) -> bool:
        if not self.writer_rank:
            return False
        if self.thread is not None:
            raise RuntimeError("a capture sink is already open on this worker")
        self.writer = ShardWriter(shard_cfg, list(self.cfg.layer_ids), self.hidden_size, self.transfer.device_buf.dtype)
        self.thread = AssemblerThread(Assembler(self.transfer, self.writer),
                                      cpus=compat.cpus_off_the_forward(self.runner.device))
        self._stats = _StepStats()
        self._tracked.clear()
        return True

    def close(self) -> dict[str, Any] | None:
        if self.thread is None:
            return None
        thread, writer = self.thread, self.writer
        self.thread = self.writer = None
        error: BaseException | None = None
        try:
            thread.close()  # every queued step assembled
        except BaseException as e:  # noqa: BLE001 - the writer must still be shut down
            error = e
        in_flight = thread.assembler.in_flight
        try:
            thread.assembler.abandon()
        except BaseException as e:  # noqa: BLE001 - a failed writer refuses drops; close it anyway
            error = error or e
        try:
            shards = writer.close()  # every shard durable
        except BaseException as e:  # noqa: BLE001
            error = error or e
        if error is not None:
            raise error
        asm = thread.assembler
        stats = {**self._stats.to_dict(), "assembler_busy_s": round(thread.busy_s, 3),
                 "assembler_wait_copy_s": round(asm.wait_copy_s, 3), **writer.stats()}
        return {
            "shards": [s.to_dict() for s in shards],
            "incomplete": list(asm.dropped),
            "in_flight": in_flight,
            "stats": stats,
        }

    # -- per step ------------------------------------------------------------------
    def on_step(self, scheduler_output: Any) -> None:
        thread = self.thread
        if thread is None:
            return
        thread.check()
        tracked = self._tracked
        new: dict[str, NewRequest] = {}
        start: dict[str, int] = {}
        for r in scheduler_output.scheduled_new_reqs:
            start[r.req_id] = r.num_computed_tokens
            extra = r.sampling_params.extra_args if r.sampling_params is not None else None
            if extra and REQUEST_KEY in extra:
                new[r.req_id] = NewRequest(extra[REQUEST_KEY], r.prompt_token_ids)
                tracked.add(r.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for rid, k in zip(cached.req_ids, cached.num_computed_tokens):
            start[rid] = k
        finished = scheduler_output.finished_req_ids
        tracked.difference_update(finished)
        if not tracked and not new:
            return
        state = self.runner.execute_model_state
        aux = getattr(state, "aux_hidden_states", None)
        if aux is None:
            return
        n = scheduler_output.total_num_scheduled_tokens
        counts = scheduler_output.num_scheduled_tokens
        segments: list[Segment] = []
        row = 0
        any_tracked = False
        for rid in self.runner.input_batch.req_ids:  # row order of the step's tokens
            c = counts.get(rid, 0)
            if c and rid in tracked:
                segments.append(Segment(rid, row, c, start[rid]))
                any_tracked = True
            row += c
        if row != n:
            raise CaptureError(f"step rows {row} != scheduled tokens {n}; cannot map rows to requests")
        if not any_tracked:
            return
        st = self._stats
        t0 = time.perf_counter()
        slot = self.transfer.acquire()  # blocks while the host side is behind (backpressure)
        t1 = time.perf_counter()
        self.transfer.submit([aux[i] for i in self.order], n, slot)  # gathered in layer_ids order
        thread.put(StepRecord(slot, n, segments, new, frozenset(finished)))
        st.steps += 1
        st.rows += n
        st.acquire_wait_s += t1 - t0
        st.submit_s += time.perf_counter() - t1


class _StepStats:
    """Engine-thread cost of capture, per run: time blocked on a free ring slot
    (backpressure from the host side) and time launching the gather + copy."""

    __slots__ = ("steps", "rows", "acquire_wait_s", "submit_s")

    def __init__(self) -> None:
        self.steps = self.rows = 0
        self.acquire_wait_s = self.submit_s = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "rows": self.rows, "engine_acquire_wait_s": round(self.acquire_wait_s, 3),
                "engine_submit_s": round(self.submit_s, 3)}


def install_capture(runner: Any, cfg: CaptureConfig) -> Capture:
    model = runner.get_model()
    if not compat.supports_aux(model):
        raise RuntimeError(
            f"vllm-hidden: {type(model).__name__} does not expose intermediate hidden states "
            "(no EAGLE-3 aux interface in vLLM for this architecture)"
        )
    if runner.use_aux_hidden_state_outputs:
        raise RuntimeError("vllm-hidden: a speculative method already uses the aux hidden-state path")
    num_layers = runner.model_config.hf_text_config.num_hidden_layers
    bad = [i for i in cfg.layer_ids if i >= num_layers]
    if bad:
        raise ValueError(f"layer id {bad[0]} out of range; the model has {num_layers} layers")
    runner.use_aux_hidden_state_outputs = True
    model.set_aux_hidden_state_layers(cfg.aux_ids)
    cap = Capture(runner, cfg)
    runner.vllm_hidden_capture = cap

    original = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        out = original(scheduler_output, *args, **kwargs)
        cap.on_step(scheduler_output)
        return out

    runner.execute_model = execute_model
    log.info("vllm-hidden: capturing layer ids %s (aux %s)%s", list(cfg.layer_ids), [i + 1 for i in cfg.layer_ids],
             "" if cap.writer_rank else " [not the writer rank]")
    return cap
