"""Quantized targets without an engine: what the manifest records, which targets count as FP8,
the `--quantization` value among engine arguments and in the output's identity (a resume must
not mix FP8 and bf16 states), and the FP8 checkpoint writer's layout and error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config

from vllm_hidden.config import ExtractConfig
from vllm_hidden.demo import FP8_BLOCK, fp8_block_quantization_config, quantize_fp8_blocks, write_fp8_checkpoint
from vllm_hidden.engine.quant import checkpoint_quantization, describe, is_fp8, quantization_arg
from vllm_hidden.extract.plan import plan_extract


def _config(**quant):
    cfg = Qwen3Config(num_hidden_layers=2)
    if quant:
        cfg.quantization_config = quant
    return cfg


def test_the_manifest_says_where_the_quantization_came_from():
    assert describe(None, _config()) is None
    assert describe("fp8", _config()) == {"method": "fp8", "source": "online"}
    blocks = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert describe("fp8", _config(**blocks)) == {"method": "fp8", "source": "checkpoint",
                                                   "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert checkpoint_quantization(_config(**blocks)) == blocks
    assert is_fp8(None, _config(**blocks)) and is_fp8("fp8", _config()) and is_fp8("fp8_per_block", _config())
    assert not is_fp8(None, _config()) and not is_fp8("awq", _config(quant_method="awq"))


def test_the_quantization_argument_is_found_in_any_spelling():
    assert quantization_arg([]) is None
    assert quantization_arg(["--enforce-eager", "--quantization", "fp8"]) == "fp8"
    assert quantization_arg(["--quantization=fp8_per_tensor"]) == "fp8_per_tensor"
    assert quantization_arg(["-q", "fp8", "--dtype", "bfloat16"]) == "fp8"


def test_online_quantization_is_part_of_the_outputs_identity(tmp_path):
    Qwen3Config(num_hidden_layers=4, vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=512).save_pretrained(tmp_path / "m")
    base = dict(model=str(tmp_path / "m"), input_path="x", output_dir="y", layers="1")
    assert "quantization" not in plan_extract(ExtractConfig(**base)).identity  # older outputs keep their identity
    q = plan_extract(ExtractConfig(**base, engine_args=["--quantization", "fp8"])).identity
    assert q["quantization"] == "fp8"


def test_block_quantization_round_trips_within_e4m3s_error():
    w = torch.randn(300, 200) * 0.05  # not a multiple of the block on either side
    q, scale = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (3, 2)
    back = q.float() * scale.repeat_interleave(FP8_BLOCK, 0)[:300].repeat_interleave(FP8_BLOCK, 1)[:, :200]
    err = ((back - w).norm() / w.norm()).item()
    assert 0.005 < err < 0.04, err


def test_the_fp8_checkpoint_has_qwens_layout(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    lin = "model.language_model.layers.0.linear_attn"
    tensors = {f"{lin}.in_proj_qkv.weight": torch.randn(256, 128, dtype=torch.bfloat16),
               f"{lin}.in_proj_a.weight": torch.randn(48, 128, dtype=torch.bfloat16),
               f"{lin}.A_log": torch.randn(48),
               "model.language_model.layers.0.mlp.down_proj.weight": torch.randn(128, 384, dtype=torch.bfloat16),
               "model.language_model.norm.weight": torch.ones(128, dtype=torch.bfloat16),
               "lm_head.weight": torch.randn(64, 128, dtype=torch.bfloat16)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 1}}))
    (src / "tokenizer.json").write_text("{}")
    write_fp8_checkpoint(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == fp8_block_quantization_config(1)
    assert f"{lin}.in_proj_a" in cfg["quantization_config"]["modules_to_not_convert"]
    assert (dst / "tokenizer.json").is_file()
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    for name in (f"{lin}.in_proj_qkv.weight", "model.language_model.layers.0.mlp.down_proj.weight"):
        assert got[name].dtype == torch.float8_e4m3fn
        s = got[name + "_scale_inv"]
        assert s.dtype == torch.float32 and s.shape == tuple(-(-n // FP8_BLOCK) for n in got[name].shape)
    for name in (f"{lin}.in_proj_a.weight", f"{lin}.A_log", "model.language_model.norm.weight", "lm_head.weight"):
        assert torch.equal(got[name], tensors[name]) and name + "_scale_inv" not in got
    with pytest.raises(ValueError, match="'qwen3' checkpoint"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
        write_fp8_checkpoint(tmp_path / "other", tmp_path / "other-fp8")


def test_the_quantization_record_survives_the_manifest_and_reaches_inspect(tmp_path):
    from tests.outputs import random_sample, write_output
    from vllm_hidden.storage.manifest import Manifest
    from vllm_hidden.storage.verify import verify_output

    q = {"method": "fp8", "source": "checkpoint", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    write_output(tmp_path / "q", [1], 8, {"a": random_sample(0, 5, 1, 8)}, manifest={"quantization": q})
    write_output(tmp_path / "plain", [1], 8, {"a": random_sample(0, 5, 1, 8)})
    assert Manifest.read(tmp_path / "q").quantization == q
    assert Manifest.read(tmp_path / "plain").quantization is None
    assert verify_output(str(tmp_path / "q")).summary["quantization"] == q
