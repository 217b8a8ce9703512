"""The captured layers written by the model's forward itself, straight into capture's step buffer.

vLLM's models add an EAGLE-3 aux state through `EagleModelMixin._maybe_add_hidden_state`
(`hidden_states + residual` after layer i - 1, for aux id i). Left as vLLM has it, those states
are extra outputs of the forward: they live to its end (vLLM's profile counts them as activations),
every piecewise CUDA graph keeps its own in the graph pool, and a step's gather copies them once
more. `hooks` replaces that method so that, for a model capture installed on, the sum is written
by one op, `vllm_hidden::stash`, into its column of the step buffer (`StepTransfer.stage`) and
nothing is added to the aux list: the model returns what plain vLLM's returns, its graphs and
activations are plain vLLM's, and capture's device memory is the step buffer it allocated at load.

The op mutates a one-element token (a buffer of the model, so a graph input) so that compilers
keep it; it writes wherever the target says. Under CUDA graphs its kernels are captured with the
target's addresses, so the target is fixed at install and never moves (a sink that opens with
another layout gets a new buffer and gathers from this one: `runner.Capture`). Before writing, the
compute stream waits for the previous step's copy to the host to have read the buffer: an
external event, so that a graph replay waits on the latest copy too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ATTR = "vllm_hidden_stash"  # on the model module that adds aux states: {aux id: column}
TOKEN = "vllm_hidden_stash_token"  # its one-element buffer the op mutates

_lib = torch.library.Library("vllm_hidden", "FRAGMENT")
_lib.define("stash(Tensor(a!) token, Tensor hidden, Tensor? residual, int column) -> ()")


@dataclass
class Target:
    """Where the forward writes: `values` [max_tokens, K, H] in the model's dtype (a view of the
    step buffer, `StepTransfer.stage`), and on CUDA the event recorded after each copy to the host."""

    values: torch.Tensor
    copied: torch.cuda.Event | None = None


_target: Target | None = None  # this process's (one writer rank per process); None: the op does nothing


def _stash(token: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, column: int) -> None:
    t = _target
    if t is None:  # not the writer rank (TP > 1), or capture not installed in this process
        return
    n = min(hidden.shape[0], t.values.shape[0])  # a padded batch never exceeds max_num_batched_tokens
    if t.copied is not None:
        torch.cuda.current_stream(hidden.device).wait_event(t.copied)
    dst = t.values[:n, column]
    if residual is None:
        dst.copy_(hidden[:n])
    else:
        torch.add(hidden[:n], residual[:n], out=dst)


def _stash_fake(token, hidden, residual, column) -> None:
    return None


for _key in ("CPU", "CUDA"):
    _lib.impl("stash", _stash, _key)
torch.library.register_fake("vllm_hidden::stash", _stash_fake, lib=_lib)


def aux_module(model, aux_ids: tuple[int, ...]) -> torch.nn.Module | None:
    """The module inside `model` that adds aux states through `_maybe_add_hidden_state` for these
    ids (after `set_aux_hidden_state_layers`); None where the model adds them inline (then capture
    reads them from the model's aux outputs)."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    for m in model.modules():
        if isinstance(m, EagleModelMixin) and tuple(getattr(m, "aux_hidden_state_layers", ())) == tuple(aux_ids) \
                and _calls_mixin(type(m)):
            return m
    return None


def _calls_mixin(cls: Any) -> bool:
    """Whether the class's forward adds aux states through the mixin's method (vLLM's models do,
    except those that write the sum inline, such as DeepSeek-V2's)."""
    import inspect

    try:
        return "_maybe_add_hidden_state" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def attach(module: torch.nn.Module, columns: dict[int, int], device: torch.device) -> None:
    """Before torch.compile: this module's aux ids go to these step-buffer columns (on every rank,
    so that every rank compiles the same graph)."""
    module.register_buffer(TOKEN, torch.zeros(1, device=device), persistent=False)
    setattr(module, ATTR, dict(columns))


def set_target(target: Target | None) -> None:
    global _target
    _target = target


def add_or_stash(module, aux_hidden_states: list, layer_idx: int, hidden_states: torch.Tensor,
                 residual: torch.Tensor | None) -> bool:
    """`_maybe_add_hidden_state` for a module capture attached to: the layer's state into its
    column (True: handled, the aux list is left as it was); False for any other module."""
    columns = getattr(module, ATTR, None)
    if columns is None:
        return False
    column = columns.get(layer_idx)
    if column is not None:
        torch.ops.vllm_hidden.stash(getattr(module, TOKEN), hidden_states, residual, column)
    return True
