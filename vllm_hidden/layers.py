"""Layer-id semantics and resolution (pure; no vLLM).

Project `layer_ids` name the OUTPUT of decoder layer i (0-based), i.e. HF
`output_hidden_states[i + 1]` and DFlash `target_layer_ids`. vLLM / EAGLE-3 "aux" id j
names the INPUT of layer j (HF `output_hidden_states[j]`), so aux j == layer id j - 1.
Every state is the residual stream as the model computes it: for the last layer that is
before the final norm (HF's `output_hidden_states[-1]` is after it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEMANTICS = (
    "layer_ids[k] = output of decoder layer k (0-based) = HF output_hidden_states[k+1]; "
    "residual stream, before the final norm for the last layer; vLLM aux id = layer_id + 1"
)
DEFAULT_NUM_LAYERS = 5
log = logging.getLogger(__name__)


def dflash_default_layer_ids(num_layers: int, num_draft_layers: int = DEFAULT_NUM_LAYERS) -> list[int]:
    """DFlash's default: `num_draft_layers` ids spread evenly over 1 .. num_layers - 3."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers!r}")
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers!r}")
    if num_draft_layers == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    if end <= start:  # tiny models: spread over every layer instead
        start, end = 0, num_layers - 1
    span = end - start
    ids = [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return sorted(set(ids))


def parse_id_list(spec: str | Sequence[int], what: str = "--layers") -> list[int]:
    """Parse '1,16,31' (or a sequence of ints) into a list of ints."""
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",")]
        if not spec.strip() or any(p == "" for p in parts):
            raise ValueError(f"{what}: empty layer id in {spec!r}")
        try:
            return [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"{what}: layer ids must be integers, got {spec!r}") from None
    ids = list(spec)
    for v in ids:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{what}: layer ids must be integers, got {v!r}")
    return ids


@dataclass(frozen=True)
class DrafterLayers:
    """The layers a drafter config asks for, read with the meaning of the project that wrote it."""

    kind: str  # one of DRAFTER_KINDS
    key: str  # where the ids are in the config
    config_ids: list[int]
    layer_ids: list[int]  # this project's layer ids (output of layer i)

    def describe(self, path: str | Path) -> str:
        return (f"--layers-from {str(path)!r}: a {self.kind} config, {self.key} = {self.config_ids} -> layer ids "
                f"{self.layer_ids} ({DRAFTER_KINDS[self.kind]})")

    def to_dict(self, path: str | Path) -> dict[str, Any]:
        return {"path": str(path), "kind": self.kind, "key": self.key, "config_ids": self.config_ids,
                "meaning": DRAFTER_KINDS[self.kind]}


# How each project reads its drafter config's layer ids (docs/train-a-drafter.md cites the sources).
DRAFTER_KINDS = {
    "dflash": "DFlash (z-lab, SpecForge): target_layer_ids index HF hidden_states[id + 1], the output of layer id "
              "(= layer id)",
    "sglang-eagle3": "SGLang/SpecForge EAGLE-3: SGLang captures the input of layer id + 1, the output of layer id "
                     "(= layer id)",
    "vllm-eagle3": "vLLM EAGLE-3: aux id j is the input of layer j (= layer id j - 1)",
    "speculators-eagle3": "speculators EAGLE-3: vLLM aux ids (= layer id j - 1), plus the model's last layer, the "
                          "slot speculators trains against",
    "speculators-dflash": "speculators DFlash: vLLM aux ids (= layer id j - 1), plus the model's last layer, the "
                          "slot speculators trains against",
}


def _aux_to_layer_ids(aux: list[int], where: str, key: str) -> list[int]:
    bad = [j for j in aux if j < 1]
    if bad:
        raise ValueError(f"--layers-from: {where}: {key} has aux id {bad[0]}; aux ids start at 1 "
                         "(aux 0 would be the embedding output, not a layer output)")
    return from_aux_ids(aux)


def drafter_layers(path: str | Path, num_layers: int) -> DrafterLayers:
    """Read the target layers from a drafter's config.json, telling the writers apart:
    speculators (`speculators_model_type` / `speculators_config`; its ids are vLLM aux ids and
    its data always holds the last layer too), DFlash (`dflash_config.target_layer_ids`),
    SGLang/SpecForge EAGLE-3 (`eagle_config.eagle_aux_hidden_state_layer_ids`, output-of-layer
    ids), vLLM EAGLE-3 (top-level `eagle_aux_hidden_state_layer_ids`, aux ids)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"--layers-from: no such drafter config {str(p)!r}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--layers-from: {str(p)!r} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--layers-from: {str(p)!r} is not a JSON object")
    where = repr(str(p))
    last = num_layers - 1

    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        for key, kind in (("eagle_aux_hidden_state_layer_ids", "speculators-eagle3"),
                          ("aux_hidden_state_layer_ids", "speculators-dflash")):
            if cfg.get(key) is not None:
                aux = parse_id_list(cfg[key], key)
                got = _aux_to_layer_ids(aux, where, key)
                return DrafterLayers(kind=kind, key=key, config_ids=aux,
                                     layer_ids=got + ([last] if last not in got else []))
    else:
        dflash = cfg.get("dflash_config")
        if isinstance(dflash, dict) and dflash.get("target_layer_ids") is not None:
            key = "dflash_config.target_layer_ids"
            got = parse_id_list(dflash["target_layer_ids"], key)
            return DrafterLayers(kind="dflash", key=key, config_ids=got, layer_ids=list(got))
        eagle = cfg.get("eagle_config")
        if isinstance(eagle, dict) and eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
            key = "eagle_config.eagle_aux_hidden_state_layer_ids"
            got = parse_id_list(eagle["eagle_aux_hidden_state_layer_ids"], key)
            return DrafterLayers(kind="sglang-eagle3", key=key, config_ids=got, layer_ids=list(got))
        if cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
            key = "eagle_aux_hidden_state_layer_ids"
            got = parse_id_list(cfg[key], key)
            return DrafterLayers(kind="vllm-eagle3", key=key, config_ids=got,
                                 layer_ids=_aux_to_layer_ids(got, where, key))
    raise ValueError(
        f"--layers-from: cannot tell which layers {str(p)!r} means: it has none of dflash_config.target_layer_ids "
        "(DFlash), eagle_config.eagle_aux_hidden_state_layer_ids (SGLang/SpecForge EAGLE-3), a top-level "
        "eagle_aux_hidden_state_layer_ids (vLLM EAGLE-3), or speculators_model_type with eagle_aux_hidden_state_"
        "layer_ids / aux_hidden_state_layer_ids (speculators); give the layers with --layers (output of layer i) "
        "or --aux-layers (vLLM aux ids)"
    )


def validate_layer_ids(ids: Sequence[int], num_layers: int, what: str = "--layers") -> list[int]:
    """Check a selection against the model; returns it in the order given
    (`hidden_states[:, k]` is `layer_ids[k]`)."""
    ids = list(ids)
    if not ids:
        raise ValueError(f"{what}: empty layer selection (model has {num_layers} layers)")
    seen: set[int] = set()
    for i in ids:
        if not 0 <= i < num_layers:
            raise ValueError(
                f"{what}: layer id {i} out of range; the model has {num_layers} layers "
                f"(valid layer ids 0..{num_layers - 1})"
            )
        if i in seen:
            raise ValueError(f"{what}: duplicate layer id {i} in {ids} (model has {num_layers} layers)")
        seen.add(i)
    return ids


def resolve_layer_ids(
    num_layers: int,
    layers: str | Sequence[int] | None = None,
    aux_layers: str | Sequence[int] | None = None,
    layers_from: str | Path | None = None,
) -> list[int]:
    """One selection from at most one source; default = DFlash spread of 5 layers."""
    given = [n for n, v in (("--layers", layers), ("--aux-layers", aux_layers), ("--layers-from", layers_from))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"give only one of --layers, --aux-layers, --layers-from; got {', '.join(given)}")
    if layers is not None:
        return validate_layer_ids(parse_id_list(layers, "--layers"), num_layers, "--layers")
    if aux_layers is not None:
        aux = parse_id_list(aux_layers, "--aux-layers")
        for j in aux:
            if not 1 <= j <= num_layers:
                raise ValueError(
                    f"--aux-layers: aux id {j} out of range; the model has {num_layers} layers "
                    f"(valid aux ids 1..{num_layers}; aux 0 is the embedding output, not a layer output)"
                )
        return validate_layer_ids(from_aux_ids(aux), num_layers, "--aux-layers")
    if layers_from is not None:
        d = drafter_layers(layers_from, num_layers)
        log.info("%s", d.describe(layers_from))
        return validate_layer_ids(d.layer_ids, num_layers, "--layers-from")
    return dflash_default_layer_ids(num_layers)


def layer_source(num_layers: int, layers: str | Sequence[int] | None = None,
                 aux_layers: str | Sequence[int] | None = None,
                 layers_from: str | Path | None = None) -> dict[str, Any]:
    """Where an extract's layer ids came from, for its manifest."""
    if layers_from is not None:
        return {"option": "--layers-from", **drafter_layers(layers_from, num_layers).to_dict(layers_from)}
    if aux_layers is not None:
        return {"option": "--aux-layers", "aux_ids": parse_id_list(aux_layers, "--aux-layers")}
    if layers is not None:
        return {"option": "--layers"}
    return {"option": "default", "rule": f"DFlash's spread of {DEFAULT_NUM_LAYERS} layers over 1 .. N-3"}


def positions(layer_ids: Sequence[int], use: Sequence[int], what: str, hint: str = "") -> list[int]:
    """Where each of `use` (layer ids) sits among an output's `layer_ids` (its K axis)."""
    have = list(layer_ids)
    missing = [i for i in use if i not in have]
    if missing:
        raise ValueError(f"{what}: layer id {missing[0]} is not in the output (its layer ids are {have}){hint}")
    return [have.index(i) for i in use]


def to_aux_ids(layer_ids: Sequence[int]) -> list[int]:
    """Layer ids -> vLLM / EAGLE-3 aux ids (aux j is the input of layer j: layer id j - 1)."""
    return [i + 1 for i in layer_ids]


def from_aux_ids(aux_ids: Sequence[int]) -> list[int]:
    """vLLM / EAGLE-3 aux ids -> layer ids (the inverse of `to_aux_ids`)."""
    return [j - 1 for j in aux_ids]


def moe_layer_indices(text_config) -> tuple[int, ...]:
    """The decoder layers of a (Qwen-style) MoE config with a sparse-expert MLP: every
    `decoder_sparse_step`-th layer not in `mlp_only_layers`; () for a dense model."""
    experts = next((getattr(text_config, k, None) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                    if getattr(text_config, k, None)), 0)
    if not experts:
        return ()
    dense = set(getattr(text_config, "mlp_only_layers", None) or ())
    step = int(getattr(text_config, "decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(int(text_config.num_hidden_layers)) if i not in dense and (i + 1) % step == 0)


def layers_to_run(num_layers: int, layer_ids: Sequence[int], moe_layers: Sequence[int] = (), full: bool = False) -> int:
    """How many decoder layers (0 .. n-1) the engine builds and runs for prefill extraction:
    up to the deepest captured one, since nothing after it reaches a captured state (the
    sampled token is thrown away). `full`: all of them (the final state, generation and
    serving need the whole model). vLLM's MoE models refuse to build without any MoE layer,
    so a cut keeps at least the first one."""
    if full or not layer_ids:
        return num_layers
    keep = max(layer_ids) + 1
    if moe_layers and min(moe_layers) >= keep:
        keep = min(moe_layers) + 1
    return min(keep, num_layers)
