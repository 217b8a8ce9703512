"""Tiny random models written locally (no downloads): the demo's default model and the
test fixtures. Each is a real HF checkpoint (config, safetensors weights, tokenizer with a
chat template) that both vLLM and HF Transformers load."""

from __future__ import annotations

import json
import random
from pathlib import Path

ARCHS = ("qwen3_next", "qwen3", "llama")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
_SPECIAL = ["<unk>", "<s>", "</s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _write_tokenizer(path: Path, vocab_size: int, seed: int) -> None:
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


def _config(arch: str, num_layers: int, vocab_size: int, max_pos: int):
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
        # vLLM's Qwen3-Next needs >= 1 MoE layer: only the last one, routing to every
        # expert, so bf16 near-ties in top-k routing cannot flip experts between engines.
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
            mlp_only_layers=list(range(num_layers - 1)),
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
) -> Path:
    """Write a tiny random checkpoint to `path` (idempotent: reuses a complete one)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    stamp = path / "vllm_hidden_tiny.json"
    spec = {"arch": arch, "num_layers": num_layers, "vocab_size": vocab_size,
            "max_position_embeddings": max_position_embeddings, "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(arch, num_layers, vocab_size, max_position_embeddings)
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
    _write_tokenizer(path, vocab_size, seed)
    stamp.write_text(json.dumps(spec))
    return path
