"""A fake vLLM engine behind the interface the extract driver steps (`extract.run`): the
`LLMEngine` surface it uses (add_request, step, abort_request, collective_rpc, vllm_config,
engine_core) over a fake model runner that carries our REAL capture path (`engine.hooks`
installs `engine.runner.Capture` on it, the worker RPCs are `engine.worker_ext`'s, rows go
through the step transfer, assembler and shard writer). Only vLLM's scheduler and model are
fake: requests are scheduled first come first served in chunks of the step budget, and the
"model" writes into every row a value naming its token, position and layer (`state`), so a
test knows each stored row exactly.

Faults, each as vLLM shows them to the driver: a prompt the engine's validation refuses (a
token id >= `vocab`: ValueError from add_request), an engine core that dies (`die_at_step`:
step raises and the core client marks the engine dead), rows that are NaN (`nan_token`: every
row of that token id) and a prompt whose first tokens the engine skips, as a prefix-cache hit
would (`cached_prefix_request`: the capture cannot place its rows)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from transformers import PretrainedConfig

from vllm_hidden.config import CaptureConfig
from vllm_hidden.engine import compat, hooks
from vllm_hidden.engine.worker_ext import HiddenStatesWorkerExtension

FINAL = -1  # `state`'s layer for the model's output (after the final norm)


def state(token: int, pos: int, layer: int) -> float:
    """The fake model's value at (token, position, layer): exact in float32 for token < 1024,
    position < 1024, layer < 15 (layer FINAL: the model's output)."""
    return float(((layer + 1) * 1024 + pos) * 1024 + token)


class EngineDeadError(RuntimeError):
    """What vLLM's engine client raises once its core process is gone."""


@dataclass
class Faults:
    die_at_step: int | None = None
    nan_token: int | None = None
    cached_prefix_request: int | None = None  # the n-th request (from 1) starts at its token 16


@dataclass
class _Request:
    rid: str  # the driver's id (outputs carry it)
    internal: str  # the id the scheduler and runner see (vLLM adds a suffix)
    tokens: list[int]
    params: Any
    num_prompt: int
    computed: int = 0
    generated: list[int] = field(default_factory=list)
    seen: bool = False  # the runner has been told of it


class _Aux(torch.nn.Module):
    """vLLM's EAGLE-3 interface: what capture asks of the model."""

    supports_eagle3 = True
    has_own_embed_tokens = has_own_lm_head = False

    def set_aux_hidden_state_layers(self, layers) -> None:
        self.aux = tuple(layers)

    def get_eagle3_default_aux_hidden_state_layers(self):
        return (1,)


class _Runner:
    """vLLM's V1 model runner as capture reads it (`runner_kind`: a class outside V2's module)."""

    def __init__(self, cfg: CaptureConfig, num_layers: int, hidden: int, dtype: torch.dtype, max_tokens: int,
                 max_model_len: int) -> None:
        from vllm.model_executor.models.interfaces import SupportsEagle3

        self.model = type("Model", (_Aux, SupportsEagle3), {})()
        self.model_config = SimpleNamespace(get_hidden_size=lambda: hidden, dtype=dtype, max_model_len=max_model_len,
                                            hf_text_config=SimpleNamespace(num_hidden_layers=num_layers))
        self.scheduler_config = SimpleNamespace(max_num_batched_tokens=max_tokens)
        self.vllm_config = SimpleNamespace(additional_config=cfg.to_additional_config(),
                                           parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                                                           prefill_context_parallel_size=1))
        self.device = torch.device("cpu")
        self.use_aux_hidden_state_outputs = False
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[])  # no recurrent state to clear
        self.input_batch = SimpleNamespace(req_ids=[])
        self.execute_model_state = None

    def get_model(self):
        return self.model

    def execute_model(self, scheduler_output, *args, **kwargs):
        return None


class _Worker(HiddenStatesWorkerExtension):
    def __init__(self, runner: _Runner) -> None:
        self.model_runner = runner


class FakeEngine:
    """The LLMEngine surface `extract.run` drives, over the real capture path. `layer_ids`
    are the extract's (the runner's Capture gathers them as the real one does)."""

    def __init__(self, layer_ids, *, num_layers: int, hidden: int = 16, vocab: int = 1000,
                 dtype: torch.dtype = torch.float32, max_num_batched_tokens: int = 32, max_num_seqs: int = 4,
                 max_model_len: int = 512, faults: Faults | None = None) -> None:
        self.cfg = CaptureConfig(layer_ids=tuple(layer_ids))
        self.num_layers, self.hidden, self.vocab = num_layers, hidden, vocab
        self.max_tokens, self.max_seqs = max_num_batched_tokens, max_num_seqs
        self.faults = faults or Faults()
        self.runner = _Runner(self.cfg, num_layers, hidden, dtype, max_num_batched_tokens, max_model_len)
        with mock.patch.object(compat, "is_writer_rank", lambda: True):  # no vLLM process group here
            self.capture = hooks._install_capture(self.runner, self.cfg)
        self.capture.finish_start(None)
        self.worker = _Worker(self.runner)
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype, enforce_eager=True, quantization=None,
                                         hf_config=PretrainedConfig(),
                                         hf_text_config=SimpleNamespace(num_hidden_layers=num_layers)),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens,
                                             max_num_seqs=max_num_seqs),
            parallel_config=SimpleNamespace(tensor_parallel_size=1))
        self.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_dead=False), shutdown=lambda: None)
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._finished: set[str] = set()  # internal ids the runner hears of at the next step
        self._ids = itertools.count()
        self.steps = 0
        self.added: list[str] = []
        self.aborted: list[str] = []

    # -- the engine's surface ------------------------------------------------------------------
    def add_request(self, rid: str, prompt: dict[str, Any], params) -> None:
        tokens = list(prompt["prompt_token_ids"])
        bad = [t for t in tokens if not 0 <= t < self.vocab]
        if bad:  # vLLM's own input validation
            raise ValueError(f"Token id {bad[0]} is out of vocabulary")
        self.added.append(rid)
        self._waiting.append(_Request(rid, f"{rid}-{next(self._ids)}", tokens, params, len(tokens)))

    def abort_request(self, rids) -> None:
        gone = set(rids)
        self.aborted += list(rids)
        for q in (self._waiting, self._running):
            for r in [r for r in q if r.rid in gone]:
                q.remove(r)
                self._finished.add(r.internal)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def step(self) -> list[SimpleNamespace]:
        self.steps += 1
        if self.faults.die_at_step == self.steps:
            self.engine_core.resources.engine_dead = True
            raise EngineDeadError("EngineCore encountered an issue")
        while self._waiting and len(self._running) < self.max_seqs:
            r = self._waiting.pop(0)
            if self.faults.cached_prefix_request == len(self.added) - len(self._waiting):
                r.computed = min(16, len(r.tokens) - 1)
            self._running.append(r)
        counts: dict[str, int] = {}
        budget = self.max_tokens
        for r in self._running:
            n = min(len(r.tokens) - r.computed, budget)
            if n <= 0:
                break
            counts[r.internal] = n
            budget -= n
        self._forward(counts)
        outputs = []
        for r in list(self._running):
            n = counts.get(r.internal)
            if n is None:
                continue
            r.computed += n
            if r.computed < len(r.tokens):
                continue  # a chunk of its prompt: nothing sampled
            token = (r.tokens[-1] * 7 + 3) % self.vocab  # the fake model's greedy choice
            r.generated.append(token)
            done = len(r.generated) >= r.params.max_tokens
            if not done:
                r.tokens.append(token)
            else:
                self._running.remove(r)
                self._finished.add(r.internal)
            outputs.append(SimpleNamespace(request_id=r.rid, finished=done,
                                           outputs=[SimpleNamespace(token_ids=[token])]))
        return outputs

    # -- the fake model and runner -------------------------------------------------------------
    def _forward(self, counts: dict[str, int]) -> None:
        """What vLLM's runner does for a step, as capture sees it: the scheduler's output, the
        model's aux outputs (sorted aux ids: input of layer j = output of layer j - 1) and its
        final output, then the runner's (hooked) execute_model."""
        by_id = {r.internal: r for r in self._running}
        order = list(counts)
        self.runner.input_batch.req_ids = order
        n = sum(counts.values())
        aux_ids = sorted(i + 1 for i in self.cfg.layer_ids)
        aux = [torch.empty((n, self.hidden)) for _ in aux_ids]
        final = torch.empty((n, self.hidden))
        row = 0
        for rid in order:
            r = by_id[rid]
            for j in range(counts[rid]):
                pos = r.computed + j
                tok = r.tokens[pos]
                for k, a in enumerate(aux_ids):
                    aux[k][row] = float("nan") if tok == self.faults.nan_token else state(tok, pos, a - 1)
                final[row] = state(tok, pos, FINAL)
                row += 1
        new = [SimpleNamespace(req_id=r.internal, num_computed_tokens=r.computed,
                               prompt_token_ids=r.tokens[: r.num_prompt], sampling_params=r.params, block_ids=([],))
               for r in map(by_id.get, order) if not r.seen]
        for r in map(by_id.get, order):
            r.seen = True
        cached = [rid for rid in order if rid not in {x.req_id for x in new}]
        self.runner.execute_model_state = SimpleNamespace(aux_hidden_states=[a.to(self.runner.model_config.dtype)
                                                                             for a in aux],
                                                          hidden_states=final.to(self.runner.model_config.dtype))
        finished, self._finished = self._finished, set()
        self.runner.execute_model(SimpleNamespace(
            scheduled_new_reqs=new, finished_req_ids=finished, total_num_scheduled_tokens=n,
            num_scheduled_tokens=counts,
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached,
                                                  num_computed_tokens=[by_id[rid].computed for rid in cached])))
