"""`vllm-hidden check`: recompute a few samples' stored states with HF Transformers and say
whether the output holds what its manifest says it holds."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hidden.check.compare import FLOOR, FP8_FACTOR, RATIO, Column, Measure, Worst, fp8_error, rel_l2, verdict
from vllm_hidden.check.reference import EMBEDDINGS, FINAL

DEVICES = ("cpu", "cuda")


@dataclass(kw_only=True)
class CheckReport:
    path: str
    model: str
    device: str
    dtype: str  # the output's dtype: HF's rounding error is measured in it
    fp8: bool
    samples: list[Any]  # the ids checked, in dataset order
    layers: dict[int, Column]
    final_state: Column | None
    verdict: str  # "pass" | "fail"
    worst: Worst
    seconds_per_sample: float  # HF forwards (float32 + output dtype) per sample
    gdn_kernels: str | None = None  # what ran HF's Gated-DeltaNet layers: "fla" | "torch" (None: the model has none)

    @property
    def ok(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "model": self.model, "device": self.device, "dtype": self.dtype,
             "samples": self.samples, "bound": {"ratio": RATIO, "floor": FLOOR, "fp8_factor": FP8_FACTOR},
             "layers": {str(k): c.to_dict() for k, c in self.layers.items()}}
        if self.final_state is not None:
            d["final_state"] = self.final_state.to_dict()
        d.update(verdict=self.verdict, worst=self.worst.to_dict(), seconds_per_sample=round(self.seconds_per_sample, 3),
                 gdn_kernels=self.gdn_kernels)
        return d

    def table(self) -> list[str]:
        """The per-layer table and the verdict line, for a person."""
        head = ["layer", "rel L2 worst", "mean", "worst sample", "HF rounding"] + (["fp8"] if self.fp8 else [])
        head += ["bound", "neighbours", "ok"]
        rows = [head]
        cols = [(str(k), c) for k, c in self.layers.items()]
        if self.final_state is not None:
            cols.append(("final", self.final_state))
        for name, c in cols:
            rows.append([name, f"{c.rel_l2:.2e}", f"{c.rel_l2_mean:.2e}", str(c.worst_sample), f"{c.hf_rounding:.2e}"]
                        + ([f"{c.fp8_error:.2e}"] if self.fp8 else [])
                        + [f"{c.bound:.2e}", "ok" if c.neighbour_ok else "CLOSER TO A NEIGHBOUR",
                           "ok" if c.ok else "FAIL"])
        return aligned(rows) + [self.message()]

    def message(self) -> str:
        w = self.worst
        where = f"sample {w.sample!r}, {'the final state' if w.layer == FINAL else f'layer {w.layer}'}"
        col = self.final_state if w.layer == FINAL else self.layers[w.layer]
        near = "" if col is None or col.neighbour_ok else " and closer to a neighbouring layer's state than to its own"
        head = (f"pass: {len(self.samples)} samples match HF Transformers on every layer" if self.ok
                else "fail: the stored states do not match HF Transformers")
        gdn = "" if self.gdn_kernels is None else f", Gated-DeltaNet kernels: {self.gdn_kernels}"
        return (f"{head}; worst {where}: rel L2 {w.rel_l2:.3g} vs bound {w.bound:.3g}{near} "
                f"({self.seconds_per_sample:.1f} s of HF per sample on {self.device}{gdn})")


def aligned(rows: list[list[str]]) -> list[str]:
    """A report's table for a person: the first row is the header, columns padded to a width."""
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def choose_samples(n: int, samples: int, seed: int = 0) -> list[int]:
    """`samples` indices of n, one drawn (with `seed`) from each of `samples` equal stretches
    of the index: shards are contiguous stretches of it, so the choice spreads over them. All
    of them when n <= samples."""
    if samples < 1:
        raise ValueError(f"--samples must be at least 1, got {samples!r}")
    if n <= samples:
        return list(range(n))
    rng = random.Random(seed)
    return [rng.randrange(k * n // samples, (k + 1) * n // samples) for k in range(samples)]


def open_output(path: str, samples: int, s3_endpoint_url: str | None, device: str | None = None):
    """The output at `path` as a dataset, after checking the options every check takes
    (`device` None: none is used)."""
    from vllm_hidden.data import HiddenStatesDataset

    if samples < 1:
        raise ValueError(f"--samples must be at least 1, got {samples!r}")
    if device is not None and device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}, but torch sees no CUDA device here")
    try:
        ds = HiddenStatesDataset(path, s3_endpoint_url=s3_endpoint_url)
    except FileNotFoundError as e:
        raise ValueError(f"not an extract output: {path!r} ({e})") from None
    if len(ds) == 0:
        raise ValueError(f"the output {path!r} holds no samples: nothing to check")
    return ds


def _dtype(name: str) -> torch.dtype:
    t = getattr(torch, str(name), None)
    if not isinstance(t, torch.dtype) or not t.is_floating_point:
        raise ValueError(f"the output's manifest names dtype {name!r}, not a floating-point torch dtype")
    return t


def check_output(path: str, model: str, samples: int = 8, seed: int = 0, device: str = "cpu",
                 s3_endpoint_url: str | None = None, progress: bool = False,
                 gdn_kernels: str | None = None) -> CheckReport:
    """Recompute `samples` samples of the output at `path` (a directory or s3://bucket/prefix)
    with HF Transformers from `model` in float32 and compare every stored layer (and the final
    state) with it; see compare.py for the bound. `gdn_kernels`: auto (None), fla or torch for
    HF's Gated-DeltaNet layers (check.gdn)."""
    from vllm_hidden.check.gdn import choose

    path = str(path)
    ds = open_output(path, samples, s3_endpoint_url, device)
    kernels = choose(gdn_kernels, device)  # before the model loads: a 27B one takes minutes
    m = ds.manifest
    dtype = _dtype(m.dtype)
    final = m.final_state == "post-norm"
    fp8 = m.storage is not None
    chosen = choose_samples(len(ds), samples, seed)

    from vllm_hidden.check.reference import Reference

    ref = Reference(model, device, kernels)
    if ref.num_layers != m.num_model_layers or ref.hidden_size != m.hidden_size:
        raise ValueError(f"--model {model!r} has {ref.num_layers} layers of width {ref.hidden_size}; the output was "
                         f"written from one with {m.num_model_layers} of width {m.hidden_size} ({m.model!r})")
    last = ref.num_layers - 1
    cols: list[Any] = sorted(ds.layer_ids) + ([FINAL] if final else [])
    # the float32 pass also needs each stored layer's neighbours (layer -1: the embeddings)
    need = set(cols) | {j for i in ds.layer_ids for j in (i - 1, i + 1) if EMBEDDINGS <= j <= last}
    if final:
        need.add(last)  # the final state's neighbour: the last layer before the norm
    passes = 1 if dtype == torch.float32 else 2  # a float32 output: HF's rounding error is 0
    bar = _Bar(len(chosen) * passes, progress)
    measures: dict[Any, dict[Any, Measure]] = {c: {} for c in cols}
    kept: dict[Any, dict[Any, torch.Tensor]] = {}  # sample -> column -> HF float32, for the rounding pass
    tokens: dict[Any, list[int]] = {}
    try:
        bar.stage("HF float32")
        for i in chosen:
            s = ds[i]
            sid = s["id"]
            ids = s["token_ids"].tolist()
            if ids and (min(ids) < 0 or max(ids) >= ref.vocab_size):
                raise ValueError(f"sample {sid!r} holds token ids outside --model {model!r}'s vocabulary "
                                 f"(0..{ref.vocab_size - 1}): got {min(ids)}..{max(ids)}")
            states = ref.run(ids, need)
            stored = {lid: s["hidden_states"][:, k] for k, lid in enumerate(ds.layer_ids)}
            if final:
                stored[FINAL] = s["final_hidden_states"]
            for c in cols:
                near = [last] if c == FINAL else [j for j in (c - 1, c + 1) if j in states]
                measures[c][sid] = Measure(
                    rel_l2=rel_l2(stored[c], states[c]),
                    neighbours={j: rel_l2(stored[c], states[j]) for j in near},
                    fp8_error=fp8_error(states[c]) if fp8 else None)
            kept[sid] = {c: states[c] for c in cols}
            tokens[sid] = ids
            del states, stored, s  # the neighbours and the sample's rows go now
            bar.advance()
        if passes == 2:
            ref.to(dtype)
            bar.stage(f"HF {m.dtype}")
            for sid, ids in tokens.items():
                states = ref.run(ids, set(cols))
                for c in cols:
                    measures[c][sid].hf_rounding = rel_l2(states[c], kept[sid][c])
                del kept[sid], states
                bar.advance()
    finally:
        bar.close()
    columns = {c: Column.of(measures[c]) for c in cols}
    v, worst = verdict(columns)
    return CheckReport(path=path, model=model, device=device, dtype=m.dtype, fp8=fp8, samples=list(tokens),
                       layers={c: columns[c] for c in cols if c != FINAL},
                       final_state=columns.get(FINAL), verdict=v, worst=worst,
                       seconds_per_sample=ref.seconds / len(tokens), gdn_kernels=ref.gdn_kernels)


class _Bar:
    """A rich progress bar on stderr (or nothing)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.p = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(TextColumn("check {task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeRemainingColumn(), console=Console(stderr=True))
        self.task = self.p.add_task("", total=total)
        self.p.start()

    def stage(self, what: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=what)

    def advance(self) -> None:
        if self.p is not None:
            self.p.advance(self.task)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()
