"""What `vllm-hidden check` measures and how it decides (pure torch, no model).

Per (sample, column) -- a column is a stored layer id, or the final state -- the stored rows
are compared with HF Transformers' float32 states of the same tokens by relative L2 over all
rows of the sample. The bound a column must meet is set by how far HF itself moves when run
in the output's dtype (its "rounding error"): an engine computing the same function in that
dtype should land about as far from float32 as HF does, not much farther.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hidden.format.quant import FP8, dequantize, quantize

# err <= RATIO * max(hf_rounding, FLOOR) + FP8_FACTOR * fp8_error
#
# RATIO: the engine and HF both compute the layer in the output dtype with different kernels
# (fused residual+norm, chunked vs recurrent linear attention, other matmul orders), so the
# engine's error is HF's own rounding error times a factor of order one, not exactly it; 4
# leaves room for that while an off-by-one layer, other weights or a wrong position (rel L2
# ~0.1..1) stay far outside.
RATIO = 4.0
# FLOOR: a float32 output's rounding error is ~1e-6, yet two float32 implementations still
# differ by summation order (~1e-5..1e-4 after many layers); 1e-3 keeps that from failing
# while staying two orders of magnitude below what a wrong state gives.
FLOOR = 1e-3
# FP8_FACTOR: an fp8 output adds e4m3's quantization error (~2-3% rel L2, per-row scale) on
# top of the dtype's. It is measured by quantizing HF's float32 states as the writer does;
# the engine quantizes its own (slightly different) states, so its error is that one give or
# take a little: 1.25 covers the difference.
FP8_FACTOR = 1.25


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| over every value, in float32 (0 when both are zero)."""
    got, ref = got.float(), ref.float()
    den = ref.norm().item()
    num = (got - ref).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def fp8_error(ref: torch.Tensor) -> float:
    """rel L2 of `ref` [T, H] stored as the writer stores fp8 (float8 e4m3, one float32 scale
    per row) and read back as the reader returns it (bf16)."""
    x = ref.float().unsqueeze(1)  # [T, 1, H]: one column
    values = torch.empty(x.shape, dtype=FP8)
    scale = torch.empty(x.shape[:2], dtype=torch.float32)
    quantize(x, values, scale, torch.empty_like(scale))
    return rel_l2(dequantize(values, scale)[:, 0], ref)


def bound(hf_rounding: float, fp8: float | None = None) -> float:
    """The largest rel L2 a column may have, given HF's rounding error at the output dtype
    (and, for fp8 storage, the quantization error of HF's states)."""
    return RATIO * max(hf_rounding, FLOOR) + (FP8_FACTOR * fp8 if fp8 is not None else 0.0)


@dataclass(kw_only=True)
class Measure:
    """One sample's numbers for one column."""

    rel_l2: float  # stored vs HF float32
    neighbours: dict[Any, float]  # neighbouring reference state -> stored vs it
    hf_rounding: float = 0.0  # HF in the output dtype vs HF float32
    fp8_error: float | None = None  # HF float32 stored as fp8 vs HF float32

    @property
    def neighbour_ok(self) -> bool:
        """Closer to its own reference state than to every neighbouring one."""
        return all(_num(self.rel_l2) < _num(e) for e in self.neighbours.values())


@dataclass(kw_only=True)
class Column:
    """One column over the samples: worst and mean error, the bound, the verdict."""

    rel_l2: float
    rel_l2_mean: float
    worst_sample: Any
    hf_rounding: float
    fp8_error: float | None
    bound: float
    neighbour_ok: bool
    ok: bool

    @classmethod
    def of(cls, measures: dict[Any, Measure]) -> "Column":
        """From {sample id: Measure} (at least one)."""
        if not measures:
            raise ValueError("a column needs at least one sample, got none")
        worst = max(measures, key=lambda sid: _num(measures[sid].rel_l2))
        errs = [_num(m.rel_l2) for m in measures.values()]
        rounding = max(_num(m.hf_rounding) for m in measures.values())
        fp8s = [m.fp8_error for m in measures.values() if m.fp8_error is not None]
        fp8 = max(fp8s) if fp8s else None
        b = bound(rounding, fp8)
        neighbour_ok = all(m.neighbour_ok for m in measures.values())
        err = errs[list(measures).index(worst)]
        return cls(rel_l2=err, rel_l2_mean=sum(errs) / len(errs), worst_sample=worst, hf_rounding=rounding,
                   fp8_error=fp8, bound=b, neighbour_ok=neighbour_ok, ok=err <= b and neighbour_ok)

    def to_dict(self) -> dict[str, Any]:
        d = {"rel_l2": _json(self.rel_l2), "rel_l2_mean": _json(self.rel_l2_mean), "worst_sample": self.worst_sample,
             "hf_rounding": _json(self.hf_rounding), "bound": _json(self.bound), "neighbour_ok": self.neighbour_ok,
             "ok": self.ok}
        if self.fp8_error is not None:
            d["fp8_error"] = _json(self.fp8_error)
        return d


@dataclass(kw_only=True)
class Worst:
    """The (sample, column) farthest over (or closest to) its bound: a failing column first."""

    sample: Any
    layer: Any  # a layer id, or "final"
    rel_l2: float
    bound: float

    def to_dict(self) -> dict[str, Any]:
        return {"sample": self.sample, "layer": self.layer, "rel_l2": _json(self.rel_l2), "bound": _json(self.bound)}


def verdict(columns: dict[Any, Column]) -> tuple[str, Worst]:
    """("pass" | "fail", the worst column's sample): pass when every column is ok."""
    if not columns:
        raise ValueError("nothing to judge: no columns")
    key = max(columns, key=lambda k: (not columns[k].ok, columns[k].rel_l2 / columns[k].bound))
    c = columns[key]
    worst = Worst(sample=c.worst_sample, layer=key, rel_l2=c.rel_l2, bound=c.bound)
    return ("pass" if all(c.ok for c in columns.values()) else "fail"), worst


def _num(x: float) -> float:
    """NaN counts as infinitely wrong (every comparison with NaN is False)."""
    return math.inf if math.isnan(x) else x


def _json(x: float) -> float | None:
    """Strict JSON has no NaN or Infinity: None stands for a non-finite number."""
    return x if math.isfinite(x) else None
