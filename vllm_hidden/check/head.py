"""The model's final norm and LM head alone, from its checkpoint: stored states -> logprobs.

Only those two modules are built (the HF model is made on the meta device and just they get
real weights), so a 27B target costs its vocabulary matrix, not its 54 GB of weights. The
norm is the model's own HF module (Qwen3-Next / Qwen3.5 norms scale by 1 + w, Llama's by
w), so its semantics come from Transformers, not from us.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from vllm_hidden.check.reference import ModelShape, causal_lm, decoder_of

# a decoder layer's, the MTP head's or the vision tower's own norms are not the final norm
_ELSEWHERE = re.compile(r"(^|\.)(layers|mtp|visual)\.")
CHUNK = 512  # rows per logits block: [CHUNK, vocab] float32 is 0.5 GB at a 248k vocabulary


def _checkpoint_files(model: str) -> list[Path]:
    root = Path(model)
    if not root.is_dir():
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors"]))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return [root / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model!r} has no safetensors weights: the final norm and LM head are read from them")
    return files


def _read(files: list[Path], wanted: dict[str, str]) -> dict[str, torch.Tensor]:
    """{key: tensor} for each key -> parameter name of `wanted`, found in the checkpoint under
    that name or one that ends with it after a prefix (checkpoints and HF classes differ in
    "model." / "language_model." prefixes)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names = list(sf.keys())
            for key, name in wanted.items():
                if key in found:
                    continue
                short = name.split(".", 1)[1] if name.startswith("model.") else name
                hit = next((n for n in names if n == name), None) or next(
                    (n for n in names if n.endswith("." + short) and not _ELSEWHERE.search(n)),
                    None)
                if hit is not None:
                    found[key] = sf.get_tensor(hit)
    return found


class Head(ModelShape):
    """final norm + LM head of `model`, in float32 on `device`."""

    def __init__(self, model: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(model, device)
        config, text = self.config, self.text
        # the class Transformers maps for the checkpoint, from the text config of a composite one
        # (Qwen3.5/3.6: Qwen3_5ForCausalLM), not from a config class another library registered
        cls, build = causal_lm(config)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config) if cls is None else cls._from_config(build)
        _, norm = decoder_of(hf, self.num_layers)
        lm_head = hf.get_output_embeddings()
        names = {id(p): n for n, p in hf.named_parameters()}
        wanted = {"norm": names[id(norm.weight)], "lm_head": names[id(lm_head.weight)]}
        tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
        embed = hf.get_input_embeddings()
        if id(embed.weight) in names:
            wanted["embed"] = names[id(embed.weight)]
        got = _read(_checkpoint_files(model), wanted)
        if "lm_head" not in got and tied and "embed" in got:
            got["lm_head"] = got["embed"]
        missing = [k for k in ("norm", "lm_head") if k not in got]
        if missing:
            raise ValueError(f"cannot find {', '.join(wanted[k] for k in missing)} in {model!r}'s checkpoint")
        if not got["lm_head"].is_floating_point() or got["lm_head"].element_size() < 2:
            raise ValueError(f"{model!r}'s LM head is stored as {got['lm_head'].dtype} (quantized): "
                             "--reference engine needs it unquantized")
        self.norm = norm.to_empty(device=self.device).float()
        with torch.no_grad():
            self.norm.weight.copy_(got["norm"].float())
        self.weight = got["lm_head"].to(self.device, torch.float32)  # [vocab, hidden]
        if tuple(self.weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"{model!r}'s LM head is {tuple(self.weight.shape)}, not "
                             f"({self.vocab_size}, {self.hidden_size})")

    @torch.no_grad()
    def logprobs(self, states: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, *, normed: bool,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        """log_softmax(lm_head(norm(states)))[rows, cols] in float32 ([N] for N (row, col)
        pairs); `normed`: the states are the final norm's output already. `dtype`: the norm's
        output and the LM head's product rounded to it, as the engine computes them (None:
        float32 throughout)."""
        out = torch.empty(len(rows), dtype=torch.float32)
        w = self.weight if dtype is None else self.weight.to(dtype)
        for lo in range(0, states.shape[0], CHUNK):
            sel = (rows >= lo) & (rows < lo + CHUNK)
            if not bool(sel.any()):
                continue
            h = states[lo:lo + CHUNK].to(self.device, torch.float32)
            if not normed:
                h = self.norm(h)
            if dtype is not None:
                h = h.to(dtype)
            lp = torch.log_softmax(torch.nn.functional.linear(h, w).float(), dim=-1)
            idx = sel.nonzero().squeeze(1)
            out[idx] = lp[(rows[idx] - lo).to(self.device), cols[idx].to(self.device)].cpu()
        return out


def engine_pairs(logprobs: list[dict[int, float] | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, token ids, engine logprobs): the engine's prompt logprobs at position t >= 1
    belong to state row t - 1 (the row that predicts token t)."""
    rows, cols, vals = [], [], []
    for t, d in enumerate(logprobs):
        if not d or t == 0:
            continue
        for tok, lp in d.items():
            rows.append(t - 1)
            cols.append(tok)
            vals.append(lp)
    return (torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long),
            torch.tensor(vals, dtype=torch.float32))

