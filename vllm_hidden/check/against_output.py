"""`vllm-hidden check OUT --reference OTHER_OUT`: how far two outputs' states of the same
tokens are apart, per layer -- e.g. an FP8 target's against the bf16 target's, which is what
a drafter trained on one meets when it drafts for the other. A measurement, not a verdict on
its own: it fails only against --max-rel-l2, or when the two share no comparable sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hidden.check.compare import _json, rel_l2
from vllm_hidden.check.run import aligned, choose_samples, open_output

FINAL = "final"


@dataclass(kw_only=True)
class Gap:
    rel_l2: float  # worst over the samples
    rel_l2_mean: float
    worst_sample: Any

    def to_dict(self) -> dict[str, Any]:
        return {"rel_l2": _json(self.rel_l2), "rel_l2_mean": _json(self.rel_l2_mean), "worst_sample": self.worst_sample}


@dataclass(kw_only=True)
class OutputsReport:
    path: str
    reference: str
    samples: list[Any]
    skipped: list[Any]  # chosen samples the reference lacks or holds other tokens for
    columns: dict[Any, Gap]  # layer id (or "final") -> gap
    max_rel_l2: float | None
    quantization: tuple[Any, Any]  # (this output's, the reference's) manifest records

    @property
    def ok(self) -> bool:
        return self.max_rel_l2 is None or all(g.rel_l2 <= self.max_rel_l2 for g in self.columns.values())

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reference": self.reference, "samples": self.samples, "skipped": self.skipped,
                "quantization": list(self.quantization), "max_rel_l2": self.max_rel_l2,
                "layers": {str(k): g.to_dict() for k, g in self.columns.items()},
                "verdict": "pass" if self.ok else "fail"}

    def table(self) -> list[str]:
        rows = [["layer", "rel L2 worst", "mean", "worst sample"]] + [
            [str(k), f"{g.rel_l2:.2e}", f"{g.rel_l2_mean:.2e}", str(g.worst_sample)] for k, g in self.columns.items()]
        return aligned(rows) + [self.message()]

    def message(self) -> str:
        k = max(self.columns, key=lambda c: self.columns[c].rel_l2)
        where = f"{'the final state' if k == FINAL else f'layer {k}'} of sample {self.columns[k].worst_sample!r}"
        skipped = f" ({len(self.skipped)} chosen samples not comparable)" if self.skipped else ""
        if self.max_rel_l2 is None:
            head = f"measured: {len(self.samples)} samples against {self.reference}"
        elif self.ok:
            head = f"pass: {len(self.samples)} samples within rel L2 {self.max_rel_l2:g} of {self.reference}"
        else:
            head = f"fail: states farther than rel L2 {self.max_rel_l2:g} from {self.reference}"
        return f"{head}{skipped}; largest: {where}, rel L2 {self.columns[k].rel_l2:.3g}"


def check_against_output(path: str, reference: str, samples: int = 8, seed: int = 0,
                         max_rel_l2: float | None = None, s3_endpoint_url: str | None = None) -> OutputsReport:
    if max_rel_l2 is not None and not max_rel_l2 > 0:
        raise ValueError(f"--max-rel-l2 must be a positive number, got {max_rel_l2!r}")
    a, b = (open_output(str(p), samples, s3_endpoint_url) for p in (path, reference))
    shape = [(m.num_model_layers, m.hidden_size) for m in (a.manifest, b.manifest)]
    if shape[0] != shape[1]:
        raise ValueError(f"{str(path)!r} comes from a model of {shape[0][0]} layers of width {shape[0][1]}, "
                         f"{str(reference)!r} from one of {shape[1][0]} of width {shape[1][1]}: not the same model")
    cols: list[Any] = [i for i in a.layer_ids if i in b.layer_ids]
    if a.manifest.final_state == b.manifest.final_state == "post-norm":
        cols.append(FINAL)
    if not cols:
        raise ValueError(f"the outputs share no layer: {a.layer_ids} and {b.layer_ids}")
    at = {sid: i for i, sid in enumerate(b.sample_ids())}
    per: dict[Any, dict[Any, float]] = {c: {} for c in cols}
    compared, skipped = [], []
    for i in choose_samples(len(a), samples, seed):
        s = a[i]
        j = at.get(s["id"])
        t = b[j] if j is not None else None
        if t is None or not s["token_ids"].equal(t["token_ids"]):
            skipped.append(s["id"])
            continue
        compared.append(s["id"])
        for c in cols:
            if c == FINAL:
                per[c][s["id"]] = rel_l2(s["final_hidden_states"], t["final_hidden_states"])
            else:
                per[c][s["id"]] = rel_l2(s["hidden_states"][:, a.layer_ids.index(c)],
                                         t["hidden_states"][:, b.layer_ids.index(c)])
    if not compared:
        raise ValueError(f"none of the {len(skipped)} chosen samples of {str(path)!r} is in {str(reference)!r} with "
                         "the same token ids: nothing to compare")
    columns = {}
    for c, m in per.items():
        worst = max(m, key=lambda sid: m[sid])
        columns[c] = Gap(rel_l2=m[worst], rel_l2_mean=sum(m.values()) / len(m), worst_sample=worst)
    return OutputsReport(path=str(path), reference=str(reference), samples=compared, skipped=skipped,
                         columns=columns, max_rel_l2=max_rel_l2,
                         quantization=(a.manifest.quantization, b.manifest.quantization))
