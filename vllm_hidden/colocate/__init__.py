"""Colocated training: the target runs in the trainer's process and its states reach the
trainer as tensors on the same GPU (`HiddenStatesStream`)."""

from vllm_hidden.colocate.layouts import to_speculators
from vllm_hidden.colocate.stream import HiddenStatesStream

__all__ = ["HiddenStatesStream", "to_speculators"]
