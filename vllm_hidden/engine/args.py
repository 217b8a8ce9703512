"""The vLLM engine arguments of an extract engine: vLLM's own CLI parser, then our settings
(prefill-only sizes, the capture config, the worker extension), whether the model can be cut
to the captured layers, and the tapering scheduler for prefill-only runs."""

from __future__ import annotations

import dataclasses
import logging

from vllm_hidden.config import CaptureConfig
from vllm_hidden.engine.truncate import TRUNCATABLE_LOAD_FORMATS

log = logging.getLogger("vllm_hidden")
WORKER_EXTENSION = "vllm_hidden.engine.worker_ext.HiddenStatesWorkerExtension"

# load formats read through vLLM's default loader, whose weight iterator drops a cut model's
# extra layers (hooks.HOOKS, "loader.weights"), and random weights (nothing to drop)


def engine_args(model: str, cli_args: list[str], max_prompt_len: int, capture: CaptureConfig | None = None, *,
                dtype: str = "auto", max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                tp: int = 1, generate_tokens: int = 0, prefix_cache: bool = False):
    """vLLM EngineArgs from vLLM's own CLI parser (so every engine flag passes through), set up
    for prefill-only work; with `capture`, the vllm-hidden capture path is switched on (and
    with `capture.layers_run`, the model is cut to that many decoder layers where it can be).
    `prefix_cache` (--generate): --enable-prefix-caching is allowed (off unless given), so that a
    conversation's next turn (--regenerate all) need not compute its earlier ones again; captured
    requests never read the cache (engine.compat), so no row they store is skipped."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_hidden.engine import compat

    parser = EngineArgs.add_cli_args(compat.argument_parser("vllm-hidden extract"))
    try:
        ns = parser.parse_args(["--model", model, *cli_args])
    except SystemExit:
        raise ValueError(f"invalid engine arguments: {' '.join(cli_args)!r}") from None
    args = EngineArgs.from_cli_args(ns)
    if prefix_cache:
        args.enable_prefix_caching = bool(args.enable_prefix_caching)
    elif args.enable_prefix_caching:
        raise ValueError("--enable-prefix-caching: cached prompt tokens are not recomputed, so their "
                         "hidden states would be missing; extract runs with prefix caching off (--generate "
                         "allows it: only its uncaptured turns read the cache)")
    else:
        args.enable_prefix_caching = False
    args.skip_tokenizer_init = True  # we tokenize (and validate) before the engine
    # room for the one sampled (discarded) token; --generate: for the response and one token past it
    args.max_model_len = max_prompt_len + 1 + generate_tokens
    if dtype != "auto":
        args.dtype = dtype
    if max_num_batched_tokens is not None:
        args.max_num_batched_tokens = max_num_batched_tokens
    if max_num_seqs is not None:
        args.max_num_seqs = max_num_seqs
    if tp > 1:  # resolved against the arguments' own --tensor-parallel-size (caches.resolve_tp)
        args.tensor_parallel_size = tp
    hf_config = model_config(args)
    from vllm_hidden.engine import quant

    quant.check_platform(args.quantization, hf_config, model)
    if capture is not None:
        if args.worker_extension_cls and args.worker_extension_cls != WORKER_EXTENSION:
            raise ValueError(f"--worker-extension-cls {args.worker_extension_cls!r} cannot be combined with capture")
        args.worker_extension_cls = WORKER_EXTENSION
        if capture.layers_run is not None and not _can_truncate(args):
            capture = dataclasses.replace(capture, layers_run=None)
        if capture.layers_run is not None:
            from vllm_hidden.engine.truncate import hf_overrides

            args.hf_overrides = hf_overrides(hf_config, capture.layers_run)
        args.additional_config = {**(args.additional_config or {}), **capture.to_additional_config()}
        if not generate_tokens:
            _taper_the_end(args)
    return args


def model_config(args):
    """The model's HF config as vLLM will read it (its path, revision, remote code)."""
    from transformers import AutoConfig

    src = args.hf_config_path or args.model
    try:
        return AutoConfig.from_pretrained(src, revision=args.revision, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - re-raised with the model named
        raise ValueError(f"cannot read the model config of {src!r}: {e}") from None


def _taper_the_end(args) -> None:
    """Prefill-only: the last steps of a run shrink so that their rows reach disk as the GPU
    finishes (engine.scheduler)."""
    from vllm_hidden.engine import scheduler

    if args.scheduler_cls is not None:
        log.info("vllm-hidden: --scheduler-cls %s given; the end of a run is not tapered", args.scheduler_cls)
        return
    args.scheduler_cls = scheduler.QUALNAME


def _can_truncate(args) -> bool:
    """Whether the model can be cut to the captured layers: not with the user's own
    --hf-overrides, a loader that does not read through vLLM's default one, or a drafter."""
    if args.hf_overrides:
        log.info("vllm-hidden: --hf-overrides given; running every decoder layer")
        return False
    if str(args.load_format) not in TRUNCATABLE_LOAD_FORMATS:
        log.info("vllm-hidden: --load-format %s cannot drop the cut layers' weights; running every decoder layer",
                 args.load_format)
        return False
    if args.speculative_config:
        log.info("vllm-hidden: a speculative config needs the whole target; running every decoder layer")
        return False
    return True
