"""A truncated target: the engine builds and runs only decoder layers 0 .. n-1, where n-1 is
the deepest captured layer (prefill extraction throws the sampled token away, so the later
layers, the final norm's input and the LM head's serve no captured state).

Two pieces, both keyed on a marker in the model's HF text config, so plain vLLM and full-model
engines are untouched:
- `hf_overrides(config, n)`: vLLM's own config hook (`--hf-overrides`) sets
  `num_hidden_layers = n` (and cuts `layer_types`), so the model, its KV cache and the GDN
  state are built for n layers only. It is a dict, not a function (vLLM takes either):
  vLLM 0.26 reads an online-quantized model's config (`--quantization fp8` on a bf16
  checkpoint) from a dict only, and refuses a function there.
- `filter_weights`: a full checkpoint still holds every layer; vLLM's models look each
  weight name up among their parameters and fail on layers they do not have, so the
  loader's weight iterator (wrapped by the plugin) drops those names before the model sees
  them. Weights the kept layers need all pass, and vLLM's strict check that every parameter
  was loaded still runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

# load formats that read through vLLM's default loader, whose weight iterator drops the cut layers
TRUNCATABLE_LOAD_FORMATS = frozenset({"auto", "safetensors", "pt", "npcache", "fastsafetensors", "dummy"})
MARKER = "vllm_hidden_layers_of"  # on the text config: the full model's layer count (truncated engines only)

# decoder-layer weights of the text model, as HF checkpoints name them (Llama/Qwen "model.layers.N",
# Qwen3.5/3.6 "model.language_model.layers.N"); an MTP head's or a vision tower's own layers do not match
_LAYER = re.compile(r"^(?:model\.|model\.language_model\.|language_model\.model\.|language_model\.)?layers\.(\d+)\.")


def hf_overrides(config: Any, layers: int) -> dict[str, Any]:
    """For EngineArgs.hf_overrides: the cut of the model whose HF config is `config`. A
    vision-language checkpoint's text config is nested (Qwen3.5/3.6: `text_config`), and
    vLLM applies a nested dict to the sub-config of that name."""
    text = config.get_text_config()
    full = int(text.num_hidden_layers)
    if not 0 < layers <= full:
        raise ValueError(f"cannot run {layers} of the model's {full} decoder layers")
    cut: dict[str, Any] = {"num_hidden_layers": layers, MARKER: full}
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and len(types) == full:
        cut["layer_types"] = types[:layers]
    if text is config:
        return cut
    for name, sub in vars(config).items():
        if sub is text:
            return {name: cut}
    raise ValueError(f"cannot find where {type(config).__name__} keeps its text config")


def kept_layers(text_config: Any) -> int | None:
    """n if this engine's model is truncated to n layers, else None."""
    if getattr(text_config, MARKER, None) is None:
        return None
    return int(text_config.num_hidden_layers)


def keep_weight(name: str, layers: int) -> bool:
    m = _LAYER.match(name)
    return m is None or int(m.group(1)) < layers


def filter_weights(weights: Iterable[tuple[str, Any]], layers: int) -> Iterator[tuple[str, Any]]:
    for name, w in weights:
        if keep_weight(name, layers):
            yield name, w
