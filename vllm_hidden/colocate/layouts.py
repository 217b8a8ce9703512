"""A stream batch in a trainer's own input layout, on the same device (views where the layout
allows, one copy of the aux states where it does not)."""

from __future__ import annotations

from typing import Any

import torch


def to_speculators(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """vllm-project/speculators' training batch (train/data.py's collate, one packed row), the
    keyword arguments its EAGLE-3 and DFlash models' `forward` take: `hidden_states` [1, N,
    (K-1)*H] (the aux layers side by side), `verifier_last_hidden_states` [1, N, H] (the last
    captured layer, which must be the model's last: speculators applies the verifier's final
    norm to it), `input_ids`, `loss_mask`, `position_ids` (each sample from 0) and
    `document_ids` (sample index per row) [1, N]."""
    hidden = batch["hidden_states"]
    if hidden.dim() != 3 or hidden.shape[1] < 2:
        raise ValueError(f"speculators' layout needs at least 2 captured layers (aux layers, then the model's last); "
                         f"the batch's hidden_states is {tuple(hidden.shape)}")
    cu = batch["cu_seqlens"].long()
    # output_size given: no device-to-host read of the lengths (a sync on CUDA)
    docs = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1],
                                   output_size=batch["token_ids"].numel())
    return {"hidden_states": hidden[:, :-1].flatten(1)[None], "verifier_last_hidden_states": hidden[:, -1][None],
            "input_ids": batch["token_ids"][None], "loss_mask": batch["loss_mask"][None],
            "position_ids": batch["position_ids"][None], "document_ids": docs[None]}
