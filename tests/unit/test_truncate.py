"""The cut model's pieces without an engine: how many layers a run needs, the config cut vLLM
is handed, which checkpoint weights are dropped, and where the layer count travels."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3NextConfig

from vllm_hidden.config import CaptureConfig, ExtractConfig
from vllm_hidden.engine.truncate import MARKER, filter_weights, hf_overrides, keep_weight, kept_layers
from vllm_hidden.extract.plan import plan_extract
from vllm_hidden.layers import layers_to_run, moe_layer_indices


def test_layers_to_run_stops_at_the_deepest_captured_layer():
    assert layers_to_run(64, [1, 16, 31, 46, 61]) == 62  # DFlash's default on Qwen3.6-27B
    assert layers_to_run(64, [31, 1, 60]) == 61  # EAGLE-3's (aux 2,32,61), any order
    assert layers_to_run(64, [63]) == 64
    assert layers_to_run(64, [1, 16], full=True) == 64
    # vLLM's MoE models need an MoE layer: a cut that would remove them all keeps the first
    assert layers_to_run(8, [1, 2], moe_layers=(7,)) == 8
    assert layers_to_run(8, [1, 2], moe_layers=(0, 4)) == 3
    assert layers_to_run(8, [1], moe_layers=(4, 5)) == 5


def test_moe_layers_follow_the_config():
    assert moe_layer_indices(Qwen3Config(num_hidden_layers=4)) == ()
    cfg = Qwen3NextConfig(num_hidden_layers=6, num_experts=4, mlp_only_layers=[0, 1, 5], decoder_sparse_step=1)
    assert moe_layer_indices(cfg) == (2, 3, 4)
    assert moe_layer_indices(Qwen3NextConfig(num_hidden_layers=6, num_experts=4, mlp_only_layers=[],
                                             decoder_sparse_step=2)) == (1, 3, 5)


def test_the_config_cut_vllm_applies():
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
    cfg = Qwen3NextConfig(num_hidden_layers=8, layer_types=types)
    cut = hf_overrides(cfg, 5)
    assert cut == {"num_hidden_layers": 5, "layer_types": types[:5], MARKER: 8}
    assert json.loads(json.dumps(cut)) == cut  # a plain dict: it travels to the engine's processes with the config
    with pytest.raises(ValueError, match="9 of the model's 8"):
        hf_overrides(cfg, 9)
    cfg.update(cut)
    assert kept_layers(cfg) == 5 and kept_layers(Qwen3NextConfig(num_hidden_layers=8, layer_types=types)) is None


def test_a_nested_text_config_is_cut_by_name(tmp_path):
    """Qwen3.5/3.6 checkpoints keep the decoder's config under `text_config`; vLLM applies a
    nested dict to the sub-config of that name."""
    from transformers import AutoConfig

    from vllm_hidden.demo import write_qwen36_27b_config

    cfg = AutoConfig.from_pretrained(write_qwen36_27b_config(tmp_path / "q", num_layers=8))
    cut = hf_overrides(cfg, 3)
    assert list(cut) == ["text_config"]
    assert cut["text_config"]["num_hidden_layers"] == 3 and cut["text_config"][MARKER] == 8
    assert cut["text_config"]["layer_types"] == cfg.text_config.layer_types[:3]


def test_vllm_takes_the_cut_with_online_fp8(tiny_models):
    """vLLM's own config path: the cut reaches the text config, and an online-quantized
    target's quantization config is still found (vLLM 0.26 refused a function there)."""
    from transformers import AutoConfig
    from vllm.config import LoadConfig, ModelConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    model = tiny_models("qwen3_next", 4)
    mc = ModelConfig(model=str(model), hf_overrides=hf_overrides(AutoConfig.from_pretrained(model), 3),
                     quantization="fp8", dtype="bfloat16", skip_tokenizer_init=True)
    assert mc.hf_text_config.num_hidden_layers == 3 and kept_layers(mc.hf_text_config) == 3
    assert len(mc.hf_text_config.layer_types) == 3
    assert get_quant_config(mc, LoadConfig()) is not None


def test_only_the_cut_layers_weights_are_dropped():
    names = ["model.embed_tokens.weight", "model.layers.4.mlp.up_proj.weight", "model.layers.5.self_attn.q_proj.weight",
             "model.layers.12.input_layernorm.weight", "model.language_model.layers.61.linear_attn.A_log",
             "model.language_model.layers.62.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight",
             "mtp.layers.0.mlp.gate_proj.weight", "model.visual.blocks.30.attn.qkv.weight"]
    kept = [n for n, _ in filter_weights(((n, None) for n in names), 5)]
    assert kept == ["model.embed_tokens.weight", "model.layers.4.mlp.up_proj.weight", "model.norm.weight",
                    "lm_head.weight", "mtp.layers.0.mlp.gate_proj.weight", "model.visual.blocks.30.attn.qkv.weight"]
    assert keep_weight("model.language_model.layers.61.linear_attn.A_log", 62)
    assert not keep_weight("model.language_model.layers.62.mlp.down_proj.weight", 62)


def test_the_layer_count_rides_in_additional_config():
    c = CaptureConfig(layer_ids=(1, 4), layers_run=5)
    assert CaptureConfig.from_additional_config(c.to_additional_config()) == c
    assert "layers_run" not in CaptureConfig(layer_ids=(1,)).to_additional_config()["vllm_hidden"]
    with pytest.raises(ValueError, match="layers_run.*0"):
        CaptureConfig(layer_ids=(1,), layers_run=0)


@pytest.mark.parametrize("options,expected", [({}, 3), ({"full_model": True}, 6), ({"final_state": "post-norm"}, 6),
                                              ({"generate": "yes"}, 6)])
def test_the_plan_cuts_unless_something_needs_every_layer(tmp_path, options, expected):
    from vllm_hidden.config import GenerateConfig

    Qwen3Config(num_hidden_layers=6, vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=512).save_pretrained(tmp_path / "m")
    if "generate" in options:
        options = {"generate": GenerateConfig(max_tokens=16)}
    cfg = ExtractConfig(model=str(tmp_path / "m"), input_path="x", output_dir="y", layers="0,2", **options)
    plan = plan_extract(cfg)
    assert plan.layers_run == expected
    assert "layers_run" not in plan.identity  # the states are the same: a resume may cut or not


def test_storage_dtype_is_checked():
    with pytest.raises(ValueError, match="--storage-dtype.*'fp16'"):
        ExtractConfig(model="m", input_path="x", output_dir="y", storage_dtype="fp16")


def _vllm_kv_groups(types):
    """(groups, padded) as vLLM itself groups KV-cache specs of these layer kinds."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    gdn = MambaSpec(block_size=16, shapes=((4, 64),), dtypes=(torch.bfloat16,))
    groups = kv_cache_utils._get_kv_cache_groups_uniform_page_size(
        {f"layers.{i}": full if t == "full_attention" else gdn for i, t in enumerate(types)})
    sizes = [len(g.layer_names) for g in groups]
    return len(groups), min(sizes) < max(sizes)


@pytest.mark.parametrize("every", [4, 3, 6])
def test_kv_groups_are_vllms_own(every):
    from vllm_hidden.engine.truncate import kv_groups

    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(64)]
    for n in range(1, 65):
        assert kv_groups(types[:n]) == _vllm_kv_groups(types[:n]), n


def test_a_hybrid_is_cut_in_its_config_only_where_its_kv_cache_does_not_grow():
    from types import SimpleNamespace

    from vllm_hidden.engine.truncate import cut_in_config

    def config(types):
        text = SimpleNamespace(num_hidden_layers=len(types), layer_types=types)
        return SimpleNamespace(get_text_config=lambda: text)

    qwen36 = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]
    # 62 layers: 15 attention + 47 GDN, 5 groups of 15 (one 13/15 padding) where the whole has 4 of 16
    assert not cut_in_config(config(qwen36), 62) and not cut_in_config(config(qwen36), 61)
    assert cut_in_config(config(qwen36), 60) and cut_in_config(config(qwen36), 32)
    assert not cut_in_config(config(qwen36[:8]), 5) and cut_in_config(config(qwen36[:8]), 4)
    assert cut_in_config(SimpleNamespace(get_text_config=lambda: SimpleNamespace(num_hidden_layers=8)), 3)  # dense


def test_a_model_built_whole_runs_its_first_layers_through_the_decoders_end_layer():
    import inspect

    from vllm.model_executor.models.llama import LlamaModel
    from vllm.model_executor.models.qwen2 import Qwen2Model
    from vllm.model_executor.models.qwen3_next import Qwen3NextModel

    from vllm_hidden.engine import compat

    # what compat.run_first_layers relies on: the installed vLLM's decoders loop to end_layer
    for cls in (Qwen3NextModel, Qwen2Model, LlamaModel):
        assert "islice(self.layers, self.start_layer, self.end_layer)" in inspect.getsource(cls.forward), cls

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(8))
            self.layers[7].register_buffer("scale", torch.ones(3))
            self.start_layer, self.end_layer = 0, 8

    class CausalLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Decoder()

    lm = CausalLM()
    lm.model.layers[6].bias = lm.model.layers[0].bias  # tied to a layer that runs: kept
    lm.model.layers[5].rope = lm.model.layers[0].rope = torch.nn.Linear(1, 1, bias=False)  # one module in both: kept
    kept = [p.clone() for p in lm.model.layers[:5].parameters()]
    # the 3 layers that never run give their weights back (4x4 + 4 floats each, and one buffer of 3)
    assert compat.run_first_layers(lm, 5) == (3 * 20 - 4 + 3) * 4 and lm.model.end_layer == 5
    assert lm.model.layers[6].bias.numel() == 4 and lm.model.layers[6].weight.numel() == 0
    assert lm.model.layers[5].rope.weight.numel() == 1 and lm.model.layers[5].weight.numel() == 0
    assert all(t.numel() == 0 for t in [*lm.model.layers[7].parameters(), *lm.model.layers[7].buffers()])
    assert all(torch.equal(a, b) for a, b in zip(kept, lm.model.layers[:5].parameters()))  # the rest as they were
    assert compat.run_first_layers(lm, 3) is None  # already stopped short: not a whole decoder any more
    assert compat.run_first_layers(torch.nn.Linear(2, 2), 3) is None  # no decoder with end_layer: every layer runs
