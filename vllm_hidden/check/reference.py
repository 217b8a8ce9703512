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
from typing import Any, cast

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


def hf_config(model: str) -> Any:
    """`model`'s config as Transformers' own config class reads it. Another library may have
    registered its own class for the model type in this process (vLLM 0.26 does for qwen3_5 and
    qwen3_5_moe once it has loaded such a checkpoint): Transformers' model classes do not know
    that class's sub-configs, so the checkpoint is read again with Transformers' own."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model)
    own: Any = getattr(transformers, CONFIG_MAPPING_NAMES.get(config.model_type, ""), None)
    if isinstance(own, type) and type(config) is not own:
        config = cast(Any, own).from_pretrained(model)
    return config


def causal_lm(config: Any) -> tuple[Any, Any]:
    """(the causal-LM class Transformers maps for `config`'s model type, the config to build it
    with). A composite checkpoint (Qwen3.5/3.6: `Qwen3_5ForConditionalGeneration`, a text and a
    vision config) maps to its text model (`Qwen3_5ForCausalLM`), built from the text config
    (`get_text_config()`), which gets the checkpoint's quantization_config as Transformers' own
    auto classes pass it on. (None, config) for a type Transformers does not map (remote code)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, ""), None)
    if cls is None:
        return None, config
    text: Any = config.get_text_config()
    if text is not config and isinstance(text, getattr(cls, "config_class", ())):
        quant = getattr(config, "quantization_config", None)
        if quant is not None:
            cast(Any, text).quantization_config = quant
        return cls, text
    return cls, config


class ModelShape:
    """A checkpoint's HF config and its decoder's depth, width and vocabulary, on `device`."""

    def __init__(self, model: str, device: str = "cpu") -> None:
        self.config = hf_config(model)
        self.text = self.config.get_text_config()
        self.num_layers: int = self.text.num_hidden_layers
        self.hidden_size: int = self.text.hidden_size
        self.vocab_size: int = self.text.vocab_size
        self.device = torch.device(device)


class Reference(ModelShape):
    """An HF causal LM loaded in float32 on `device`, with hooks that keep (on CPU, float32)
    the states `run` is asked for and nothing else. `gdn_kernels` ("fla" | "torch", see
    check.gdn.choose) runs its Gated-DeltaNet layers; `self.gdn_kernels` says which ran (None:
    the model has none)."""

    def __init__(self, model: str, device: str = "cpu", gdn_kernels: str = "torch") -> None:
        from transformers import AutoModelForCausalLM

        from vllm_hidden.check.gdn import GdnKernels

        super().__init__(model, device)
        kw: dict[str, Any] = {}
        if self.device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
            # straight onto the GPU (transformers needs accelerate for that); without it the
            # weights pass through host memory: a 27B model in float32 is ~110 GB
            kw["device_map"] = str(self.device)
        cls, config = causal_lm(self.config)
        if cls is None:
            cls, config = AutoModelForCausalLM, None
        self.model = cls.from_pretrained(model, config=config, dtype=torch.float32, **kw).eval()
        self.model.to(self.device)
        self.dtype = torch.float32
        self._gdn = GdnKernels(self.model, gdn_kernels)
        self.gdn_kernels = self._gdn.name
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
            with self._gdn.pinned():
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
