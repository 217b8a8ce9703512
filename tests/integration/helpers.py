"""Shared pieces of the engine tests: run the real CLI, compute HF references."""

from __future__ import annotations

import blake3
import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def run_cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return subprocess.run([sys.executable, "-m", "vllm_hidden.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


class HFReference:
    """HF Transformers forward in float32 on the same (bf16-representable) weights.
    `layer(i)` = output of decoder layer i: output_hidden_states[i + 1], except the last
    layer, taken from a hook because HF applies the final norm to output_hidden_states[-1]."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.num_layers = self.model.config.num_hidden_layers
        self._last = None
        self.model.model.layers[-1].register_forward_hook(self._hook)

    def _hook(self, mod, inp, out):
        self._last = out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def states(self, token_ids: list[int]) -> list[torch.Tensor]:
        r = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        outs = [r.hidden_states[i + 1][0] for i in range(self.num_layers - 1)]
        return outs + [self._last[0]]


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm()).item()


def verify_checksums(out: Path) -> None:
    m = json.loads((out / "manifest.json").read_text())
    for s in m["shards"]:
        raw = (out / s["file"]).read_bytes()
        assert len(raw) == s["bytes"], s
        assert blake3.blake3(raw).hexdigest() == s["blake3"], s
