"""Which kernels run the Gated-DeltaNet (GDN) layers of check's HF reference (Qwen3-Next,
Qwen3.5/3.6): chosen here, stated in the report, and not left to what happens to be importable.

Transformers (5.17, 5.19) binds each GDN function of a modeling module (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`, `causal_conv1d_update`) when the module is
imported: to flash-linear-attention's op (`fla.ops.gated_delta_rule`) or the causal-conv1d package
whenever they import, whatever device the tensors are on, else to its own torch reference. So on a
host with fla installed a CPU run would call Triton kernels on CPU tensors, and a CUDA run
without it takes the torch fallback (a Python loop over 64-token chunks) with only a log line to
say so. check sets those module functions itself for the duration of each forward:

- "fla": fla's chunk_gated_delta_rule (and its fused_recurrent one, which a forward without a
  cache never calls) for the GDN recurrence, CUDA only; everything else is transformers' torch code.
- "torch": transformers' own torch code for all four.

The depthwise convolution and the gated norm stay torch either way (one cuDNN call and a few
elementwise ops: cheap); the chunked recurrence is what the torch fallback spends its time on.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
import warnings
from typing import Any, Callable, Iterator

import torch

CHOICES = ("auto", "fla", "torch")
FLA_OPS = "fla.ops.gated_delta_rule"
# the module functions a GDN layer's forward calls, looked up at call time (so a rebinding takes effect)
_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
          "causal_conv1d_update")
_FLA_FOR = {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
            "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"}


def fla_ops() -> Any:
    """flash-linear-attention's gated delta rule ops module (fla-core); raises if it cannot be imported."""
    return importlib.import_module(FLA_OPS)


def choose(want: str | None, device: str | torch.device) -> str:
    """"fla" or "torch" for `--gdn-kernels want` (None: auto) on `device`. auto: fla on CUDA
    where it imports, else torch; fla where it cannot run is refused (ValueError) before any
    model is loaded. fla is never imported for a CPU run."""
    want = "auto" if want is None else want
    if want not in CHOICES:
        raise ValueError(f"--gdn-kernels must be one of {', '.join(CHOICES)}, got {want!r}")
    if want == "torch":
        return "torch"
    if torch.device(device).type != "cuda":
        if want == "fla":
            raise ValueError(f"--gdn-kernels fla needs --device cuda (flash-linear-attention's kernels are Triton "
                             f"kernels for GPU tensors), got --device {str(device)!r}")
        return "torch"
    try:
        fla_ops()
    except Exception as e:  # an fla that fails to import (Triton mismatch, no driver) counts as absent
        installed = importlib.util.find_spec("fla") is not None
        if want == "fla":
            why = f"it fails to import: {e}" if installed else "it is not installed: pip install fla-core==0.6.0"
            raise ValueError(f"--gdn-kernels fla, but flash-linear-attention cannot be used: {why}") from None
        if installed:  # installed yet unusable: say why the slow path runs
            warnings.warn(f"flash-linear-attention is installed but fails to import ({e}); check's HF reference "
                          "runs its Gated-DeltaNet layers on transformers' torch fallback", stacklevel=2)
        return "torch"
    return "fla"


def _kwargs_it_takes(fn: Callable) -> Callable:
    """`fn` called with only the keyword arguments it names, as transformers' own binding calls
    it (a layer passes its extra kwargs along; an implementation takes what it names)."""
    params = inspect.signature(fn).parameters
    names = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{k: v for k, v in kwargs.items() if k in names})

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "fla_op")
    return call


def _torch_impl(module: Any, name: str) -> Callable:
    """transformers' own torch code for `name` of `module`, under whatever wraps it."""
    impl = inspect.unwrap(getattr(module, name))
    if getattr(impl, "__module__", None) != module.__name__:
        raise ValueError(f"{module.__name__}.{name} is {impl!r} from {getattr(impl, '__module__', '?')}, not "
                         "transformers' torch code: check cannot choose its Gated-DeltaNet kernels here")
    return impl


class GdnKernels:
    """The GDN kernels of one HF model: `name` is "fla", "torch", or None (no GDN layer);
    `pinned()` binds them around a forward and restores what was there after."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        if name not in ("fla", "torch"):
            raise ValueError(f"GDN kernels must be fla or torch, got {name!r}")
        classes = {type(m) for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}
        self.name: str | None = name if classes else None
        self._binds: list[tuple[Any, str, Callable]] = []
        per_module = []
        for mod in {sys.modules[c.__module__] for c in classes}:
            if not hasattr(mod, _FUNCS[0]) or any(hasattr(m, "chunk_gated_delta_rule") for m in model.modules()
                                                  if type(m) in classes):
                _refuse_per_layer(model, classes, mod, name)
            else:
                per_module.append(mod)
        fla = fla_ops() if per_module and name == "fla" else None
        for mod in per_module:
            for f in _FUNCS:
                if not hasattr(mod, f):
                    continue
                impl = getattr(fla, _FLA_FOR[f]) if fla is not None and f in _FLA_FOR else _torch_impl(mod, f)
                self._binds.append((mod, f, _kwargs_it_takes(impl)))

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        saved = [(mod, f, getattr(mod, f)) for mod, f, _ in self._binds]
        try:
            for mod, f, impl in self._binds:
                setattr(mod, f, impl)
            yield
        finally:
            for mod, f, old in saved:
                setattr(mod, f, old)


def _refuse_per_layer(model: torch.nn.Module, classes: set[type], mod: Any, name: str) -> None:
    """Older transformers choose the kernels per layer when the model is built (instance
    attributes, fla's own gated norm): accepted only where that choice is already the torch
    code and torch is asked for; anything else is refused rather than run unknown."""
    import transformers

    torch_chunk = getattr(mod, "torch_chunk_gated_delta_rule", None)
    for m in model.modules():
        if type(m) not in classes:
            continue
        norm = getattr(m, "norm", None)
        on_torch = (getattr(m, "chunk_gated_delta_rule", None) is torch_chunk is not None
                    and getattr(m, "causal_conv1d_fn", None) is None
                    and (norm is None or type(norm).__module__ == mod.__name__))
        if name != "torch" or not on_torch:
            raise ValueError(f"transformers {transformers.__version__} chose the Gated-DeltaNet kernels of "
                             f"{type(m).__name__} when it built the model; check chooses them itself on "
                             "transformers 5.17 and later (upgrade), or takes the torch path only where this one "
                             f"already did (asked for: {name})")
