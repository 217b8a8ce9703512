"""Per-layer statistics of the stored states: per row, a sum and a centred sum of squares
(`RowSums`), made on the device beside the gather (`capture.ring`, when the output keeps
statistics) and carried to the host in the step's one copy, or by the shard writer's threads
from the rows in host memory when they came without them; summed per shard (in its header
metadata and its `ShardInfo` record), summed over shards into the manifest's `layer_stats`,
and checked by `inspect` (`flags`).

A shard's record, per stored column (layer id as a string, then "final" for the final state):
`rows` (rows written), `sum` and `sumsq` of the values (float64 sums over rows, each row
reduced in float32; fp8 values dequantized: value = fp8 * scale), `absmax`, `zero_rows` (from
the per-row amax the writer already has) and `nonfinite_rows` (rows with NaN/Inf of the samples
refused for them, which are not written and so not in the other counts).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vllm_hidden.format.quant import FP8, FP8_MAX

STATS = "layer_stats"  # the shard header's metadata key (and the manifest's)
FINAL_COLUMN = "final"
KEYS = ("rows", "sum", "sumsq", "absmax", "zero_rows", "nonfinite_rows")

# Bytes a shard's statistics may take in its header: a column's record is at most ~210 bytes
# of JSON (six keys, floats of <= 24 characters), ~225 with the quotes escaped inside the
# metadata string.
STATS_HEADER_BYTES_PER_COLUMN = 256
STATS_HEADER_BYTES_FIXED = 64

# Values converted to float32 at a time (2 MiB of scratch, reused). Measured on a 2-core VM,
# bf16 [512, 5, 5120] samples, one core: 4.9 GB/s with this (20-row chunks), 3.3 with 2**17
# values a chunk (the per-op overhead shows), ~1 GB/s for torch.sum or vector_norm with
# dtype=float32 straight on the bf16 rows (per row or per layer slice); fp8 1.9 GB/s.
_CHUNK_VALUES = 1 << 19
# e4m3 -> float16 bits: sign-extended int8 << 7 puts the magnitude bits where float16's are
# (exponent bias 15 instead of 7: the value / 2**8, exact for every finite e4m3 value,
# subnormals included) and sets bits 15 and 14 of a negative value; clearing bit 14 leaves its
# sign. torch's own float8 -> float32 conversion runs at ~0.3 GB/s per core on CPU, this at ~2.
_F16_KEEP = ~(1 << 14)
_F16_SCALE = 256.0


def column_names(layer_ids: Iterable[int], final: bool) -> list[str]:
    return [str(i) for i in layer_ids] + ([FINAL_COLUMN] if final else [])


def header_bytes(columns: int) -> int:
    """Header room a shard's statistics of `columns` columns may take."""
    return STATS_HEADER_BYTES_FIXED + STATS_HEADER_BYTES_PER_COLUMN * columns


class RowSums:
    """Per-row sums and sums of squared deviations from the row's mean of [T, C, H] values in
    float32, converted a chunk at a time into scratch that is reused (one per writer thread, or
    the step buffer's on the device: no full-size temporary, nothing allocated per call).
    Centring each row first keeps the variance exact where the mean is large against the
    spread (a raw float32 sum of squares loses it: 8% off at mean 1000, std 0.8). The same
    code runs on the device and on the host, so either gives the same numbers (up to the
    order of float32 additions)."""

    def __init__(self, row_values: int, fp8: bool, device: torch.device | str = "cpu",
                 chunk_values: int = _CHUNK_VALUES) -> None:
        n = max(chunk_values, row_values)
        self.fp8 = fp8
        self.f32 = torch.empty(n, dtype=torch.float32, device=device)
        self.i16 = torch.empty(n, dtype=torch.int16, device=device) if fp8 else None

    def __call__(self, x: torch.Tensor, sums: torch.Tensor, m2: torch.Tensor) -> None:
        """sums[t, c] = sum of x[t, c, :], m2[t, c] = sum of (x[t, c, :] - its mean) ** 2; for
        fp8 values both are of value / 256 (see _F16_SCALE)."""
        t, c, h = x.shape
        step = max(1, self.f32.numel() // (c * h))
        for i in range(0, t, step):
            n = min(step, t - i)
            f = self.f32[: n * c * h].view(n, c, h)
            if self.i16 is not None:  # fp8 rows
                w = self.i16[: n * c * h].view(n, c, h)
                w.copy_(x[i : i + n].view(torch.int8))
                w.bitwise_left_shift_(7).bitwise_and_(_F16_KEEP)
                f.copy_(w.view(torch.float16))
            else:
                f.copy_(x[i : i + n])
            torch.sum(f, dim=-1, out=sums[i : i + n])
            f.sub_((sums[i : i + n] / h).unsqueeze(-1))
            torch.linalg.vecdot(f, f, out=m2[i : i + n])


class ColumnStats:
    """Running statistics of a shard's columns (float64 sums)."""

    __slots__ = ("rows", "sum", "sumsq", "absmax", "zero_rows", "nonfinite_rows")

    def __init__(self, columns: int) -> None:
        self.rows = 0
        self.sum = torch.zeros(columns, dtype=torch.float64)
        self.sumsq = torch.zeros(columns, dtype=torch.float64)
        self.absmax = torch.zeros(columns, dtype=torch.float64)
        self.zero_rows = torch.zeros(columns, dtype=torch.int64)
        self.nonfinite_rows = torch.zeros(columns, dtype=torch.int64)

    def add_rows(self, sums: RowSums, cols: slice, values: torch.Tensor, row_scale: torch.Tensor) -> None:
        """Rows `values` [T, C, H] of columns `cols`, with their per-row statistics `row_scale` [T, C]
        (the amax, or for fp8 values the scale: amax / 448)."""
        t, c, h = values.shape
        s32 = torch.empty((t, c), dtype=torch.float32)
        m2_32 = torch.empty((t, c), dtype=torch.float32)
        sums(values, s32, m2_32)
        self.add_sums(cols, s32, m2_32, row_scale, h, values.dtype == FP8)

    def add_sums(self, cols: slice, s32: torch.Tensor, m2_32: torch.Tensor, row_scale: torch.Tensor, h: int,
                 fp8: bool) -> None:
        """Rows of columns `cols` as `RowSums` reduced them (`s32`, `m2_32` [T, C], on the device
        or here) with their per-row statistics `row_scale` [T, C]; `h` values per row."""
        s, m2 = s32.to(torch.float64), m2_32.to(torch.float64)
        if fp8:  # value = fp8 * scale, summed per row before the scale
            scale = row_scale.to(torch.float64) * _F16_SCALE
            s *= scale
            m2 *= scale.square()
            amax = row_scale.amax(0).to(torch.float64) * FP8_MAX
        else:
            amax = row_scale.amax(0).to(torch.float64)
        # a row's sum of squares from its own (rounded) sum: the rounding cancels in sumsq - sum**2 / n
        self.sum[cols] += s.sum(0)
        self.sumsq[cols] += (m2 + s.square() / h).sum(0)
        torch.maximum(self.absmax[cols], amax, out=self.absmax[cols])
        self.zero_rows[cols] += (row_scale == 0).sum(0)

    def add_sample(self, sums: RowSums, buf: torch.Tensor, row_scale: torch.Tensor, final: torch.Tensor | None,
                   final_scale: torch.Tensor | None) -> None:
        """A written sample whose rows came without the device's sums (`add_summed` takes those):
        its layers' rows [T, K, H] and stats [T, K], and the final state's [T, H] and [T] when the
        output stores it, reduced here."""
        k = buf.shape[1]
        self.add_rows(sums, slice(0, k), buf, row_scale)
        if final is not None:
            if final_scale is None:
                raise ValueError("the final state's rows came without their statistics")
            self.add_rows(sums, slice(k, k + 1), final[:, None], final_scale[:, None])
        self.rows += buf.shape[0]

    def add_summed(self, row_sums: torch.Tensor, row_scale: torch.Tensor, final_scale: torch.Tensor | None, h: int,
                   fp8: bool) -> None:
        """Written rows known by their sums alone: `row_sums` [T, 2, C] (the layers, then the
        final state's column when `final_scale` [T] is given), `row_scale` [T, K]; rows of `h` values.
        Any rows will do (several samples' at once): every statistic is a sum over rows."""
        k = row_scale.shape[1]
        self.add_sums(slice(0, k), row_sums[:, 0, :k], row_sums[:, 1, :k], row_scale, h, fp8)
        if final_scale is not None:
            self.add_sums(slice(k, k + 1), row_sums[:, 0, k:], row_sums[:, 1, k:], final_scale[:, None], h, fp8)
        self.rows += row_scale.shape[0]

    def add_not_finite(self, row_scale: torch.Tensor, final_scale: torch.Tensor | None) -> None:
        """A refused sample's rows with NaN/Inf, per column, from their statistics (which are
        NaN/Inf exactly then)."""
        k = row_scale.shape[1]
        self.nonfinite_rows[:k] += (~torch.isfinite(row_scale)).sum(0)
        if final_scale is not None:
            self.nonfinite_rows[k] += int((~torch.isfinite(final_scale)).sum())

    def merge(self, other: "ColumnStats") -> None:
        self.rows += other.rows
        self.sum += other.sum
        self.sumsq += other.sumsq
        torch.maximum(self.absmax, other.absmax, out=self.absmax)
        self.zero_rows += other.zero_rows
        self.nonfinite_rows += other.nonfinite_rows

    def record(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """The shard's record: {column name: {KEYS...}}."""
        if len(names) != self.sum.numel():
            raise ValueError(f"{len(names)} column names for {self.sum.numel()} columns, got {names!r}")
        cols = zip(self.sum.tolist(), self.sumsq.tolist(), self.absmax.tolist(), self.zero_rows.tolist(),
                   self.nonfinite_rows.tolist())
        return {name: {"rows": self.rows, "sum": s, "sumsq": q, "absmax": a, "zero_rows": z, "nonfinite_rows": nf}
                for name, (s, q, a, z, nf) in zip(names, cols)}


def check_record(d: Any) -> dict[str, dict[str, Any]]:
    """A shard's record as read back (header, journal line, manifest entry), checked."""
    if not isinstance(d, dict) or not all(
            isinstance(v, dict) and all(isinstance(v.get(k), (int, float)) for k in KEYS) for v in d.values()):
        raise ValueError(f"its {STATS} are not {{column: {{{', '.join(KEYS)}}}}}, got {str(d)[:200]}")
    return d


def aggregate(records: Iterable[dict[str, dict[str, Any]] | None], hidden_size: int,
              stale: Iterable[bool] | None = None) -> tuple[dict[str, dict[str, Any]] | None, int]:
    """The output's statistics from its shards' records (None: a shard without statistics),
    and how many shards they cover. `stale[i]`: shard i was made by an earlier attempt of a
    resumed run, whose refused samples this attempt tried again; its non-finite rows are
    left out (they are counted where the samples were tried last)."""
    records = list(records)
    stale = list(stale) if stale is not None else [False] * len(records)
    tot: dict[str, dict[str, float]] = {}
    covered = 0
    for rec, old in zip(records, stale):
        if rec is None:
            continue
        covered += 1
        for name, v in rec.items():
            t = tot.setdefault(name, {k: 0 for k in KEYS})
            t["rows"] += v["rows"]
            t["sum"] += v["sum"]
            t["sumsq"] += v["sumsq"]
            t["absmax"] = max(t["absmax"], v["absmax"])
            t["zero_rows"] += v["zero_rows"]
            if not old:
                t["nonfinite_rows"] += v["nonfinite_rows"]
    if not covered:
        return None, 0
    return {name: summarize(t, hidden_size) for name, t in tot.items()}, covered


def summarize(t: Mapping[str, float], hidden_size: int) -> dict[str, Any]:
    """{rows, mean, std, absmax, zero_rows, nonfinite_rows} from summed records (population
    std over every stored value; None without rows)."""
    n = t["rows"] * hidden_size
    mean = std = None
    if n:
        mean = t["sum"] / n
        std = math.sqrt(max(t["sumsq"] / n - mean * mean, 0.0))
        if abs(mean) >= t["absmax"]:  # every value is +-absmax of one sign: constant, whatever rounding says
            std = 0.0
    return {"rows": int(t["rows"]), "mean": mean, "std": std, "absmax": float(t["absmax"]),
            "zero_rows": int(t["zero_rows"]), "nonfinite_rows": int(t["nonfinite_rows"])}


# -- flags ---------------------------------------------------------------------------------------

NEAR = 4  # layers whose ids differ by at most this share most of the residual stream
JUMP = 10.0  # a std this many times above or below every near layer's
CONSTANT = 1e-6  # std <= this * absmax: constant


def flags(layer_stats: Mapping[str, Mapping[str, Any]] | None) -> list[dict[str, str]]:
    """What looks wrong in an output's statistics: a column all zero, constant, with
    non-finite rows, or (layers only) a std more than 10x above or below that of every stored
    layer within 4 ids of it (layers further apart legitimately differ by 10x and more).
    Each flag is {"layer", "flag", "detail"}."""
    if not layer_stats:
        return []
    out: list[dict[str, str]] = []
    odd: set[str] = set()  # all zero or constant: no std to compare with
    for name, v in layer_stats.items():
        rows, std, absmax = v["rows"], v["std"], v["absmax"]
        if rows and v["zero_rows"] == rows:
            odd.add(name)
            out.append({"layer": name, "flag": "all_zero", "detail": f"every one of its {rows} rows is zero"})
        elif rows and std is not None and (std == 0 or std <= CONSTANT * absmax):
            odd.add(name)
            out.append({"layer": name, "flag": "constant",
                        "detail": f"std {std:.3g} with absmax {absmax:.3g}: every value the same"})
        if v["nonfinite_rows"]:
            out.append({"layer": name, "flag": "nonfinite",
                        "detail": f"{v['nonfinite_rows']} rows with NaN/Inf (their samples were not written)"})
    layers = {int(name): v["std"] for name, v in layer_stats.items()
              if name != FINAL_COLUMN and name not in odd and v["rows"] and v["std"]}
    for i, std in layers.items():
        near = {j: s for j, s in layers.items() if j != i and abs(j - i) <= NEAR}
        if near and all(std > JUMP * s or std * JUMP < s for s in near.values()):
            around = ", ".join(f"{j}: {s:.3g}" for j, s in sorted(near.items()))
            out.append({"layer": str(i), "flag": "std_jump",
                        "detail": f"std {std:.3g}, more than {JUMP:g}x off every layer within {NEAR} ({around})"})
    order = {name: n for n, name in enumerate(layer_stats)}
    return sorted(out, key=lambda f: order[f["layer"]])
