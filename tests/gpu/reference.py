"""The HF Transformers reference the Qwen3.5 GPU tests compare with: the same checkpoint's
weights (float32 unless said), every decoder layer's output, the last one before the final norm."""

from __future__ import annotations

import torch


class Qwen35Reference:
    """Qwen3_5ForConditionalGeneration on `device`, with a hook on the last decoder layer
    (HF applies the final norm to the last entry of output_hidden_states)."""

    def __init__(self, model_dir, dtype: torch.dtype = torch.float32, device: str = "cuda") -> None:
        from transformers import Qwen3_5ForConditionalGeneration

        self.device = device
        self.model = Qwen3_5ForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.decoder = self.model.model.language_model.layers
        last = self._last = {}  # the hook holds this dict, not self: dropping self frees the model
        self.decoder[-1].register_forward_hook(
            lambda m, i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))

    @torch.no_grad()
    def run(self, ids: list[int], **kw):
        """(HF's output, states) for one sequence: states[0] the embeddings, states[k + 1] the
        output of decoder layer k, the last one's before the final norm (the output's
        hidden_states[-1] is after it). `kw` goes to the forward (e.g. logits_to_keep)."""
        r = self.model(torch.tensor([ids], device=self.device), output_hidden_states=True, use_cache=False, **kw)
        return r, [h[0] for h in r.hidden_states[: len(self.decoder)]] + [self._last["h"][0]]
