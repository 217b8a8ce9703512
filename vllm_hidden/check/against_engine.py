"""`vllm-hidden check --reference engine`: the stored states against the engine's own
logprobs, for targets HF cannot run the same way (FP8 weights: HF's reference would be the
bf16 model, whose states differ from the FP8 one's by far more than rounding).

Per checked sample, the stored last layer goes through the model's final norm and LM head
(check.head) and its logprobs are compared with the prompt logprobs a plain vLLM engine
reports for the same tokens, at the engine's top-k tokens and the prompt's own token of
every position. With --final-state post-norm, the final state goes through the LM head as
well. The stored state is what the engine's last layer handed its final norm, so both sides
compute the same function of the same numbers -- except that the engine computes the layers
again, in other batches than the extract's, and batching alone moves bf16 results a little
(other kernel shapes, other split points). So:

  mean |ours - engine| <= RATIO * max(rounding, noise, FLOOR) + FP8_FACTOR * fp8

rounding: the same logprobs computed once in float32 and once at the engine's precision (the
normed state and the LM head's product rounded to the output dtype), mean |difference|;
noise: the engine's own logprobs with every checked sample in flight together against each
sample alone, mean |difference| (the engine is asked twice);
fp8 (fp8 storage only): the logprobs moved by e4m3 rounding of the stored rows, measured by
rounding them once more on a grid shifted by a non-power-of-two factor. RATIO and
FP8_FACTOR are check.compare's; FLOOR here is in logprob units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_hidden.check.compare import FP8_FACTOR, RATIO, _json
from vllm_hidden.check.reference import ModelShape
from vllm_hidden.check.run import _Bar, _dtype, aligned, choose_samples, open_output

FLOOR = 1e-3  # logprob units: a float32 output's rounding is ~1e-6, summation order still moves it
SHIFT = 1.37  # the fp8 probe's grid: scales off by a factor no power of two, so no value stays on it
E4M3_MAX = 448.0
TOP_K = 20  # vLLM's default --max-logprobs


@dataclass(kw_only=True)
class Source:
    """One stored column through the head, over the checked samples."""

    name: str  # "last layer" | "final state"
    mean_abs: float  # worst sample's mean |ours - engine| (logprob units)
    max_abs: float  # over every sample and compared token
    top1_agree: float  # share of positions where our most likely token (of the engine's top k) is the engine's
    rounding: float
    noise: float  # the engine against itself, batched together vs each sample alone
    fp8: float | None
    bound: float
    worst_sample: Any
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        d = {"mean_abs": _json(self.mean_abs), "max_abs": _json(self.max_abs), "top1_agree": round(self.top1_agree, 4),
             "rounding": _json(self.rounding), "noise": _json(self.noise), "bound": _json(self.bound),
             "worst_sample": self.worst_sample,
             "ok": self.ok}
        if self.fp8 is not None:
            d["fp8"] = _json(self.fp8)
        return d


@dataclass(kw_only=True)
class EngineCheckReport:
    path: str
    model: str
    device: str
    engine_args: list[str]
    samples: list[Any]  # every chosen sample (one-token ones have no position to compare)
    positions: int  # compared positions over all samples
    sources: list[Source]
    verdict: str

    @property
    def ok(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "model": self.model, "reference": "engine", "device": self.device,
                "engine_args": self.engine_args, "samples": self.samples, "positions": self.positions,
                "bound": {"ratio": RATIO, "floor": FLOOR, "fp8_factor": FP8_FACTOR},
                "sources": {s.name: s.to_dict() for s in self.sources}, "verdict": self.verdict}

    def table(self) -> list[str]:
        head = ["stored", "mean |dlogprob|", "max", "top-1 agree", "rounding", "engine noise", "fp8", "bound", "ok"]
        rows = [head] + [[s.name, f"{s.mean_abs:.2e}", f"{s.max_abs:.2e}", f"{s.top1_agree:.3f}",
                          f"{s.rounding:.2e}", f"{s.noise:.2e}", "-" if s.fp8 is None else f"{s.fp8:.2e}",
                          f"{s.bound:.2e}",
                          "ok" if s.ok else "FAIL"] for s in self.sources]
        return aligned(rows) + [self.message()]

    def message(self) -> str:
        w = max(self.sources, key=lambda s: (not s.ok, s.mean_abs / s.bound))
        head = (f"pass: {len(self.samples)} samples' stored states give the engine's own logprobs" if self.ok
                else "fail: the stored states do not give the engine's logprobs")
        return (f"{head}; worst: the {w.name} of sample {w.worst_sample!r}, mean |dlogprob| {w.mean_abs:.3g} "
                f"vs bound {w.bound:.3g} over {self.positions} positions")


def fp8_regrid(x: torch.Tensor) -> torch.Tensor:
    """`x` [T, H] rounded to float8 e4m3 once more, per row, on a grid shifted by SHIFT: the
    size of the error e4m3 storage put into the rows, drawn afresh."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) * SHIFT / E4M3_MAX
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def check_against_engine(path: str, model: str, samples: int = 8, seed: int = 0, device: str = "cpu",
                         engine_args: list[str] | None = None, s3_endpoint_url: str | None = None,
                         progress: bool = False, top_k: int = TOP_K) -> EngineCheckReport:
    from vllm_hidden.check.head import Head, engine_pairs

    path = str(path)
    ds = open_output(path, samples, s3_endpoint_url, device)
    m = ds.manifest
    last = m.num_model_layers - 1
    final = m.final_state == "post-norm"
    if last not in ds.layer_ids and not final:
        raise ValueError(f"--reference engine needs the model's last layer ({last}) or --final-state post-norm in "
                         f"the output; {path!r} holds layers {ds.layer_ids}")
    dtype = _dtype(m.dtype)
    shape = ModelShape(model)  # its config only: a wrong --model fails before the engine starts
    if shape.num_layers != m.num_model_layers or shape.hidden_size != m.hidden_size:
        raise ValueError(f"--model {model!r} has {shape.num_layers} layers of width {shape.hidden_size}; the output "
                         f"was written from one with {m.num_model_layers} of width {m.hidden_size} ({m.model!r})")
    args = engine_cli_args(m, engine_args or [])
    chosen = choose_samples(len(ds), samples, seed)
    tokens = {}
    for i in chosen:
        s = ds[i]
        tokens[s["id"]] = s["token_ids"].tolist()

    from vllm_hidden.engine.logprobs import prompt_logprobs  # the engine first: it takes the GPU's memory

    together, alone = prompt_logprobs(model, args, list(tokens.values()), top_k)
    eng, again = dict(zip(tokens, together)), dict(zip(tokens, alone))
    head = Head(model, device)
    columns = ([("last layer", ds.layer_ids.index(last))] if last in ds.layer_ids else []) \
        + ([("final state", None)] if final else [])
    per: dict[str, dict[Any, dict[str, float]]] = {name: {} for name, _ in columns}
    bar = _Bar(len(tokens), progress)
    positions = 0
    try:
        bar.stage("LM head")
        for i in chosen:
            s = ds[i]
            sid = s["id"]
            rows, cols, ref = engine_pairs(eng[sid])
            if not len(rows):  # a one-token sample: no position has a token before it
                bar.advance()
                continue
            positions += len(set(rows.tolist()))
            noise = _noise(again[sid], rows, cols, ref)
            for name, k in columns:
                x = s["final_hidden_states"] if k is None else s["hidden_states"][:, k]
                normed = k is None
                ours = head.logprobs(x, rows, cols, normed=normed)
                low = head.logprobs(x, rows, cols, normed=normed, dtype=dtype)
                d = {"mean_abs": (ours - ref).abs().mean().item(), "max_abs": (ours - ref).abs().max().item(),
                     "rounding": (ours - low).abs().mean().item(), "noise": noise, "top1": _top1(rows, ours, ref)}
                if m.storage is not None:
                    d["fp8"] = (ours - head.logprobs(fp8_regrid(x), rows, cols, normed=normed)).abs().mean().item()
                per[name][sid] = d
            bar.advance()
    finally:
        bar.close()
    if not positions:
        raise ValueError(f"the {len(tokens)} chosen samples have one token each: no position to compare")
    sources = [_source(name, per[name]) for name, _ in columns]
    return EngineCheckReport(path=path, model=model, device=device, engine_args=args, samples=list(tokens),
                             positions=positions, sources=sources,
                             verdict="pass" if all(s.ok for s in sources) else "fail")


def engine_cli_args(manifest: Any, given: list[str]) -> list[str]:
    """The engine arguments: the output's dtype and (online) quantization unless given."""
    from vllm_hidden.engine.caches import flag_values
    from vllm_hidden.engine.quant import quantization_arg

    args = list(given)
    if not flag_values(args, frozenset({"--dtype"})):
        args += ["--dtype", manifest.dtype]
    q = manifest.quantization or {}
    if q.get("source") == "online" and quantization_arg(args) is None:
        args += ["--quantization", q["method"]]
    return args


def _noise(alone: list[dict[int, float] | None], rows: torch.Tensor, cols: torch.Tensor, ref: torch.Tensor) -> float:
    """mean |batched - alone| over the (row, token) pairs both runs report (a token at the edge
    of the top k may be in one run's and not the other's)."""
    diffs = []
    for r, c, v in zip(rows.tolist(), cols.tolist(), ref.tolist()):
        d = alone[r + 1] or {}
        if c in d:
            diffs.append(abs(d[c] - v))
    return sum(diffs) / len(diffs) if diffs else 0.0


def _top1(rows: torch.Tensor, ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Share of rows whose highest logprob among the compared tokens is at the same token."""
    agree = total = 0
    for r in torch.unique(rows):
        sel = rows == r
        agree += int(torch.argmax(ours[sel]) == torch.argmax(ref[sel]))
        total += 1
    return agree / max(total, 1)


def _source(name: str, per: dict[Any, dict[str, float]]) -> Source:
    def bound_of(d: dict[str, float]) -> float:
        return RATIO * max(d["rounding"], d["noise"], FLOOR) + FP8_FACTOR * d.get("fp8", 0.0)

    worst = max(per, key=lambda sid: per[sid]["mean_abs"] / bound_of(per[sid]))
    w = per[worst]
    fp8s = [d["fp8"] for d in per.values() if "fp8" in d]
    return Source(name=name, mean_abs=w["mean_abs"], max_abs=max(d["max_abs"] for d in per.values()),
                  top1_agree=sum(d["top1"] for d in per.values()) / len(per), rounding=w["rounding"], noise=w["noise"],
                  fp8=max(fp8s) if fp8s else None, bound=bound_of(w), worst_sample=worst,
                  ok=all(d["mean_abs"] <= bound_of(d) for d in per.values()))
