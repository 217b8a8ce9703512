"""`vllm.general_plugins` entry point. vLLM calls `register()` in every process it starts.

It installs capture on whichever model runner vLLM made (`compat` says where and why): the
V1 runner's `_setup_eagle3_aux_hidden_state_outputs` (called from its `load_model` on GPU and
CPU, before torch.compile and CUDA-graph capture) and, for the V2 runner, the worker's
`load_model` (after the model is built, before its first forward). Both are pass-throughs
unless the engine's `additional_config` carries a `vllm_hidden` capture config, so
installing the package does not change plain vLLM. It wraps the default model loader's
weight iterator, a pass-through unless the model's config was truncated by us
(`engine.truncate`: the checkpoint's weights of the cut layers are dropped there). With
capture on, it also wraps the worker's `compile_or_warm_up_model` (the end of an engine's
start-up) to report whether the start was warm (`caches.StartProbe`). And it puts the
server's channel key and the name of its fetch-form directory in the environment (strings;
nothing is opened or made) for the processes vLLM starts.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_hidden.engine import compat
    from vllm_hidden.capture.channel import ensure_dir_env, ensure_key

    # vLLM registers plugins while parsing its arguments, before it starts the engine's
    # processes: a `vllm serve --middleware ...` server gets its channel key here.
    ensure_key()
    ensure_dir_env()

    runner_cls = compat.v1_runner_class()
    original = runner_cls._setup_eagle3_aux_hidden_state_outputs

    def _setup_aux_with_capture(self) -> None:
        cfg = _capture_config(self)
        if cfg is None:
            return original(self)
        from vllm_hidden.engine.runner import install_capture

        install_capture(self, cfg)

    _setup_aux_with_capture.__wrapped__ = original  # type: ignore[attr-defined]
    runner_cls._setup_eagle3_aux_hidden_state_outputs = _setup_aux_with_capture
    loader = compat.default_loader_class()
    loader.get_all_weights = _drop_cut_layers(loader.get_all_weights)
    for cls in compat.worker_classes():
        if "load_model" in vars(cls):
            cls.load_model = _capture_after_load(cls.load_model)
        if "compile_or_warm_up_model" in vars(cls):
            cls.compile_or_warm_up_model = _report_start(cls.compile_or_warm_up_model)


def _capture_config(runner):
    from vllm_hidden.config import CaptureConfig

    return CaptureConfig.from_additional_config(runner.vllm_config.additional_config)


def _capture_after_load(original):
    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        from vllm_hidden.engine import compat

        runner = getattr(self, "model_runner", None)
        if runner is None or getattr(runner, "vllm_hidden_capture", None) is not None:
            return out  # V1: installed inside its load_model
        cfg = _capture_config(runner)
        if cfg is None:
            return out
        if compat.runner_kind(runner) != "v2":  # a runner neither hook knows: never run without capture
            raise RuntimeError(f"vllm-hidden: capture could not be installed on {type(runner).__module__}."
                               f"{type(runner).__qualname__}")
        from vllm_hidden.engine.runner import install_capture

        install_capture(runner, cfg)
        return out

    load_model.__wrapped__ = original  # type: ignore[attr-defined]
    return load_model


def _report_start(original):
    def compile_or_warm_up_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        cap = getattr(getattr(self, "model_runner", None), "vllm_hidden_capture", None)
        if cap is not None:
            cap.finish_start(getattr(self.vllm_config.compilation_config, "compilation_time", None))
        return out

    compile_or_warm_up_model.__wrapped__ = original  # type: ignore[attr-defined]
    return compile_or_warm_up_model


def _drop_cut_layers(original):
    def get_all_weights(self, model_config, model):
        from vllm_hidden.engine.truncate import filter_weights, kept_layers

        weights = original(self, model_config, model)
        layers = kept_layers(model_config.hf_text_config)
        return weights if layers is None else filter_weights(weights, layers)

    get_all_weights.__wrapped__ = original  # type: ignore[attr-defined]
    return get_all_weights
