"""Colocated training: the trainer's own process runs the target (vLLM's engine, in process)
on the trainer's GPU, and `HiddenStatesStream` yields batches whose tensors are already on that
GPU. The states go from the capture's step buffer straight into each batch's tensors
(`capture.device`): no copy to the host, no disk, no second process.

Pull-through: a batch is computed when the trainer asks for it, so target and drafter take
turns on the GPU. The order is the input's, split by rank (line i goes to rank i % world_size),
and batches are cut by a token budget, so the sequence of batches is fixed by the input, the
rank and the budget; `state_dict()` is the position after the last batch handed over, and a
stream given it back (`load_state_dict`) goes on with exactly the batches not yet handed over."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_hidden.capture.device import Destination, DeviceBatches
from vllm_hidden.capture.records import CaptureError
from vllm_hidden.colocate.batcher import PromptBatcher
from vllm_hidden.config import GenerateConfig
from vllm_hidden.inputs.reader import BadLine, Prompt

log = logging.getLogger("vllm_hidden")

STATE_VERSION = 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    try:
        return default if raw is None else int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _rows_at_most(max_tokens: int, max_model_len: int) -> Callable[[Prompt], int]:
    """Under generation, the most rows a prompt's sample may reach: its prompt, each later user
    turn (regenerate "all") and each response at max_tokens, within max_model_len."""

    def rows(p: Prompt) -> int:
        return min(max_model_len, len(p.token_ids) + sum(len(joint) for joint, _ in p.turns)
                   + (len(p.turns) + 1) * max_tokens)

    return rows


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """As given, else torch.distributed's (initialized), else torchrun's RANK / WORLD_SIZE, else 0 of 1."""
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = _env_int("RANK", 0) if rank is None else rank
            world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
    return rank, world_size


class HiddenStatesStream:
    """Batches of a prompt file's hidden states for a training loop, made by the target in this
    process. Each batch is a dict of tensors on the target's device, the samples packed one
    after another (a sample's rows are its tokens, unshifted):

    - `hidden_states` [N, K, H]: the K captured layers (layer ids as `extract` takes them);
    - `token_ids` int64 [N], `position_ids` int64 [N] (each sample from 0), `loss_mask` bool [N];
    - `cu_seqlens` int32 [B + 1]: sample b is rows cu_seqlens[b]:cu_seqlens[b + 1];
    - `final_hidden_states` [N, H] with `final_state=True` (the model's output after its final norm);
    - `ids`: the B samples' ids (the input's `id`, else its line).

    `token_budget` bounds N; a prompt longer than it is refused, naming both. Input records as
    `extract` reads them (token_ids, text, messages or conversations; JSONL, a JSON array or
    Parquet); bad records are skipped and kept in `errors`. `gpu_memory_utilization` is the
    target's share of the GPU (vLLM's, weights, KV cache and the capture buffer within it); the
    batches come out of what is left. Other vLLM engine options as `engine_args` (e.g.
    ["--quantization", "fp8"]). One process per GPU under torchrun: each rank takes its own lines.
    `lookahead=1`: a thread of its own makes the next batch while the trainer trains on this
    one (two batches alive at once); 0, the default: each batch is made when asked for.

    `generate` (a `GenerateConfig` or a dict of its fields, e.g. {"max_tokens": 256,
    "temperature": 0}): the target writes each response, as `extract --generate` does, and its
    rows come in the same pass: a sample is its prompt and the response (a conversation under
    regenerate "all": every assistant turn rewritten in order), the loss mask the response's
    tokens (with a conversation's rule), and the batch gets `generations`, each sample's record
    as `extract` writes it to generations.jsonl. The budget then counts the most rows a sample
    may reach (its prompt, each response at max_tokens, capped at max_model_len)."""

    def __init__(self, model: str, input: str | Path, *, layers: str | Sequence[int] | None = None,
                 layers_from: str | None = None, final_state: bool = False, token_budget: int = 16384,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                 loss_mask: str | None = None, engine_args: Sequence[str] = (), dtype: str = "auto",
                 cache_dir: str | None = None, rank: int | None = None, world_size: int | None = None,
                 lookahead: int = 0, generate: GenerateConfig | dict[str, Any] | None = None) -> None:
        from vllm_hidden.config import CaptureLayout, ExtractConfig
        from vllm_hidden.extract.extractor import Extractor
        from vllm_hidden.extract.plan import check_prompts, plan_extract, prompt_reader

        if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget < 1:
            raise ValueError(f"token_budget must be a positive int, got {token_budget!r}")
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 (pull-through) or 1 (one batch made ahead), got {lookahead!r}")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {gpu_memory_utilization!r}")
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.token_budget = token_budget
        self.final_state = bool(final_state)
        self.input = str(input)
        engine = list(engine_args)
        if gpu_memory_utilization is not None:
            engine += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        if isinstance(generate, dict):
            unknown = sorted(set(generate) - {f.name for f in dataclasses.fields(GenerateConfig)})
            if unknown:
                raise ValueError(f"generate: unknown option(s) {', '.join(map(repr, unknown))}; it takes "
                                 f"{', '.join(f.name for f in dataclasses.fields(GenerateConfig))}")
            generate = GenerateConfig(**generate)
        elif generate is not None and not isinstance(generate, GenerateConfig):
            raise ValueError(f"generate must be a GenerateConfig, a dict of its fields or None, got {generate!r}")
        self.generate: GenerateConfig | None = generate
        if isinstance(layers, (list, tuple)):
            layers = ",".join(str(int(x)) for x in layers)
        cfg = ExtractConfig(model=model, input_path=self.input, output_dir="", layers=layers,  # type: ignore[arg-type]
                            layers_from=layers_from, max_model_len=max_model_len, dtype=dtype,
                            engine_args=engine, cache_dir=cache_dir, loss_mask=loss_mask,
                            final_state="post-norm" if self.final_state else "none", progress=False,
                            generate=generate)
        plan = plan_extract(cfg)
        scan = check_prompts(cfg, plan)  # a systematic input mistake fails here, before the engine starts
        self.layer_ids = list(plan.layer_ids)
        cost = None
        if generate is not None:
            cost = _rows_at_most(generate.max_tokens, plan.max_prompt_len + generate.max_tokens)
        self._batcher = PromptBatcher(prompt_reader(cfg, plan), self.rank, self.world_size, token_budget, cost,
                                      scan.duplicates)
        self._batches = 0
        self._samples = 0
        self._cursor = 0  # the first input record not in a batch handed over
        self.lookahead = lookahead
        self._ahead: queue.Queue | None = None  # lookahead: made batches (or the maker's error), in order
        self._slot: threading.Semaphore | None = None  # the one batch the maker may make ahead of the trainer
        self._stop = threading.Event()
        self._maker: threading.Thread | None = None

        from vllm_hidden.engine import compat

        compat.engine_in_this_process()
        self._ex = Extractor(cfg, plan, start=False)
        # the capture buffers the worker allocates at load, inside vLLM's memory profile
        os.environ.update(CaptureLayout(final_state=self.final_state).to_env())
        self._ex.start()
        sink = self._ex.engine.collective_rpc("vllm_hidden_open_device", args=(self.final_state,))[0]
        if not isinstance(sink, DeviceBatches):
            self.close()
            raise RuntimeError(f"the engine's worker is not in this process (its capture sink came back as "
                               f"{type(sink).__name__}); colocated capture needs vLLM's one-process executor")
        self._sink = sink
        self._responses = self._ex.responses() if generate is not None else None
        self.device: torch.device = sink.device  # where the batches' tensors are
        self.hidden_size: int = sink.hidden_size
        log.info("vllm-hidden: colocated on %s: %s", sink.device, self.memory())

    # -- the stream ----------------------------------------------------------------------
    def __iter__(self) -> HiddenStatesStream:
        return self

    def __next__(self) -> dict[str, Any]:
        batch, cursor, n = self._next_made() if self.lookahead else self._make()
        if batch is None:
            raise StopIteration
        self._cursor = cursor
        self._batches += 1
        self._samples += n
        return batch

    def _make(self) -> tuple[dict[str, Any] | None, int, int]:
        """The next batch (None at the end), the cursor after it, its samples. A batch whose
        every sample failed (`generate`: each response ended by the engine at once) is not
        handed over: the next one is made. A batch that raised is read again by the next call."""
        while True:
            prompts = self._batcher.next_batch()
            if not prompts:
                return None, self._batcher.cursor, 0
            try:
                batch = self._compute(prompts) if self._responses is None else self._generated(prompts)
            except BaseException:
                self._batcher.seek(self._batcher.cursor)  # its prompts are read again, not skipped
                raise
            self._batcher.done(prompts)
            if batch is not None:
                return batch, self._batcher.cursor, len(batch["ids"])

    def _next_made(self) -> tuple[dict[str, Any] | None, int, int]:
        """lookahead=1: a thread of its own steps the engine, one batch ahead of the trainer (it
        makes batch i + 1 while the trainer trains on batch i); here the next one is taken."""
        if self._maker is None:
            self._ahead, self._slot = queue.Queue(), threading.Semaphore(1)
            self._stop.clear()
            self._maker = threading.Thread(target=self._maker_loop, name="vllm-hidden-lookahead", daemon=True)
            self._maker.start()
        assert self._ahead is not None and self._slot is not None  # (set just above)
        item = self._ahead.get()
        self._slot.release()
        if isinstance(item, BaseException):
            self._maker = None
            raise item
        return item

    def _maker_loop(self) -> None:
        assert self._ahead is not None and self._slot is not None  # (set before the thread starts)
        try:
            while True:
                self._slot.acquire()
                if self._stop.is_set():
                    return
                item = self._make()
                self._ahead.put(item)
                if item[0] is None:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's next()
            self._ahead.put(e)

    def _stop_maker(self) -> None:
        """The look-ahead thread stopped (after the batch it is making); its made batches dropped."""
        if self._maker is not None:
            self._stop.set()
            if self._slot is not None:
                self._slot.release()
            self._maker.join()
            self._maker, self._ahead = None, None

    def _compute(self, prompts: list[Prompt]) -> dict[str, Any]:
        """The prompts through the engine; their rows placed in this batch's tensors as each
        step makes them (`capture.device`)."""
        from vllm_hidden.engine import compat
        from vllm_hidden.engine.runner import REQUEST_KEY

        sink, engine = self._sink, self._ex.engine
        lengths = [len(p.token_ids) for p in prompts]
        hidden, final = self._states(sum(lengths))
        waiting: dict[str, Any] = {}  # the engine's request id -> sample key
        try:
            for p, n, at in zip(prompts, lengths, itertools.accumulate(lengths, initial=0)):
                key = f"{self.input}:{p.line}"
                sink.expect(key, Destination(hidden, at, n, final))
                rid = f"colocated-{p.line}"
                params = compat.prefill_sampling_params({REQUEST_KEY: key})
                engine.add_request(rid, {"prompt_token_ids": p.token_ids}, params)
                waiting[rid] = (key, p, n)
            while waiting:
                for out in engine.step():
                    if out.finished and out.request_id in waiting:
                        key, p, n = waiting.pop(out.request_id)
                        got = sink.finish(key)
                        if got != n:
                            raise CaptureError(f"input line {p.line} (id {p.id!r}): {got} of its {n} rows were "
                                               "captured")
        except BaseException:
            if waiting:
                engine.abort_request(list(waiting))
            sink.forget()
            raise
        return self._pack([p.id for p in prompts], hidden, final, [p.token_ids for p in prompts],
                          [p.loss_spans if p.loss_spans is not None else [(0, n)] for p, n in zip(prompts, lengths)])

    def _generated(self, prompts: list[Prompt]) -> dict[str, Any] | None:
        """`generate`: each prompt's response written by the engine while its rows are placed;
        the batch packs the samples that ended well, in input order (None: none did)."""
        done = self._respond(prompts)
        ends = [(p.id, *done[p.line]) for p in prompts if p.line in done]
        if not ends:
            return None
        final = None
        if self.final_state:
            final = torch.cat([d.final[: e.rows] for _, e, d in ends if d.final is not None])
        batch = self._pack([sid for sid, _, _ in ends], torch.cat([d.hidden[: e.rows] for _, e, d in ends]), final,
                           [e.token_ids[: e.rows] for _, e, _ in ends],
                           # without a mask of its own: the response's tokens
                           [e.loss_spans if e.loss_spans is not None else [(e.num_prompt, e.rows)] for _, e, _ in ends])
        batch["generations"] = [json.loads(e.record) for _, e, _ in ends]
        return batch

    def _states(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device tensors for `rows` rows of the captured layers (and of the final state)."""
        sink = self._sink
        hidden = torch.empty((rows, len(self.layer_ids), sink.hidden_size), dtype=sink.dtype, device=sink.device)
        final = (torch.empty((rows, sink.hidden_size), dtype=sink.dtype, device=sink.device) if self.final_state
                 else None)
        return hidden, final

    def _pack(self, ids: list[Any], hidden: torch.Tensor, final: torch.Tensor | None, token_ids: list[list[int]],
              spans: list[Any]) -> dict[str, Any]:
        """A batch of samples packed one after another: their states (on the device, placed),
        token ids and loss spans; positions and cu_seqlens from their lengths. The caller's
        stream waits on the device for the engine's copies (no host sync)."""
        sink, dev = self._sink, self._sink.device
        if sink.placed_event is not None:  # the copies ran on the engine's stream
            torch.cuda.current_stream(dev).wait_event(sink.placed_event)
        lengths = [len(t) for t in token_ids]
        mask = torch.zeros(sum(lengths), dtype=torch.bool)
        for at, sample in zip(itertools.accumulate(lengths, initial=0), spans):
            for lo, hi in sample:
                mask[at + lo : at + hi] = True
        batch = {"ids": ids, "hidden_states": hidden,
                 "token_ids": torch.tensor([t for ts in token_ids for t in ts], dtype=torch.int64).to(dev,
                                                                                                   non_blocking=True),
                 "position_ids": torch.cat([torch.arange(n) for n in lengths]).to(dev, non_blocking=True),
                 "loss_mask": mask.to(dev, non_blocking=True),
                 "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(dev)}
        if final is not None:
            batch["final_hidden_states"] = final
        return batch

    def _respond(self, prompts: list[Prompt]) -> dict[int, tuple[Any, Destination]]:
        """The prompts' responses through the engine (extract.generate.Responses says where each
        ends; one token later it is aborted). Returns, by input line, each sample that ended
        well: its ResponseEnd and its rows."""
        engine, responses = self._ex.engine, self._responses
        assert responses is not None  # (only called with generate)
        live: dict[str, tuple[Any, Destination | None]] = {}  # the engine's request id -> its Request, its rows
        done: dict[int, tuple[Any, Destination]] = {}
        aborts: list[str] = []  # ended one token past their end: to abort after the step's outputs
        try:
            for p in prompts:
                self._submit(responses.first(p), live)
            while live:
                aborts.clear()
                for out in engine.step():
                    got = None if out.request_id not in live else responses.update(
                        out.request_id, list(out.outputs[0].token_ids), out.finished)
                    if got is None:  # going on (or aborted a step ago: its last output)
                        continue
                    req, dest = live.pop(out.request_id)
                    if got.abort:
                        aborts.append(got.rid)
                    self._ended(req, dest, got, live, done)
                if aborts:
                    engine.abort_request(aborts)
                    aborts.clear()
        except BaseException:
            if live or aborts:
                engine.abort_request([*live, *aborts])
            for rid in live:
                responses.forget(rid)
            self._sink.forget()
            raise
        return done

    def _submit(self, req: Any, live: dict[str, tuple[Any, Destination | None]]) -> None:
        """A response's request into the engine; a captured one's rows get a tensor of their
        own, sized now (a conversation's last prompt is known only when its turn comes)."""
        assert self._responses is not None
        live[req.rid] = (req, None)  # (first: on a failure below, what is live is forgotten)
        if self._responses.captured(req.rid):
            hidden, final = self._states(req.rows)
            dest = Destination(hidden, 0, req.rows, final)
            self._sink.expect(req.item.id, dest)
            live[req.rid] = (req, dest)
        self._ex.engine.add_request(req.rid, {"prompt_token_ids": req.token_ids}, req.params)

    def _ended(self, req: Any, dest: Destination | None, got: Any, live: dict[str, tuple[Any, Destination | None]],
               done: dict[int, tuple[Any, Destination]]) -> None:
        """A response whose end is known: its sample complete (or dropped, or its next turn in)."""
        if got.end is not None and dest is not None:  # a captured turn: its rows are placed (its last a step ago)
            filled = self._sink.finish(req.item.id)
            if got.end.drop is None:  # (dropped: a later turn computes its rows again)
                if filled < got.end.rows:
                    raise CaptureError(f"input line {req.item.line} (id {req.item.id!r}): {filled} of its "
                                       f"{got.end.rows} rows were captured")
                done[req.item.line] = (got.end, dest)
        if got.bad is not None:
            self._batcher.errors.append(got.bad)
            log.warning("vllm-hidden: input line %d (id %r) skipped: %s", got.bad.line, got.bad.id, got.bad.reason)
        if got.next is not None:
            self._submit(got.next, live)

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: after the last batch handed over. Saved with the trainer's
        checkpoint, it brings a new stream (same input, rank, world size and budget) to the
        batch after that one."""
        g = self.generate
        return {"version": STATE_VERSION, "input": self.input, "cursor": self._cursor, "batches": self._batches,
                "samples": self._samples, "rank": self.rank, "world_size": self.world_size,
                "token_budget": self.token_budget,
                # what else cuts the batches under generate (a prompt's cost) and what the samples are
                "generate": None if g is None else {"max_tokens": g.max_tokens, "regenerate": g.regenerate}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a HiddenStatesStream state (version {STATE_VERSION}): {str(state)[:200]!r}")
        mine = self.state_dict()
        for name in ("input", "rank", "world_size", "token_budget", "generate"):
            if state.get(name) != mine[name]:
                raise ValueError(f"the saved stream had {name}={state.get(name)!r}, this one has {mine[name]!r}: "
                                 "the batches would not be the same sequence")
        self._stop_maker()
        self._batcher.seek(int(state["cursor"]))
        self._cursor = int(state["cursor"])
        self._batches, self._samples = int(state["batches"]), int(state["samples"])

    # -- resources -----------------------------------------------------------------------
    def memory(self) -> dict[str, Any]:
        """What this stream holds or will hold on the device, in bytes."""
        sink = self._sink
        per_token = (len(self.layer_ids) + self.final_state) * sink.hidden_size * sink.dtype.itemsize + 8 * 2 + 1
        return {"capture_buffer_bytes": sink.capture_bytes, "batch_bytes_at_budget": per_token * self.token_budget,
                "target_share": self._target_share()}

    def _target_share(self) -> float | None:
        from vllm_hidden.engine import compat

        return compat.gpu_memory_share(self._ex.engine)

    @property
    def errors(self) -> list[BadLine]:
        """This rank's input records skipped so far (each with its reason)."""
        return self._batcher.errors

    def counters(self) -> dict[str, int]:
        """The device sink's work so far: steps that placed rows, rows placed, device copies made."""
        s = self._sink
        return {"steps": s.steps, "rows": s.rows, "copies": s.copies, "batches": self._batches,
                "samples": self._samples}

    def close(self) -> dict[str, Any]:
        """The engine stopped; returns the capture's counters (steps, rows placed on the device,
        `host_copies`: steps copied to the host, none on this path)."""
        if getattr(self, "_maker", None) is not None:
            self._stop_maker()
        ex = getattr(self, "_ex", None)
        reply: dict[str, Any] = {}
        if ex is not None and ex.engine is not None:
            try:
                reply = next((r for r in ex.engine.collective_rpc("vllm_hidden_close") if r), {})
            finally:
                ex.close()
        return reply.get("counters", {})

    def __enter__(self) -> HiddenStatesStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
