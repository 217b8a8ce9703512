"""Per-row statistics and float8 storage (pure torch; the same code on the GPU and on CPU).

Every captured row gets, per column (layer, or the final state), one float32 beside it in the
step's one transfer, named `row_scale` wherever it travels ([T, C]; `final_scale` for the final
state's column): the row's largest magnitude (`amax`). With `--storage-dtype fp8` the values
are stored as float8 e4m3 and that float32 is the row's scale, amax / 448 (e4m3's largest
finite value), so value = fp8 * scale. Either way it is NaN or Inf exactly when the row holds
a NaN or Inf (the max-norm propagates NaN), which is how the writer tells a non-finite sample
without scanning its states.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TINY = 1e-30  # an all-zero row: scale 0, and its values divide by this instead of 0


def row_amax(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[..., c] = max |x[..., c, :]| in float32, in one pass that reads x once (no temporary)."""
    return torch.linalg.vector_norm(x, float("inf"), dim=-1, dtype=torch.float32, out=out)


def quantize(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, work: torch.Tensor,
             token_work: torch.Tensor | None = None) -> None:
    """x [N, C, H] (bf16/f16/f32) -> values [N, C, H] float8 e4m3 and scale [N, C] float32
    (amax / 448). `work` [N, C] float32 is scratch. Output views may be strided (they live in
    the step buffer's packed rows); nothing is allocated. With `token_work` ([N, 1] float32
    scratch): one scale per token over all its columns (every column holds it), as
    hs_connectors' FP8 files store it."""
    row_amax(x, work)
    if token_work is not None:
        torch.amax(work, dim=1, keepdim=True, out=token_work)  # amax propagates NaN
        work.copy_(token_work.expand_as(work))
    torch.div(work, FP8_MAX, out=scale)
    torch.clamp(work, min=_TINY, out=work)  # keeps NaN: a non-finite row stays flagged by its scale
    torch.reciprocal(work, out=work)
    work.mul_(FP8_MAX)
    torch.mul(x, work.unsqueeze(-1), out=values)  # computed in float32, rounded once to e4m3


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """values [..., H] float8 with scale [...] float32 -> [..., H] in `dtype`."""
    return (values.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def bad_values(buf: torch.Tensor) -> torch.Tensor | None:
    """The mask of `buf`'s NaN/Inf values, or None if every value is finite. One
    allocation-free reduction first (min/max propagate NaN and reach +-Inf), ~10 GB/s per
    core on bf16; the mask is only made for a bad sample."""
    if buf.numel() == 0:
        return None
    lo, hi = torch.aminmax(buf)
    if torch.isfinite(lo) and torch.isfinite(hi):
        return None
    return ~torch.isfinite(buf)


def not_finite(buf: torch.Tensor, layer_ids: list, what: str = "values") -> str | None:
    """None if every value of `buf` [T, K, H] is finite, else what is wrong and where."""
    bad = bad_values(buf)
    if bad is None:
        return None
    nan = int(torch.isnan(buf).sum())
    layers = [layer_ids[k] for k in bad.any(dim=(0, 2)).nonzero().flatten().tolist()]
    rows = bad.any(dim=(1, 2)).nonzero().flatten()
    return (f"hidden states are not finite: {nan} NaN and {int(bad.sum()) - nan} Inf {what} in layer ids "
            f"{layers}, {rows.numel()} of {buf.shape[0]} tokens (first at token {int(rows[0])}); not written")
