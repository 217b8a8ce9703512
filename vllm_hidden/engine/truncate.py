"""A truncated target: the engine builds and runs only decoder layers 0 .. n-1, where n-1 is
the deepest captured layer (prefill extraction throws the sampled token away, so the later
layers, the final norm's input and the LM head's serve no captured state).

Two pieces, both keyed on a marker in the model's HF text config, so plain vLLM and full-model
engines are untouched:
- `hf_overrides(n)`: vLLM's own config hook (`ModelConfig.hf_overrides` takes a callable)
  sets `num_hidden_layers = n` (and cuts `layer_types`), so the model, its KV cache and the
  GDN state are built for n layers only.
- `filter_weights`: a full checkpoint still holds every layer; vLLM's models look each
  weight name up among their parameters and fail on layers they do not have, so the
  loader's weight iterator (wrapped by the plugin) drops those names before the model sees
  them. Weights the kept layers need all pass, and vLLM's strict check that every parameter
  was loaded still runs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from typing import Any

MARKER = "vllm_hidden_layers_of"  # on the text config: the full model's layer count (truncated engines only)

# decoder-layer weights of the text model, as HF checkpoints name them (Llama/Qwen "model.layers.N",
# Qwen3.5/3.6 "model.language_model.layers.N"); an MTP head's or a vision tower's own layers do not match
_LAYER = re.compile(r"^(?:model\.|model\.language_model\.|language_model\.model\.|language_model\.)?layers\.(\d+)\.")


def _truncate(config: Any, layers: int) -> Any:
    text = config.get_text_config()
    if getattr(text, "num_hidden_layers", None) is None:
        return config  # vLLM first calls it on an empty config, to see whether it changes model_type
    full = int(text.num_hidden_layers)
    if not 0 < layers <= full:
        raise ValueError(f"cannot run {layers} of the model's {full} decoder layers")
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and len(types) == full:
        text.layer_types = types[:layers]
    text.num_hidden_layers = layers
    setattr(text, MARKER, full)
    return config


def hf_overrides(layers: int):
    """For EngineArgs.hf_overrides (picklable: the engine's processes get it with the config)."""
    return functools.partial(_truncate, layers=layers)


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
