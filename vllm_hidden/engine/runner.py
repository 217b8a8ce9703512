"""The capture hook inside vLLM's model runner (V1 or V2: whichever vLLM made; `compat`),
installed at model load through `hooks`.

At load (before torch.compile / CUDA-graph capture): set the selected layers as the model's
aux layers and, on the writer rank, allocate the device buffer [max_num_batched_tokens, K, H]
and the host ring; the forward writes the layers into the buffer itself (engine.stash; a model
that adds aux states inline returns them as aux outputs instead, gathered after the forward).
Per step, after the forward: the final state gathered beside them where asked, the rows'
statistics, one async D2H copy, and a small host record of which rows belong to which request
(`map_rows`, over the runner's row order); assembly and writing run on a separate thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

import torch

from vllm_hidden.capture.assembler import Assembler, AssemblerThread
from vllm_hidden.capture.channel import Publisher, routed_id
from vllm_hidden.capture.device import DeviceBatches
from vllm_hidden.capture.memory import MemorySink
from vllm_hidden.capture.records import CaptureError, NewRequest, ResponseEnd, Segment, StepRecord
from vllm_hidden.capture.ring import StepTransfer
from vllm_hidden.capture.server_env import channel_key
from vllm_hidden.config import CaptureConfig, CaptureLayout, ConnectorConfig, ShardConfig, layer_stats_default
from vllm_hidden.engine import compat, stash
from vllm_hidden.engine.caches import StartProbe, describe
from vllm_hidden.engine.serving import WORKER_KEY
from vllm_hidden.engine.state_slots import FreshStateSlots
from vllm_hidden.layers import to_aux_ids
from vllm_hidden.storage.shards import ShardWriter

log = logging.getLogger("vllm_hidden")

# SamplingParams.extra_args key marking a request for capture; its value is the sample id.
REQUEST_KEY = "vllm_hidden_id"
LINE_KEY = "vllm_hidden_line"  # its input line, named in the sink's error reports
LOSS_KEY = "vllm_hidden_loss"  # its loss mask as [start, end) token spans of ones
GEN_KEY = "vllm_hidden_rows"  # --generate: rows to reserve (prompt + max tokens); the driver says where it ends
TURN_KEY = "vllm_hidden_turn"  # --regenerate all: which response of the conversation


class Capture:
    def __init__(self, runner: Any, cfg: CaptureConfig, kind: str, layers_run: int | None = None) -> None:
        self.runner = runner
        self.kind = kind  # which of vLLM's model runners: "v1" or "v2"
        self.cfg = cfg
        self.sizes = compat.runner_sizes(runner)
        self.hidden_size = self.sizes.hidden_size
        self.layers_run = layers_run or self.sizes.num_layers  # decoder layers the forward runs (install_capture)
        self.writer_rank = compat.is_writer_rank()
        self.transfer: StepTransfer | None = None
        self.layout: CaptureLayout | None = None  # the writer rank's buffers' layout
        self.final_state = False  # the model's output (final, normed) rides as one more column
        if self.writer_rank:
            # the layout the sink will open with, as the command that started vLLM says (else an
            # extract's default): allocated now, inside vLLM's memory profile, and kept at open
            self.layout = CaptureLayout.from_env(os.environ) or CaptureLayout(row_sums=layer_stats_default())
            self.transfer = self._new_transfer(self.layout)
            logging.getLogger("vllm.vllm_hidden").info("vllm-hidden: %s", memory_line(self.transfer))
        self.stashing = False  # the forward writes the captured layers itself (engine.stash; install_capture)
        self.stash: stash.Target | None = None  # where it writes them, on the writer rank
        self.max_model_len = self.sizes.max_model_len
        self.thread: AssemblerThread | None = None
        self.writer: ShardWriter | None = None
        # "shards" (extract, opened by RPC), "publish" (server, on demand) or "device" (colocated, by RPC)
        self.sink_kind: str | None = None
        self.device_sink: DeviceBatches | None = None
        self._tracked: dict[str, int] = {}  # req id -> rows wanted (positions below it are captured)
        self.order = cfg.emit_order
        self._counters = _StepCounters()
        self.start_probe: StartProbe | None = StartProbe()
        self.start_report: dict[str, Any] | None = None
        self.fresh = FreshStateSlots(runner)  # on every rank: each holds its own part of the states

    def _new_transfer(self, layout: CaptureLayout) -> StepTransfer:
        sz = self.sizes
        return StepTransfer(sz.max_num_batched_tokens, len(self.cfg.layer_ids) + layout.final_state, sz.hidden_size,
                            sz.dtype, sz.device, self.cfg.ring_slots, fp8=layout.fp8, per_token=layout.per_token,
                            row_sums=layout.row_sums)

    def _buffers(self) -> StepTransfer:
        """The device buffer and host ring (the writer rank's: other ranks capture nothing)."""
        if self.transfer is None:
            raise CaptureError("capture's buffers are on the writer rank only")
        return self.transfer

    def _set_layout(self, layout: CaptureLayout) -> StepTransfer:
        """--final-state post-norm: the device buffer and ring get a column for the model's own
        output (after the final norm), so it travels in the step's one gather and one copy;
        --storage-dtype fp8: the rows are quantized on the device, so the copy (and the disk)
        carry half the bytes; an output with per-layer statistics: the rows' sums are reduced
        on the device too (`capture.ring`). The buffers were allocated at load for the layout
        the starting command named (`CaptureLayout`); a sink that opens with another one gets
        new buffers, which vLLM's memory profile did not see (said in the log)."""
        if layout != self.layout:
            was, old = self.layout, sum(self._buffers().device_bytes().values())
            self.transfer = None  # the old buffers go before the new ones are allocated...
            if self.sizes.device.type == "cuda":
                torch.cuda.empty_cache()  # ...and back to the device: the KV cache took the rest of the budget
            self.transfer = self._new_transfer(layout)
            self.layout = layout
            new = sum(self.transfer.device_bytes().values())
            # where the forward writes the layers itself (engine.stash) its target stays: CUDA graphs
            # hold its address; the step's layers are gathered from it into the new buffer
            kept = f" while the forward keeps writing into the first {self.stash.values.nbytes / 2**30:.2f} GiB " \
                   "(its layers are gathered from there)" if self.stash is not None else ""
            logging.getLogger("vllm.vllm_hidden").warning(
                "vllm-hidden: the capture buffers were reallocated for another layout (%s, was %s): %.2f GiB of "
                "device memory instead of the %.2f GiB vLLM profiled at start%s", layout, was,
                new / 2**30, old / 2**30, kept)
        self.final_state = layout.final_state
        return self._buffers()

    def finish_start(self, compilation_seconds: float | None) -> None:
        """End of the engine's start-up (after vLLM's warm-up): say whether it was warm."""
        if self.start_probe is None:
            return
        self.start_report = {**self.start_probe.finish(compilation_seconds), "model_runner": self.kind,
                             "layers_run": self.layers_run}
        self.start_probe = None
        if self.writer_rank:  # through vLLM's logger: the worker's own output (extract and serve)
            logging.getLogger("vllm.vllm_hidden").info("vllm-hidden: %s", describe(self.start_report))

    # -- control (via worker RPC) ---------------------------------------------------
    def open(self, shard_cfg: ShardConfig) -> bool:
        if not self.writer_rank:
            return False
        if self.thread is not None:
            raise RuntimeError(f"a capture sink ({self.sink_kind}) is already open on this worker")
        transfer = self._set_layout(CaptureLayout.for_shards(shard_cfg))
        self.writer = ShardWriter(shard_cfg, list(self.cfg.layer_ids), self.hidden_size, transfer.values_dtype)
        self.thread = AssemblerThread(Assembler(transfer, self.writer),
                                      cpus=compat.cpus_off_the_forward(self.runner.device))
        self.sink_kind = "shards"
        self._counters = _StepCounters()
        self._tracked.clear()
        return True

    def open_device(self, final_state: bool) -> DeviceBatches:
        """Colocated: the trainer runs this engine in its own process and gets the rows on the
        device (`capture.device`). The sink object itself is the reply: the RPC is a call."""
        if not self.writer_rank or compat.tp_world_size() > 1:
            raise CaptureError("colocated capture runs one engine rank in the trainer's process (no --tp)")
        if self.sink_kind is not None:
            raise RuntimeError(f"a capture sink ({self.sink_kind}) is already open on this worker")
        transfer = self._set_layout(CaptureLayout(final_state=final_state))
        self.device_sink = DeviceBatches(len(self.cfg.layer_ids), final_state, self.hidden_size, self.sizes.dtype,
                                         self.sizes.device, sum(transfer.device_bytes().values()))
        self.sink_kind = "device"
        self._counters = _StepCounters()
        self._tracked.clear()
        return self.device_sink

    def close(self) -> dict[str, Any] | None:
        if self.sink_kind == "device" and self.device_sink is not None:
            sink, self.device_sink, self.sink_kind = self.device_sink, None, None
            sink.forget()
            return {"counters": {**self._counters.to_dict(), "device_rows": sink.rows, "device_copies": sink.copies,
                                 "host_copies": self._buffers().host_copies}}
        if self.thread is None or self.sink_kind != "shards":
            return None
        thread, writer = self.thread, self.writer
        if writer is None:  # opened with the thread (open)
            raise CaptureError("a shard sink without its writer")
        self.thread = self.writer = None
        self.sink_kind = None
        error: BaseException | None = None
        t0 = time.perf_counter()
        try:
            thread.close()  # every queued step assembled
        except BaseException as e:  # noqa: BLE001 - the writer must still be shut down
            error = thread.error if thread.error is not None else e  # the cause, not its wrapper
        drain_s = time.perf_counter() - t0
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
            return {"error": failure(error)}
        asm = thread.assembler
        counters = {**self._counters.to_dict(), "assembler_busy_s": round(thread.busy_s, 3),
                 "assembler_wait_copy_s": round(asm.wait_copy_s, 3), "close_drain_s": round(drain_s, 4),
                 **writer.counters()}
        return {
            "shards": [s.to_dict() for s in shards],
            "not_finite": writer.not_finite,
            "incomplete": list(asm.dropped),
            "in_flight": in_flight,
            "counters": counters,
        }

    def generated(self, ends: list[dict[str, Any]]) -> None:
        """--generate: where these requests' responses ended (the driver's word, in the order of
        the steps: every row it speaks of was captured before this call came)."""
        if self.thread is not None and self.sink_kind == "shards" and ends:
            self.thread.put(StepRecord(None, 0, [], ends=[ResponseEnd.from_dict(e) for e in ends]))

    def status(self) -> dict[str, Any] | None:
        """The capture's failure (`failure`), if it had one; None while it is well."""
        thread = self.thread
        if thread is None or thread.error is None:
            return None
        return failure(thread.error)

    def _open_publisher(self) -> bool:
        """A server's requests: samples go back over the result channel to the API server
        process each request names."""
        pub = Publisher()
        # hs_connectors' FP8 files: quantized here, on the device
        transfer = self._set_layout(CaptureLayout.for_server(ConnectorConfig.from_env(os.environ)))
        sink = MemorySink(transfer.shape[1:], transfer.values_dtype, pub.send_sample, pub.send_failure)
        self.thread = AssemblerThread(Assembler(transfer, sink),
                                      cpus=compat.cpus_off_the_forward(self.runner.device))
        self.sink_kind = "publish"
        log.info("vllm-hidden: sending hidden states to the API server")
        return True

    def _new_request(self, extra: dict[str, Any], prompt: list[int] | None) -> NewRequest | None:
        if REQUEST_KEY in extra:
            if self.sink_kind not in ("shards", "device") or not prompt:
                return None
            rows = extra.get(GEN_KEY)
            if rows is not None:  # --generate: the prompt and the response rows
                rows = max(len(prompt), min(int(rows), self.max_model_len))
            if self.sink_kind == "device":
                return NewRequest(extra[REQUEST_KEY], prompt, rows)
            if rows is not None:
                return NewRequest(extra[REQUEST_KEY], prompt, rows, line=extra.get(LINE_KEY), generate=True,
                                  turn=int(extra.get(TURN_KEY, 0)))
            return NewRequest(extra[REQUEST_KEY], prompt, line=extra.get(LINE_KEY), loss_spans=extra.get(LOSS_KEY))
        spec = extra.get(WORKER_KEY)
        if not isinstance(spec, dict) or not prompt or self.sink_kind == "shards":
            return None
        if spec.get("key") is None or spec.get("key") != channel_key() or not isinstance(spec.get("to"), str):
            log.warning("vllm-hidden: ignoring a capture request without the server's key")
            return None
        if self.sink_kind is None and not self._open_publisher():
            return None
        rows = spec.get("rows") if spec.get("all") else None
        if rows is not None:  # the API server checked it; never trust it with memory
            rows = max(1, min(int(rows), self.max_model_len))
        return NewRequest(routed_id(spec["to"], str(spec["id"])), prompt, rows)

    # -- per step ------------------------------------------------------------------
    def _track_new(self, scheduled_new: Any, start: dict[str, int]) -> dict[str, NewRequest]:
        """The step's new requests that ask for capture (now tracked); `start` gets each new
        request's first position this step."""
        new: dict[str, NewRequest] = {}
        for r in scheduled_new:
            start[r.req_id] = r.num_computed_tokens
            if r.req_id in self._tracked:  # V2 sends a request resumed after preemption as new: its rows restart
                continue
            extra = r.sampling_params.extra_args if r.sampling_params is not None else None
            if extra:
                req = self._new_request(extra, r.prompt_token_ids)
                if req is not None:
                    new[r.req_id] = req
                    self._tracked[r.req_id] = req.rows if req.rows is not None else len(req.token_ids)
        return new

    def on_step(self, scheduler_output: Any) -> None:
        if not self.writer_rank:
            return
        preempted = compat.preempted_req_ids(scheduler_output)
        if preempted:  # their rows are computed again later (and placed over the same positions)
            self._counters.preempted += len(preempted)
        start: dict[str, int] = {}
        new = self._track_new(scheduler_output.scheduled_new_reqs, start)
        if self.device_sink is not None:
            self._device_step(self.device_sink, scheduler_output, new, start)
            return
        thread = self.thread
        if thread is None:
            return
        if thread.error is not None:
            # The writer (disk full, S3 gone) or the assembler failed: stop capturing but keep the
            # engine alive (raising here would kill it and bury the cause); the driver learns of
            # it from `status` and stops the run with this error.
            return
        segments, lo, hi, ended = self._step_rows(scheduler_output, start)
        if not segments:
            if new or ended:  # e.g. an open-ended capture finished: its sample is complete
                thread.put(StepRecord(None, 0, [], new, frozenset(ended)))
            return
        layers, staged = self._step_layers()
        st = self._counters
        t0 = time.perf_counter()
        transfer = self._buffers()
        slot = transfer.acquire()  # blocks while the host side is behind (backpressure)
        t1 = time.perf_counter()
        transfer.submit(layers, hi - lo, slot, lo, staged=staged)
        thread.put(StepRecord(slot, hi - lo, segments, new, frozenset(ended)))
        st.steps += 1
        st.rows += hi - lo
        st.last_rows.append(hi - lo)
        st.acquire_wait_s += t1 - t0
        st.submit_s += time.perf_counter() - t1

    def _device_step(self, sink: DeviceBatches, scheduler_output: Any, new: dict[str, NewRequest],
                     start: dict[str, int]) -> None:
        """Colocated: the step's captured rows gathered into the device buffer, then copied from
        there into their batches' tensors (`DeviceBatches.place`); nothing goes to the host."""
        sink.track(new)
        segments, lo, hi, _ = self._step_rows(scheduler_output, start)
        if not segments:
            return
        layers, staged = self._step_layers()
        values = self._buffers().fill(layers, hi - lo, lo, staged)
        sink.place(values, segments)
        self._counters.steps += 1
        self._counters.rows += hi - lo

    def _step_rows(self, scheduler_output: Any, start: dict[str, int]) -> tuple[list[Segment], int, int, list[str]]:
        """Both sinks' bookkeeping of a step: the running requests' first positions into `start`,
        the finished ones no longer tracked; returns the captured rows' segments (rows counted
        from `lo`: only the span [lo, hi) holding them is copied, as a server's batch mixes
        requests), lo, hi, and the tracked requests that finished."""
        tracked = self._tracked
        cached = scheduler_output.scheduled_cached_reqs
        for rid, k in zip(cached.req_ids, cached.num_computed_tokens):
            start[rid] = k
        ended = [rid for rid in scheduler_output.finished_req_ids if rid in tracked]
        for rid in ended:
            del tracked[rid]
        n = scheduler_output.total_num_scheduled_tokens
        if not tracked or not n:
            return [], 0, 0, ended
        segments, lo, hi = map_rows(compat.step_rows(self.runner, self.kind, scheduler_output.num_scheduled_tokens),
                                    tracked, start, n)
        if lo:
            segments = [Segment(s.req_id, s.row - lo, s.count, s.pos) for s in segments]
        return segments, lo, hi, ended

    def _step_layers(self) -> tuple[list[torch.Tensor], int]:
        """The step's columns for `StepTransfer.submit`: the tensors to gather and how many columns
        the forward wrote in place already (engine.stash)."""
        aux, output = compat.step_states(self.runner)
        if self.stash is not None:
            staged = self.stash.values
            if staged.data_ptr() == self._buffers().stage().data_ptr():
                layers, k = [], staged.shape[1]  # in place: the layers are in the step buffer
            else:  # the buffers were reallocated for another layout: gather from where the forward wrote
                layers, k = [staged[:, c] for c in range(staged.shape[1])], 0
        else:
            if aux is None:
                raise CaptureError("the model returned no aux hidden states for a step with captured requests")
            layers, k = [aux[i] for i in self.order], 0  # gathered in layer_ids order
        if self.final_state:
            layers.append(output)  # the model's output: after the final norm
        return layers, k


def map_rows(rows, tracked: dict[str, int], start: dict[str, int], n: int) -> tuple[list[Segment], int, int]:
    """A step's captured rows: `rows` gives each scheduled request's (id, first row, count)
    in row order, `tracked` the rows wanted per captured request (positions below it),
    `start` each request's first position this step. Returns the segments (row, count and
    position of each captured request's rows) and the span [lo, hi) holding them. The rows
    must tile [0, n) exactly, or the mapping is wrong and capture stops."""
    segments: list[Segment] = []
    lo = hi = end = 0
    for rid, row, c in rows:
        if row != end:
            raise CaptureError(f"request {rid!r} starts at row {row}, expected {end}; cannot map rows to requests")
        end = row + c
        want = tracked.get(rid)
        if want is not None and start[rid] < want:
            if not segments:
                lo = row
            segments.append(Segment(rid, row, c, start[rid]))
            hi = end
    if end != n:
        raise CaptureError(f"step rows {end} != scheduled tokens {n}; cannot map rows to requests")
    return segments, lo, hi


def failure(e: BaseException) -> dict[str, Any]:
    """A capture failure as the driver gets it (over RPC): what happened, and whether it was
    the storage (an OSError: disk full, S3 unreachable) rather than a bug."""
    return {"message": str(e) if isinstance(e, OSError) else f"hidden-state capture failed: {e!r}",
            "storage": isinstance(e, OSError)}


class _StepCounters:
    """Engine-thread cost of capture, per run: time blocked on a free ring slot
    (backpressure from the host side) and time launching the gather + copy; and the rows of
    the last few steps (what the end of a run has to write: see engine.scheduler)."""

    __slots__ = ("acquire_wait_s", "last_rows", "preempted", "rows", "steps", "submit_s")

    def __init__(self) -> None:
        self.steps = self.rows = self.preempted = 0
        self.last_rows: deque[int] = deque(maxlen=8)
        self.acquire_wait_s = self.submit_s = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "rows": self.rows, "preempted": self.preempted,
                "last_step_rows": self.last_rows[-1] if self.last_rows else 0,
                "last_steps_rows": list(self.last_rows),
                "engine_acquire_wait_s": round(self.acquire_wait_s, 3), "engine_submit_s": round(self.submit_s, 3)}


def memory_line(t: StepTransfer) -> str:
    """What the capture path holds on the device and why, for the start log and for advice on a
    start that ran out of memory."""
    parts = t.device_bytes()
    n, c, h = t.shape
    what = {"rows": f"the step buffer {n} tokens x {c} columns x {h} {str(t.values_dtype).removeprefix('torch.')} "
                    "with per-row statistics",
            "row_sums": "row-sum scratch for the per-layer statistics", "fp8": "fp8 quantization work space"}
    total = sum(parts.values())
    return (f"the capture path holds {total / 2**30:.2f} GiB of device memory ("
            + ", ".join(f"{what[k]} {v / 2**30:.3f} GiB" for k, v in parts.items())
            + f"), allocated at model load inside vLLM's memory profile (counted in the model's load memory) and "
              f"kept; it grows with --max-num-batched-tokens ({n}); the pinned host ring holds "
              f"{t.host_bytes() / 2**30:.2f} GiB more")


def memory_advice(worker: Any, error: BaseException) -> str | None:
    """For an engine start that failed for memory (vLLM's profile run, KV cache or CUDA-graph set-up)
    with capture installed on this worker: what capture holds and the settings that make room;
    None for any other failure."""
    text = str(error).lower()
    if not (isinstance(error, torch.OutOfMemoryError) or "memory" in text or "cache blocks" in text):
        return None
    cap = getattr(compat.worker_model_runner(worker), "vllm_hidden_capture", None)
    if cap is None or cap.transfer is None:
        return None
    n = cap.transfer.shape[0]  # rows: --max-num-batched-tokens
    total = sum(cap.transfer.device_bytes().values())
    return (f"vllm-hidden: {memory_line(cap.transfer)}. To make room: a smaller --max-num-batched-tokens "
            f"shrinks it in proportion, and vLLM's activations with it (--max-num-batched-tokens {max(1, n // 2)}: "
            f"{total / 2 / 2**30:.2f} GiB); or lower --max-num-seqs; or raise --gpu-memory-utilization")


def install_capture(runner: Any, cfg: CaptureConfig) -> Capture:
    """Capture's checks on this runner and its model, the model's aux layers, and the Capture
    (as `runner.vllm_hidden_capture`). `hooks` calls it, then switches the runner's aux
    outputs on and wraps its execute_model."""
    model = compat.runner_model(runner)
    if not compat.supports_aux(model):
        raise RuntimeError(
            f"vllm-hidden: {type(model).__name__} does not expose intermediate hidden states "
            "(no EAGLE-3 aux interface in vLLM for this architecture)"
        )
    if compat.aux_outputs_taken(runner):
        raise RuntimeError("vllm-hidden: a speculative method already uses the aux hidden-state path")
    num_layers = compat.runner_sizes(runner).num_layers
    bad = [i for i in cfg.layer_ids if i >= num_layers]
    if bad:
        raise ValueError(f"layer id {bad[0]} out of range; the model has {num_layers} layers")
    kind = compat.runner_kind(runner)
    compat.check_runner(runner, kind)
    compat.set_aux_layers(model, cfg.aux_ids)
    layers_run = num_layers
    if cfg.layers_run is not None and cfg.layers_run < num_layers:  # built whole: run to the deepest layer
        released = compat.run_first_layers(model, cfg.layers_run)
        if released is not None:
            layers_run = cfg.layers_run
            logging.getLogger("vllm.vllm_hidden").info(
                "vllm-hidden: the forward runs decoder layers 0-%d of %d; the %d after them never run: their "
                "weights (%.2f GiB) are released before vLLM sizes its KV cache", layers_run - 1, num_layers,
                num_layers - layers_run, released / 2**30)
        else:
            logging.getLogger("vllm.vllm_hidden").info(
                "vllm-hidden: %s has no decoder module with end_layer; every decoder layer runs", type(model).__name__)
    cap = Capture(runner, cfg, kind, layers_run)
    module = stash.aux_module(model, cfg.aux_ids)
    if module is not None:  # the forward writes the captured layers into the step buffer itself
        stash.attach(module, {aux: c for c, aux in enumerate(to_aux_ids(cfg.layer_ids))}, cap.sizes.device)
        cap.stashing = True
        if cap.transfer is not None:
            k = len(cfg.layer_ids)  # the layers' columns; a final state is gathered after the forward
            cap.stash = stash.Target(cap.transfer.stage()[:, :k], cap.transfer.copy_done)
            stash.set_target(cap.stash)
    runner.vllm_hidden_capture = cap
    how = "written into the step buffer by the forward" if module is not None else "read from the model's aux outputs"
    # through vLLM's logger: the worker's own output, in a server's log too
    logging.getLogger("vllm.vllm_hidden").info(
        "vllm-hidden: capturing layer ids %s (aux %s) on vLLM's %s model runner, %s%s", list(cfg.layer_ids),
        to_aux_ids(cfg.layer_ids), kind.upper(), how, "" if cap.writer_rank else " [not the writer rank]")
    return cap
