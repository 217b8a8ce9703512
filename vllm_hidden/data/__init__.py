"""Training-side reader, and the hand-off to drafter trainers."""

from vllm_hidden.data.batches import collate_tokens, token_batches
from vllm_hidden.data.collators import DFlashCollator, Eagle3Collator, pad_batch
from vllm_hidden.data.dataset import HiddenStatesDataset
from vllm_hidden.data.stream import ShardedStream

__all__ = ["DFlashCollator", "Eagle3Collator", "HiddenStatesDataset", "ShardedStream", "collate_tokens",
           "pad_batch", "token_batches"]
