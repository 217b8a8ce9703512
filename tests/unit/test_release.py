"""Prompt-only requests' KV blocks freed once their last prompt token is scheduled
(engine.scheduler), on vLLM's own AsyncScheduler and KV-cache manager with a hybrid cache (an
attention group and a Mamba group), driven step by step as the engine core drives it under
async scheduling: the next step is made before the previous one's output comes back."""

from __future__ import annotations

import json
from collections import deque

import pytest

pytest.importorskip("vllm")

BLOCK = 16
BLOCKS = 40  # one is vLLM's null block: 39 to share
PROMPT = 40  # 3 attention blocks and 1 Mamba block a request: 6 requests fill the cache


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = tmp_path_factory.mktemp("model")  # a config is all the scheduler reads of a model
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
        "vocab_size": 1024, "max_position_embeddings": 512, "torch_dtype": "float32"}))
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=512, dtype="float32"),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False))
    # what the engine core sets up on a GPU (the CPU platform turns async scheduling off)
    config.scheduler_config.async_scheduling = True
    config.cache_config.num_gpu_blocks = BLOCKS
    return config


def make_scheduler(config, monkeypatch, *, release: bool = True):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_hidden import envs
    from vllm_hidden.engine.scheduler import taper_scheduler

    monkeypatch.setenv(envs.RELEASE, "1" if release else "0")
    kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16,
                                                     dtype=torch.float32)),
        KVCacheGroupSpec(["gdn"], MambaSpec(block_size=BLOCK, shapes=((4, 4),), dtypes=(torch.float32,)))])
    return taper_scheduler(vllm_config=config, kv_cache_config=kv, block_size=BLOCK, log_stats=False,
                           structured_output_manager=StructuredOutputManager(config))


def request(rid: str, n: int, prompt_only: bool = True):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_hidden.engine.scheduler import PREFILL_ONLY_KEY

    extra = {PREFILL_ONLY_KEY: True} if prompt_only else None
    return Request(request_id=rid, prompt_token_ids=list(range(1, n + 1)), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=1, extra_args=extra))


def drive(s, on_step=None) -> tuple[list[int], dict[str, int]]:
    """The engine core's loop under async scheduling: each step made while the one before it is
    in flight; a step's output (one sampled token for each request its prompt ended in) comes
    back after the next step is made. Returns each step's tokens and each request's outputs."""
    from vllm.v1.outputs import ModelRunnerOutput

    inflight: deque = deque()
    steps: list[int] = []
    finished: dict[str, int] = {}

    def complete():
        out, ended = inflight.popleft()
        ids = list(out.num_scheduled_tokens)
        done = [[5] if r in ended else [] for r in ids]
        result = s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)}, sampled_token_ids=done,
            logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
        for outputs in result.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = finished.get(o.request_id, 0) + 1

    while s.requests or inflight:
        out = s.schedule()
        steps.append(out.total_num_scheduled_tokens)
        if on_step is not None:
            on_step(s, out)
        if out.total_num_scheduled_tokens:  # with the requests whose prompts this step ends
            inflight.append((out, {r for r in out.num_scheduled_tokens
                                   if s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens}))
        if len(inflight) == 2 or (inflight and not out.total_num_scheduled_tokens):
            complete()
        assert len(steps) < 100, steps
    return steps, finished


def test_the_step_made_while_a_full_one_runs_takes_its_freed_blocks(vllm_config, monkeypatch):
    s = make_scheduler(vllm_config, monkeypatch)
    assert s._vh_release
    free = s.kv_cache_manager.block_pool.get_num_free_blocks()
    for i in range(12):
        s.add_request(request(f"r{i}", PROMPT))
    steps, finished = drive(s)
    # the first step fills the cache (6 requests); the second, made while it runs, takes the
    # blocks the first step's requests no longer need
    assert steps == [6 * PROMPT, 6 * PROMPT, 0], steps
    assert finished == {f"r{i}": 1 for i in range(12)}  # each finished once, by vLLM, as usual
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free  # every block back, none twice
    assert not s._vh_releasable


def test_without_release_the_step_made_meanwhile_finds_the_cache_full(vllm_config, monkeypatch):
    """vLLM's own behaviour (VHIDDEN_RELEASE=0, or a request not marked prompt-only): the blocks
    come back only with the step's output, so a full step and an empty one alternate."""
    for release, prompt_only in ((False, True), (True, False)):
        s = make_scheduler(vllm_config, monkeypatch, release=release)
        for i in range(12):
            s.add_request(request(f"r{i}", PROMPT, prompt_only=prompt_only))
        steps, finished = drive(s)
        assert steps == [6 * PROMPT, 0, 6 * PROMPT, 0], (release, prompt_only, steps)
        assert finished == {f"r{i}": 1 for i in range(12)}


def test_a_chunked_prompt_keeps_its_blocks_until_its_last_chunk(vllm_config, monkeypatch):
    s = make_scheduler(vllm_config, monkeypatch)
    s.add_request(request("long", 300))  # a full step of 256, then 44
    held = []

    def on_step(s, out):
        if "long" in out.num_scheduled_tokens:
            held.append(len(s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.get("long", ())))

    steps, finished = drive(s, on_step)
    assert steps == [256, 44, 0] and finished == {"long": 1}, steps
    assert held == [16, 0], held  # after its first chunk: 16 attention blocks held; after its last: freed


def test_release_only_where_it_is_safe(vllm_config, monkeypatch):
    from vllm_hidden.engine import compat

    assert compat.early_release_blocker(vllm_config) is None
    monkeypatch.setattr(vllm_config.cache_config, "enable_prefix_caching", True)
    assert compat.early_release_blocker(vllm_config) == "prefix caching is on"
    s = make_scheduler(vllm_config, monkeypatch)
    assert not s._vh_release  # and its requests keep their blocks to the end
    s.add_request(request("r", PROMPT))
    assert not s._vh_releasable
    monkeypatch.setattr(vllm_config.cache_config, "enable_prefix_caching", False)
    monkeypatch.setattr(vllm_config.scheduler_config, "async_scheduling", False)
    assert "no async scheduling" in compat.early_release_blocker(vllm_config)
