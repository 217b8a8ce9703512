"""Tiny random models written locally (no downloads): the demo's default model and the
test fixtures. Each is a real HF checkpoint (config, safetensors weights, tokenizer with a
chat template) that both vLLM and HF Transformers load. Also Qwen3.5/3.6-shaped ones: a
checkpoint at Qwen3.6-27B's widths with few layers, and a config alone for vLLM's dummy
weights at full size."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

ARCHS = ("qwen3_next", "qwen3", "llama")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
_SPECIAL = ["<unk>", "<s>", "</s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def write_tokenizer(path: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set(letters) | set("0123456789.,!?")
    while len(words) < vocab_size - len(_SPECIAL):
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))))
    vocab = {t: i for i, t in enumerate(_SPECIAL + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _config(arch: str, num_layers: int, vocab_size: int, max_pos: int, moe_layer: int | None = None):
    from transformers import LlamaConfig, Qwen3Config, Qwen3NextConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        torch_dtype="bfloat16",
    )
    if arch == "qwen3_next":
        # Every 4th layer full attention (as in Qwen3.5/3.6), the rest Gated DeltaNet.
        # vLLM's Qwen3-Next needs >= 1 MoE layer: only one (the last by default), routing to
        # every expert, so bf16 near-ties in top-k routing cannot flip experts between engines.
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
        return Qwen3NextConfig(
            **common,
            layer_types=layer_types,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=4,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(num_layers) if i != (num_layers - 1 if moe_layer is None else moe_layer)],
            partial_rotary_factor=0.25,
        )
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny-model architecture {arch!r}; choose one of {ARCHS}")


def make_tiny_model(
    path: str | Path,
    arch: str = "qwen3_next",
    num_layers: int = 8,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    moe_layer: int | None = None,
) -> Path:
    """Write a tiny random checkpoint to `path` (idempotent: reuses a complete one).
    `moe_layer`: qwen3_next's one MoE layer (default: the last)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    stamp = path / "vllm_hidden_tiny.json"
    spec = {"arch": arch, "num_layers": num_layers, "vocab_size": vocab_size,
            "max_position_embeddings": max_position_embeddings, "seed": seed,
            **({"moe_layer": moe_layer} if moe_layer is not None else {})}
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(arch, num_layers, vocab_size, max_position_embeddings, moe_layer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # HF's default init (std 0.02, embeddings too) makes every layer a near-identity, so
        # neighbouring layers would differ by ~2% and an off-by-one capture could pass a 1e-2
        # parity bound. O(1) embeddings and std 0.04 weights make neighbours differ by ~20%
        # while bf16 rounding stays under 1% after 8 layers.
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else 0.04)
    model.to(torch.bfloat16).save_pretrained(str(path))
    write_tokenizer(path, vocab_size, seed)
    stamp.write_text(json.dumps(spec))
    return path


# -- Qwen3.5 / Qwen3.6 (Qwen3_5ForConditionalGeneration) ---------------------------------------

QWEN36_27B_VISION = dict(
    depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
    in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=5120,
    num_position_embeddings=2304, deepstack_visual_indexes=[], initializer_range=0.02,
)


def qwen36_27b_text_config(num_layers: int = 64, vocab_size: int = 248320) -> dict:
    """Qwen3.6-27B's text config (HF `Qwen3_5TextConfig` kwargs): dense MLP, every 4th layer
    full (gated) attention, the rest Gated DeltaNet; `num_layers` and `vocab_size` may shrink."""
    return dict(
        model_type="qwen3_5_text",
        vocab_size=vocab_size,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=num_layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        full_attention_interval=4,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        attn_output_gate=True,
        attention_bias=False,
        attention_dropout=0.0,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        mamba_ssm_dtype="float32",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        partial_rotary_factor=0.25,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
        initializer_range=0.02,
        use_cache=True,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def _qwen35_config(text: dict, vision: dict) -> dict:
    """The top-level `qwen3_5` config.json as the released checkpoints lay it out."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5", **vision},
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def write_qwen36_27b_config(path: str | Path, num_layers: int = 64, fp8_blocks: bool = False) -> Path:
    """Write only a config.json with Qwen3.6-27B's shapes, for vLLM's `--load-format dummy`
    (random full-size weights, nothing to read). Start the engine with `--language-model-only`
    (no vision tower, no image processor files needed) and feed token ids: the directory has
    no tokenizer (vLLM runs with `skip_tokenizer_init`). `fp8_blocks`: as Qwen's FP8 release
    (block-wise FP8 weights, `fp8_block_quantization_config`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _qwen35_config(qwen36_27b_text_config(num_layers), QWEN36_27B_VISION)
    if fp8_blocks:
        cfg["quantization_config"] = fp8_block_quantization_config(num_layers)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def write_qwen3_32b_config(path: str | Path, num_layers: int = 64) -> Path:
    """Write only a config.json with Qwen3-32B's shapes (a dense model: vLLM 0.26 runs it on
    its V2 model runner by default), for `--load-format dummy` and token-id prompts, as
    `write_qwen36_27b_config`. Same widths and depth as Qwen3.6-27B (5120 x 64 layers)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=5120,
               intermediate_size=25600, num_hidden_layers=num_layers, num_attention_heads=64, num_key_value_heads=8,
               head_dim=128, hidden_act="silu", attention_bias=False, attention_dropout=0.0, rms_norm_eps=1e-6,
               max_position_embeddings=40960, rope_theta=1_000_000, rope_scaling=None, tie_word_embeddings=False,
               use_sliding_window=False, sliding_window=None, initializer_range=0.02, use_cache=True,
               bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


# Qwen3.5's layout at a CPU test's width: 4 gated attention heads (2 KV) and 2 GDN key / 4 value
# heads, all of dim 64 (vLLM's CPU GDN kernel rejects 32); the rotary sections sized to the
# 8 rotary frequencies of a 64-wide head at partial rotary 0.25
QWEN35_TINY_WIDTHS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                          linear_value_head_dim=64,
                          rope_parameters=dict(rope_type="default", rope_theta=10_000_000, partial_rotary_factor=0.25,
                                               mrope_section=[3, 3, 2], mrope_interleaved=True))


def make_qwen35_model(path: str | Path, num_layers: int = 4, vocab_size: int = 4096, seed: int = 0,
                      widths: dict | None = None) -> Path:
    """Write a random `Qwen3_5ForConditionalGeneration` checkpoint with Qwen3.6-27B's widths but
    few layers and a small vocabulary (bf16 safetensors, tiny vision tower, tiny tokenizer;
    idempotent: reuses a complete one). `widths`: text-config sizes to use instead (e.g.
    QWEN35_TINY_WIDTHS: the same layout at width 256, for CPU tests). Weights are drawn on the
    GPU when there is one, so the values depend on the device; HF and vLLM read the same files
    either way."""
    import math

    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path = Path(path)
    stamp = path / "vllm_hidden_tiny.json"
    spec = {"arch": "qwen3_5", "num_layers": num_layers, "vocab_size": vocab_size, "seed": seed,
            **({"widths": widths} if widths else {})}
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    text = {**qwen36_27b_text_config(num_layers, vocab_size), **(widths or {}), "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 2}
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text["hidden_size"])
    top = _qwen35_config(text, vision)
    cfg = Qwen3_5Config(**{k: v for k, v in top.items() if k not in ("architectures", "model_type")})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        # HF's init (std 0.02 at width 5120) makes every layer a near-identity. Width-aware
        # instead: O(1) embeddings and std 0.64/sqrt(fan_in) for every matrix (the depthwise
        # conv's fan-in is its kernel size) keep activations O(1) and make neighbouring layers
        # differ by well over 5%, while bf16 rounding stays under 1%. Norms, A_log and dt_bias
        # keep HF's init.
        for name, p in model.named_parameters():
            if name.startswith("model.visual."):
                continue
            if "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=gen)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.64 / math.sqrt(p.shape[-1]), generator=gen)
    model.save_pretrained(str(path))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to the engine started next
    write_tokenizer(path, vocab_size, seed)
    stamp.write_text(json.dumps(spec))
    return path


# -- FP8 checkpoints ---------------------------------------------------------------------------
FP8_BLOCK = 128
# the decoder's linear weights Qwen's FP8 releases store in fp8 (the rest stays bf16: embeddings,
# LM head, norms, the GDN's small in_proj_a / in_proj_b, conv and state parameters, vision, MTP)
_FP8_WEIGHT = re.compile(r"^model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
                         r"linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|mlp\.(gate|up|down)_proj)\.weight$")


def fp8_block_quantization_config(num_layers: int) -> dict:
    """A Qwen3.5/3.6 FP8 release's `quantization_config`: float8 e4m3 weights with one scale
    per 128 x 128 block (`weight_scale_inv`, the factor back to real values), activations
    quantized per token group at run time."""
    keep = ["lm_head", "model.language_model.embed_tokens", "model.visual", "mtp"]
    keep += [f"model.language_model.layers.{i}.linear_attn.in_proj_{x}" for i in range(num_layers) for x in "ab"]
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "modules_to_not_convert": keep}


def quantize_fp8_blocks(w):
    """(float8 e4m3 weight, float32 scale per 128 x 128 block) with w ~= fp8 * scale blockwise."""
    import torch

    n, k = w.shape
    pn, pk = -n % FP8_BLOCK, -k % FP8_BLOCK
    x = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    blocks = x.view((n + pn) // FP8_BLOCK, FP8_BLOCK, (k + pk) // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n + pn, k + pk)[:n, :k].contiguous()
    return q, scale.contiguous()


def write_fp8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Copy the Qwen3.5/3.6 checkpoint at `src` to `dst` as Qwen's FP8 releases lay it out:
    the decoder's linear weights in float8 e4m3 with block scales, `quantization_config` in
    config.json. For tests and benchmarks of FP8 targets; idempotent."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "qwen3_5":
        raise ValueError(f"{str(src)!r} is a {cfg.get('model_type')!r} checkpoint; this writes qwen3_5 ones only")
    stamp = dst / "vllm_hidden_fp8.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"src": str(src.resolve())}:
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            out = {}
            for name, t in load_file(str(f)).items():
                if _FP8_WEIGHT.match(name):
                    out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t)
                else:
                    out[name] = t
            save_file(out, str(dst / f.name), metadata={"format": "pt"})
            weight_map.update({n: f.name for n in out})
        elif f.is_file() and f.name not in ("model.safetensors.index.json", stamp.name):
            shutil.copy2(f, dst / f.name)
    if (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg["quantization_config"] = fp8_block_quantization_config(cfg["text_config"]["num_hidden_layers"])
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    stamp.write_text(json.dumps({"src": str(src.resolve())}))
    return dst
