"""HF Transformers' states of one sequence, taken with forward hooks.

Layer id i is the OUTPUT of decoder layer i (0-based), HF's output_hidden_states[i + 1] --
except for the model's last layer, whose entry HF replaces with the final norm's output. A
hook on each decoder layer gives every layer before the norm, and one on the final norm
gives the post-norm state, so both meanings come from one forward and no index arithmetic.
Id -1 is the input of layer 0 (the embeddings), a neighbour of layer 0.
"""

from __future__ import annotations

import importlib.util
import inspect
import time
from typing import Any

import torch

EMBEDDINGS = -1  # the input of decoder layer 0
FINAL = "final"  # the final norm's output


def decoder_of(model: Any, num_layers: int) -> tuple[torch.nn.ModuleList, torch.nn.Module]:
    """(the decoder layers, the final norm) of an HF causal LM: the module holding a `layers`
    list of num_layers and a `norm` (model.model for most, model.model.language_model for
    vision-language checkpoints)."""
    found = []
    for name, mod in model.named_modules():
        layers, norm = getattr(mod, "layers", None), getattr(mod, "norm", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers and isinstance(norm, torch.nn.Module):
            found.append((name.count("."), name, layers, norm))
    if not found:
        raise ValueError(f"cannot find {num_layers} decoder layers and a final norm in {type(model).__name__}")
    _, _, layers, norm = min(found, key=lambda f: f[:2])  # the outermost: a vision tower's blocks sit deeper
    return layers, norm


class ModelShape:
    """A checkpoint's HF config and its decoder's depth, width and vocabulary, on `device`."""

    def __init__(self, model: str, device: str = "cpu") -> None:
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(model)
        self.text = self.config.get_text_config()
        self.num_layers: int = self.text.num_hidden_layers
        self.hidden_size: int = self.text.hidden_size
        self.vocab_size: int = self.text.vocab_size
        self.device = torch.device(device)


class Reference(ModelShape):
    """An HF causal LM loaded in float32 on `device`, with hooks that keep (on CPU, float32)
    the states `run` is asked for and nothing else."""

    def __init__(self, model: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(model, device)
        kw: dict[str, Any] = {}
        if self.device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
            # straight onto the GPU (transformers needs accelerate for that); without it the
            # weights pass through host memory: a 27B model in float32 is ~110 GB
            kw["device_map"] = str(self.device)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **kw).eval()
        self.model.to(self.device)
        self.dtype = torch.float32
        layers, norm = decoder_of(self.model, self.num_layers)
        self._want: set[Any] = set()
        self._got: dict[Any, torch.Tensor] = {}
        layers[0].register_forward_pre_hook(self._embeddings, with_kwargs=True)
        for i, layer in enumerate(layers):
            layer.register_forward_hook(self._keeper(i))
        norm.register_forward_hook(self._keeper(FINAL))
        # only the last position's logits: the full [T, vocab] in float32 would be the largest tensor
        params = inspect.signature(self.model.forward).parameters
        self._kw = {"use_cache": False, **({"logits_to_keep": 1} if "logits_to_keep" in params else {})}
        self.seconds = 0.0  # time spent in forwards

    def _keep(self, key: Any, t: torch.Tensor) -> None:
        if key in self._want:  # copied at once: later layers must not change it, and the GPU copy is dropped
            self._got[key] = t[0].detach().to("cpu", torch.float32, copy=True)

    def _keeper(self, key: Any):
        def hook(mod, inp, out):
            self._keep(key, out[0] if isinstance(out, tuple) else out)

        return hook

    def _embeddings(self, mod, args, kwargs):
        self._keep(EMBEDDINGS, args[0] if args else kwargs["hidden_states"])

    def to(self, dtype: torch.dtype) -> None:
        """Cast the model in place (the float32 weights go as the new ones come: one copy)."""
        self.model.to(dtype)
        self.dtype = dtype

    @torch.no_grad()
    def run(self, token_ids: list[int], want: set[Any]) -> dict[Any, torch.Tensor]:
        """{key: [T, H] float32 on CPU} for each key of `want`: a layer id (its output), EMBEDDINGS
        or FINAL (after the final norm)."""
        self._want, self._got = set(want), {}
        t0 = time.perf_counter()
        try:
            self.model(torch.tensor([token_ids], device=self.device), **self._kw)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.seconds += time.perf_counter() - t0
            got, self._got, self._want = self._got, {}, set()
        missing = set(want) - set(got)
        if missing:
            raise RuntimeError(f"the forward did not reach {sorted(map(str, missing))}: hooks not called")
        return got
