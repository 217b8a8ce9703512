"""The vLLM engine arguments of an extract engine: vLLM's own CLI parser, then our settings
(prefill-only sizes, the capture config, the worker extension), whether the model can be cut
to the captured layers, and the tapering scheduler for prefill-only runs."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging

from vllm_hidden.config import CaptureConfig
from vllm_hidden.engine.truncate import cut_in_config, hf_overrides

log = logging.getLogger("vllm_hidden")
WORKER_EXTENSION = "vllm_hidden.engine.worker_ext.HiddenStatesWorkerExtension"
UNRECOGNIZED = "unrecognized arguments: "  # argparse's words for options no parser took

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

    from vllm_hidden.engine import plugin

    plugin.activate(cli_args)  # our engine: the hooks here and in every process it starts
    args = EngineArgs.from_cli_args(parse_cli(model, cli_args))
    check_cli(args, prefix_cache=prefix_cache, capture=capture is not None)
    args.enable_prefix_caching = bool(args.enable_prefix_caching)  # off unless given (and allowed)
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
        args.worker_extension_cls = WORKER_EXTENSION
        if capture.layers_run is not None and args.speculative_config:
            log.info("vllm-hidden: a speculative config needs the whole target; running every decoder layer")
            capture = dataclasses.replace(capture, layers_run=None)
        if capture.layers_run is not None and cut_in_config(hf_config, capture.layers_run,
                                                            overrides_given=bool(args.hf_overrides),
                                                            load_format=str(args.load_format)):
            args.hf_overrides = hf_overrides(hf_config, capture.layers_run)
        args.additional_config = {**(args.additional_config or {}), **capture.to_additional_config()}
        if not generate_tokens:
            _taper_the_end(args)
    return args


class _ParseError(Exception):
    pass


def _parse_error(message: str):
    raise _ParseError(message)


def parse_cli(model: str, cli_args: list[str]) -> argparse.Namespace:
    """`cli_args` (the options extract does not take itself) through vLLM's own CLI parser, as
    `vllm serve` parses them: every engine flag of the installed vLLM passes. An option vLLM
    does not know, or a bad value, is a ValueError naming it (argparse would print usage and
    exit)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_hidden.engine import compat

    parser = EngineArgs.add_cli_args(compat.argument_parser("vllm-hidden extract"))
    parser.error = _parse_error  # argparse reports every mistake through error()
    try:
        return parser.parse_args(["--model", model, *cli_args])
    except _ParseError as e:
        raise ValueError(_explain(str(e))) from None
    except SystemExit:  # --help and the like: argparse exits by itself
        raise ValueError(f"invalid engine arguments: {' '.join(cli_args)!r}") from None


def _explain(message: str) -> str:
    """argparse's message, an unknown option named as such, with the closest of vLLM's engine
    arguments where one is close."""
    unknown = [a.split("=", 1)[0] for a in message.removeprefix(UNRECOGNIZED).split() if a.startswith("-")] \
        if message.startswith(UNRECOGNIZED) else []
    if not unknown:
        return f"vLLM engine arguments: {message}"
    from vllm.engine.arg_utils import EngineArgs

    known = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(EngineArgs)]
    close = [m for u in unknown for m in difflib.get_close_matches(u, known, n=1)]
    return (f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: not an extract "
            "option, nor one of vLLM's engine arguments (extract passes the options it does not take to vLLM's "
            "engine)" + (f"; did you mean {' or '.join(close)}?" if close else ""))


def check_cli(args, *, prefix_cache: bool = False, capture: bool = True) -> None:
    """Our rules on the engine's arguments that need nothing but them: `args` as `parse_cli`
    gives them or as vLLM's EngineArgs (the same names). A data-parallel coordinator checks
    them so, before anything is written; each engine then again, building its arguments."""
    from vllm_hidden.engine import compat

    if args.enable_prefix_caching and not prefix_cache:
        raise ValueError("--enable-prefix-caching: cached prompt tokens are not recomputed, so their "
                         "hidden states would be missing; extract runs with prefix caching off (--generate "
                         "allows it: only its uncaptured turns read the cache)")
    if not capture:
        return
    if args.worker_extension_cls and args.worker_extension_cls != WORKER_EXTENSION:
        raise ValueError(f"--worker-extension-cls {args.worker_extension_cls!r} cannot be combined with capture")
    compat.check_parallel(args.pipeline_parallel_size)


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


def with_tp(vllm_args: list[str], tp: int) -> list[str]:
    """vLLM arguments with `--tp` as --tensor-parallel-size (refused if they give another size)."""
    from vllm_hidden.engine import flags
    from vllm_hidden.engine.caches import TP_FLAGS, resolve_tp

    n = resolve_tp(vllm_args, tp)
    if n == 1 or flags.values(vllm_args, TP_FLAGS):
        return list(vllm_args)
    return [*vllm_args, "--tensor-parallel-size", str(n)]
