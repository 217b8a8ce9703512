"""A truncated target: the engine runs only decoder layers 0 .. n-1, where n-1 is the deepest
captured layer (prefill extraction throws the sampled token away, so the later layers, the
final norm's input and the LM head's serve no captured state).

Two ways, chosen by `cut_in_config`:
- the model built with n layers (below): the cut layers' weights and KV cache are not made;
- the model built whole and run to layer n (`compat.run_first_layers`, at capture install):
  for a hybrid model whose cut would cost KV cache. vLLM groups a hybrid model's layers by
  kind into groups of one size, and each request holds a block in every group: Qwen3.6-27B's
  16 attention and 48 Gated-DeltaNet layers make 4 groups of 16, but its first 62 layers
  (15 and 47) make 5 groups of 15, one of them 13/15 padding. Short prompts take one block per
  group, so the cut engine held 15% fewer of them at once than plain vLLM on the same memory,
  and its steps came out smaller (W-short, FP8, H100: 55 steps against plain's 44).
  Also for a user's own --hf-overrides or a loader that cannot drop weights.

The cut in the config: two pieces, both keyed on a marker in the model's HF text config, so
plain vLLM and full-model engines are untouched:
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

import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

log = logging.getLogger("vllm_hidden")

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


def kv_groups(layer_types: Sequence[str]) -> tuple[int, bool]:
    """(KV-cache groups, whether one is padded) of a model with these layer kinds, as vLLM
    (0.26 and 0.32, `kv_cache_utils._get_kv_cache_groups_uniform_page_size`) groups a hybrid
    model: one size for every group, the fewest layers of a kind (or the most, where the most
    are under 1.5 x the fewest), each kind split into groups of that size, the last padded."""
    counts = list(Counter(layer_types).values())
    if len(counts) < 2:
        return 1, False
    size = min(counts)
    if max(counts) < 1.5 * size:
        size = max(counts)
    return sum(-(-c // size) for c in counts), any(c % size for c in counts)


def cut_in_config(config: Any, layers: int, *, overrides_given: bool = False, load_format: str = "auto") -> bool:
    """Whether a cut to `layers` layers is made in the model's config (`hf_overrides`), or the
    model is built whole and its forward stops after that layer: so for the user's own
    --hf-overrides (`overrides_given`), a loader that does not read through vLLM's default one,
    and a hybrid model whose first `layers` layers would make vLLM pad a KV-cache group or add
    one. Says which in the log."""
    whole = f"the model is built whole and its forward stops after its first {layers} decoder layers"
    if overrides_given:
        log.info("vllm-hidden: --hf-overrides given; %s", whole)
        return False
    if load_format not in TRUNCATABLE_LOAD_FORMATS:
        log.info("vllm-hidden: --load-format %s cannot drop the cut layers' weights; %s", load_format, whole)
        return False
    text = config.get_text_config()
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and len(types) == int(text.num_hidden_layers):
        groups, _ = kv_groups(types)
        cut, padded = kv_groups(types[:layers])
        if padded or cut > groups:
            log.info("vllm-hidden: %s (built with only those, vLLM would group its KV cache into more groups: "
                     "fewer requests at once)", whole)
            return False
    log.info("vllm-hidden: the model is built with its first %d decoder layers only", layers)
    return True


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
