"""Training-side reader."""

from vllm_hidden.data.dataset import HiddenStatesDataset

__all__ = ["HiddenStatesDataset"]
