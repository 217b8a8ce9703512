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

  mean |ours - engine| <= RATIO * (max(rounding, FLOOR) + noise) + FP8_FACTOR * fp8

(the two add: ours differs from the engine's logprob of the same state by rounding, and that
state differs from the one the engine computed by the noise, so by the triangle inequality
their mean |differences| sum, where the larger alone fell short when both were of a size)

rounding: the same logprobs computed once in float32 and once at the engine's precision (the
normed state and the LM head's product rounded to the output dtype), mean |difference|;
noise: how far the engine's own logprobs move between two ways of computing the same rows.
Prefill noise: every checked sample in flight together against each sample alone, mean
|difference| (the engine is asked twice). An `extract --generate` output's response rows
(from the index's prompt length on) were computed in decode steps, one token per request per
step (other kernels: Gated-DeltaNet's recurrent one instead of its chunked one; FP8
activation scales of other batches), which batching prefills does not measure. For a sample
with response rows the engine also generates its response greedily from its prompt: decode
noise is mean |decode logprob - prefill logprob| at the response positions both computed from
the same tokens (up to the first token the generation does not repeat), and the sample's
noise is the mean of the prefill noise over its prompt rows and the decode noise over its
response rows (the prefill noise where no response position could be compared, as reported);
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
from vllm_hidden.engine.logprobs import Decoded, Logprobs

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
    noise: float  # the engine against itself, batched together vs each sample alone (+ decode vs prefill)
    fp8: float | None
    bound: float
    worst_sample: Any
    ok: bool
    # the worst sample's, where it has response rows (an `extract --generate` output)
    prefill_noise: float | None = None
    decode_noise: float | None = None  # None: no response position could be compared
    decode_positions: list[int] | None = None  # [response positions compared, response positions]

    def to_dict(self) -> dict[str, Any]:
        d = {"mean_abs": _json(self.mean_abs), "max_abs": _json(self.max_abs), "top1_agree": round(self.top1_agree, 4),
             "rounding": _json(self.rounding), "noise": _json(self.noise), "bound": _json(self.bound),
             "worst_sample": self.worst_sample,
             "ok": self.ok}
        if self.fp8 is not None:
            d["fp8"] = _json(self.fp8)
        if self.decode_positions is not None:
            d.update(prefill_noise=None if self.prefill_noise is None else _json(self.prefill_noise),
                     decode_positions=self.decode_positions,
                     decode_noise=None if self.decode_noise is None else _json(self.decode_noise))
        return d

    def decode_cell(self) -> str:
        if self.decode_positions is None:
            return "-"
        compared, of = self.decode_positions
        return f"{'none' if self.decode_noise is None else f'{self.decode_noise:.2e}'} ({compared}/{of})"


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
    # samples with response rows: {"positions": compared, "of": response positions, "fallback": [sample ids
    # none of whose response positions could be compared]}; None for a prompt-only output
    decode: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict[str, Any]:
        d = {"path": self.path, "model": self.model, "reference": "engine", "device": self.device,
             "engine_args": self.engine_args, "samples": self.samples, "positions": self.positions,
             "bound": {"ratio": RATIO, "floor": FLOOR, "fp8_factor": FP8_FACTOR},
             "sources": {s.name: s.to_dict() for s in self.sources}, "verdict": self.verdict}
        if self.decode is not None:
            d["decode"] = self.decode
        return d

    def table(self) -> list[str]:
        decode = any(s.decode_positions is not None for s in self.sources)
        head = ["stored", "mean |dlogprob|", "max", "top-1 agree", "rounding", "engine noise",
                *(["decode noise"] if decode else []), "fp8", "bound", "ok"]
        rows = [head] + [[s.name, f"{s.mean_abs:.2e}", f"{s.max_abs:.2e}", f"{s.top1_agree:.3f}",
                          f"{s.rounding:.2e}", f"{s.noise:.2e}", *([s.decode_cell()] if decode else []),
                          "-" if s.fp8 is None else f"{s.fp8:.2e}", f"{s.bound:.2e}",
                          "ok" if s.ok else "FAIL"] for s in self.sources]
        return aligned(rows) + [self.message()]

    def message(self) -> str:
        w = max(self.sources, key=lambda s: (not s.ok, s.mean_abs / s.bound))
        head = (f"pass: {len(self.samples)} samples' stored states give the engine's own logprobs" if self.ok
                else "fail: the stored states do not give the engine's logprobs")
        msg = (f"{head}; worst: the {w.name} of sample {w.worst_sample!r}, mean |dlogprob| {w.mean_abs:.3g} "
               f"vs bound {w.bound:.3g} over {self.positions} positions")
        if self.decode is not None:
            msg += (f"; decode vs prefill compared at {self.decode['positions']} of {self.decode['of']} response "
                    "positions")
            if self.decode["fallback"]:
                msg += (f"; none for samples {self.decode['fallback']!r} (the engine's greedy response begins "
                        "with another token): their bounds use the prefill noise alone")
        return msg


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
    decode: dict[Any, int] = {}  # sample id -> prompt length, for samples with compared response rows
    for i in chosen:
        s = ds[i]
        tokens[s["id"]] = s["token_ids"].tolist()
        p = s.get("num_prompt_tokens")
        if p is not None and len(tokens[s["id"]]) - 1 > p:  # a row is compared when a token follows it
            decode[s["id"]] = p

    # the engine first: it takes the GPU's memory
    if decode:
        from vllm_hidden.engine.logprobs import prompt_and_decode_logprobs

        together, alone, decoded = prompt_and_decode_logprobs(model, args, list(tokens.values()), top_k,
                                                               [decode.get(sid) for sid in tokens])
    else:
        from vllm_hidden.engine.logprobs import prompt_logprobs

        together, alone = prompt_logprobs(model, args, list(tokens.values()), top_k)
        decoded = [None] * len(tokens)
    eng, again, dec = dict(zip(tokens, together)), dict(zip(tokens, alone)), dict(zip(tokens, decoded))
    head = Head(model, device)
    columns = ([("last layer", ds.layer_ids.index(last))] if last in ds.layer_ids else []) \
        + ([("final state", None)] if final else [])
    # per column, per sample: its measures (floats; with generated rows also decode_positions, a list)
    per: dict[str, dict[Any, dict[str, Any]]] = {name: {} for name, _ in columns}
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
            noises = {"noise": _noise(again[sid], rows, cols, ref)}
            if sid in decode:
                noises = _with_decode(noises["noise"], dec[sid], eng[sid], tokens[sid], decode[sid])
            for name, k in columns:
                x = s["final_hidden_states"] if k is None else s["hidden_states"][:, k]
                normed = k is None
                ours = head.logprobs(x, rows, cols, normed=normed)
                low = head.logprobs(x, rows, cols, normed=normed, dtype=dtype)
                d = {"mean_abs": (ours - ref).abs().mean().item(), "max_abs": (ours - ref).abs().max().item(),
                     "rounding": (ours - low).abs().mean().item(), "top1": _top1(rows, ours, ref), **noises}
                if m.storage is not None:
                    d["fp8"] = (ours - head.logprobs(fp8_regrid(x), rows, cols, normed=normed)).abs().mean().item()
                per[name][sid] = d
            bar.advance()
    finally:
        bar.close()
    if not positions:
        raise ValueError(f"the {len(tokens)} chosen samples have one token each: no position to compare")
    sources = [_source(name, per[name]) for name, _ in columns]
    summary = None
    if decode:
        d = per[columns[0][0]]
        summary = {"positions": sum(d[sid]["decode_positions"][0] for sid in decode),
                   "of": sum(d[sid]["decode_positions"][1] for sid in decode),
                   "fallback": [sid for sid in decode if d[sid]["decode_noise"] is None]}
    return EngineCheckReport(path=path, model=model, device=device, engine_args=args, samples=list(tokens),
                             positions=positions, sources=sources,
                             verdict="pass" if all(s.ok for s in sources) else "fail", decode=summary)


def engine_cli_args(manifest: Any, given: list[str]) -> list[str]:
    """The engine arguments: the output's dtype and (online) quantization unless given."""
    from vllm_hidden.engine import flags
    from vllm_hidden.engine.quant import quantization_arg

    args = list(given)
    if not flags.values(args, ("--dtype",)):
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


def decode_noise(decoded: Decoded | None, prefill: Logprobs, tokens: list[int],
                 num_prompt: int) -> tuple[float | None, int]:
    """(mean |decode - prefill| over the (position, token) pairs both report, response positions
    compared; None where none was). The generated token j >= 1 is predicted from row num_prompt
    + j - 1, a row its decode step computed (j = 0 comes from the prompt's prefill: not one);
    the prefill's logprobs of that row are at position num_prompt + j. Both see the same
    tokens only while the generation repeats the stored response: a position is compared while
    every token generated before it is the stored one (so the first differing token's own
    position still is, and none after it)."""
    if decoded is None:
        return None, 0
    gen, lps = decoded
    p = num_prompt
    diffs: list[float] = []
    compared = 0
    for j in range(1, min(len(gen), len(lps), len(tokens) - p)):
        if gen[j - 1] != tokens[p + j - 1]:
            break  # the contexts differ from here on
        ref = prefill[p + j] or {}
        pairs = [abs(v - ref[c]) for c, v in lps[j].items() if c in ref]
        if pairs:
            diffs += pairs
            compared += 1
    return (sum(diffs) / len(diffs) if diffs else None), compared


def _with_decode(prefill_noise: float, decoded: Decoded | None, prefill: Logprobs, tokens: list[int],
                 num_prompt: int) -> dict[str, Any]:
    """A sample's noise with response rows: the prefill noise over its num_prompt prompt rows and
    the decode noise over its response rows (compared ones: num_prompt .. n - 2), each weighted by
    its rows, as the extract computed them; the prefill noise stands in where no response
    position could be compared."""
    dn, compared = decode_noise(decoded, prefill, tokens, num_prompt)
    response = len(tokens) - 1 - num_prompt
    blended = (num_prompt * prefill_noise + response * (prefill_noise if dn is None else dn)) / (num_prompt + response)
    return {"noise": blended, "prefill_noise": prefill_noise, "decode_noise": dn,
            "decode_positions": [compared, response]}


def _top1(rows: torch.Tensor, ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Share of rows whose highest logprob among the compared tokens is at the same token."""
    agree = total = 0
    for r in torch.unique(rows):
        sel = rows == r
        agree += int(torch.argmax(ours[sel]) == torch.argmax(ref[sel]))
        total += 1
    return agree / max(total, 1)


def _source(name: str, per: dict[Any, dict[str, Any]]) -> Source:
    def bound_of(d: dict[str, Any]) -> float:
        return RATIO * (max(d["rounding"], FLOOR) + d["noise"]) + FP8_FACTOR * d.get("fp8", 0.0)

    worst = max(per, key=lambda sid: per[sid]["mean_abs"] / bound_of(per[sid]))
    w = per[worst]
    fp8s = [d["fp8"] for d in per.values() if "fp8" in d]
    return Source(name=name, mean_abs=w["mean_abs"], max_abs=max(d["max_abs"] for d in per.values()),
                  top1_agree=sum(d["top1"] for d in per.values()) / len(per), rounding=w["rounding"], noise=w["noise"],
                  fp8=max(fp8s) if fp8s else None, bound=bound_of(w), worst_sample=worst,
                  ok=all(d["mean_abs"] <= bound_of(d) for d in per.values()), prefill_noise=w.get("prefill_noise"),
                  decode_noise=w.get("decode_noise"), decode_positions=w.get("decode_positions"))
