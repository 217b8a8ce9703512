"""Training-side reader, and the hand-off to drafter trainers."""

from vllm_hidden.data.batches import collate_tokens, token_batches
from vllm_hidden.data.dataset import HiddenStatesDataset
from vllm_hidden.data.stream import ShardedStream
from vllm_hidden.data.trainers import DFlashCollator, Eagle3Collator, export_speculators, pad_batch

__all__ = ["DFlashCollator", "Eagle3Collator", "HiddenStatesDataset", "ShardedStream", "collate_tokens",
           "export_speculators", "pad_batch", "token_batches"]
