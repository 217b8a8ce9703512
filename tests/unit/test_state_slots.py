"""engine.state_slots: which requests' recurrent-state slots are cleared before a step, and
that nothing else is touched (the engine test is tests/integration/test_fresh_state.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from vllm_hidden.engine.state_slots import FreshStateSlots

SLOTS = 10


def _runner():
    """Group 0: full attention (one layer); group 1: two GDN layers with (conv, ssm) states;
    every slot starts filled with its own id + 1 (stale contents)."""
    def filled(*shape):
        return torch.arange(1, SLOTS + 1, dtype=torch.float32).view(-1, *[1] * len(shape)).expand(SLOTS, *shape).clone()

    layers = {"attn": SimpleNamespace(kv_cache=filled(2, 4)),
              "gdn0": SimpleNamespace(kv_cache=(filled(3, 2), filled(2, 2))),
              "gdn1": SimpleNamespace(kv_cache=(filled(3, 2), filled(2, 2)))}
    groups = [SimpleNamespace(kv_cache_spec=object.__new__(FullAttentionSpec), layer_names=["attn"]),
              SimpleNamespace(kv_cache_spec=object.__new__(MambaSpec), layer_names=["gdn0", "gdn1"])]
    runner = SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(
        static_forward_context=layers)), kv_cache_config=SimpleNamespace(kv_cache_groups=groups))
    return runner, layers


def _step(new=(), cached=(), resumed=()):
    """new: (block ids per group, num_computed_tokens); cached: (req id, new block ids, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(block_ids=b, num_computed_tokens=k) for b, k in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], new_block_ids=[c[1] for c in cached],
                                              num_computed_tokens=[c[2] for c in cached], resumed_req_ids=set(resumed)))


def _zeroed(layers) -> dict[str, list[int]]:
    """Per state tensor: the slots that are all zero."""
    out = {}
    for name, layer in layers.items():
        tensors = layer.kv_cache if isinstance(layer.kv_cache, tuple) else (layer.kv_cache,)
        for j, t in enumerate(tensors):
            out[f"{name}.{j}"] = [i for i in range(SLOTS) if not t[i].any()]
    return out


def test_only_the_state_slots_of_requests_starting_at_token_0_are_cleared():
    runner, layers = _runner()
    fresh = FreshStateSlots(runner)
    fresh.clear(_step(new=[(([1, 2], [3]), 0), (([4], [5]), 7)]))  # the second resumes from the prefix cache
    z = _zeroed(layers)
    assert z["attn.0"] == []  # attention KV blocks are never touched
    assert z["gdn0.0"] == z["gdn0.1"] == z["gdn1.0"] == z["gdn1.1"] == [3]
    assert fresh.cleared == 1
    # a request resumed after preemption from token 0 (V1: a cached request with all its blocks) is
    # fresh; one resumed at a later token, or a running one, is not
    fresh.clear(_step(cached=[("a", ([6], [8]), 0), ("b", ([6], [9]), 5), ("c", None, 0)], resumed={"a", "b"}))
    assert _zeroed(layers)["gdn1.1"] == [3, 8]
    fresh.clear(_step())  # nothing new: nothing touched
    assert fresh.cleared == 2 and _zeroed(layers)["attn.0"] == []


def test_a_model_without_recurrent_state_is_left_alone():
    runner, layers = _runner()
    runner.kv_cache_config.kv_cache_groups = runner.kv_cache_config.kv_cache_groups[:1]
    fresh = FreshStateSlots(runner)
    fresh.clear(_step(new=[(([1],), 0)]))
    assert fresh.cleared == 0 and all(not v for v in _zeroed(layers).values())
