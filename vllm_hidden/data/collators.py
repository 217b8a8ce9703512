"""Samples -> batches in the shapes drafter trainers compute with, for a training loop of
your own over `HiddenStatesDataset` (to write a trainer's own files, see `vllm_hidden.export`).

- `DFlashCollator`: `input_ids` [B, T], `hidden_states` [B, T, K*H] (the selected layers
  concatenated, DFlash `target_layer_ids` order), `loss_mask` [B, T].
- `Eagle3Collator`: `input_ids`, `aux_hidden_state` [B, T, 3H] (three layers concatenated, as
  SpecForge's offline files hold them; its batches rename them), `hidden_state` [B, T, H]
  (the final state after the model's norm, from `--final-state post-norm`), `loss_mask`.
Both pad to the longest sample and add `attention_mask` [B, T] and `lengths` [B]. Rows stay
unshifted (row t is token t); the trainer shifts. Use one as a DataLoader's `collate_fn`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_hidden.layers import positions


def _columns(layer_ids: Sequence[int], use: Sequence[int] | None, what: str) -> list[int] | None:
    """Positions of `use` (layer ids) among the output's `layer_ids`; None: all, in order."""
    return None if use is None else positions(layer_ids, use, what)


def _mask(sample: dict[str, Any]) -> torch.Tensor:
    m = sample.get("loss_mask")
    # an output extracted with --loss-mask none: every token counts
    return torch.ones(sample["token_ids"].shape[0], dtype=torch.bool) if m is None else m.bool()


def pad_batch(features: list[dict[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad each [T, ...] tensor to the longest T; `attention_mask` and `lengths` added."""
    if not features:
        raise ValueError("cannot collate an empty batch")
    lengths = torch.tensor([f["input_ids"].shape[0] for f in features], dtype=torch.int64)
    t = int(lengths.max())
    out: dict[str, torch.Tensor] = {}
    for name in features[0]:
        first = features[0][name]
        pad = pad_token_id if name == "input_ids" else 0
        batch = torch.full((len(features), t, *first.shape[1:]), pad, dtype=first.dtype)
        for b, f in enumerate(features):
            batch[b, : f[name].shape[0]] = f[name]
        out[name] = batch
    out["attention_mask"] = torch.arange(t)[None, :] < lengths[:, None]
    out["lengths"] = lengths
    return out


class DFlashCollator:
    """DFlash: K layers concatenated per token. `use`: the layer ids to keep, in the order
    the drafter's `target_layer_ids` lists them (default: every layer of the output)."""

    def __init__(self, layer_ids: Sequence[int], use: Sequence[int] | None = None, pad_token_id: int = 0) -> None:
        self.cols = _columns(layer_ids, use, "DFlashCollator")
        self.pad_token_id = pad_token_id

    def features(self, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        hs = sample["hidden_states"]
        if self.cols is not None:
            hs = hs[:, self.cols]
        return {"input_ids": sample["token_ids"], "hidden_states": hs.reshape(hs.shape[0], -1),
                "loss_mask": _mask(sample)}

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return pad_batch([self.features(s) for s in batch], self.pad_token_id)


class Eagle3Collator:
    """EAGLE-3 (SpecForge's layout): three aux layers concatenated, and the final normed state.
    `use`: the three layer ids (default: the output's, if it has exactly three)."""

    def __init__(self, layer_ids: Sequence[int], use: Sequence[int] | None = None, pad_token_id: int = 0) -> None:
        use = list(use) if use is not None else list(layer_ids)
        if len(use) != 3:
            raise ValueError(f"Eagle3Collator: EAGLE-3 takes 3 layers, got {use!r}; pass use=[low, mid, high]")
        self.cols = _columns(layer_ids, use, "Eagle3Collator")
        self.pad_token_id = pad_token_id

    def features(self, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        final = sample.get("final_hidden_states")
        if final is None:
            raise ValueError(f"sample {sample.get('id')!r} has no final_hidden_states: EAGLE-3 needs the final "
                             "normed state; extract with --final-state post-norm")
        hs = sample["hidden_states"][:, self.cols]
        return {"input_ids": sample["token_ids"], "aux_hidden_state": hs.reshape(hs.shape[0], -1),
                "hidden_state": final, "loss_mask": _mask(sample)}

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return pad_batch([self.features(s) for s in batch], self.pad_token_id)
