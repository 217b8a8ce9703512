"""`vllm-hidden check`: recompute a few samples' stored states and compare them: with HF
Transformers (run), against a plain engine's prompt logprobs (against_engine), or against
another output (against_output); `run_check` picks by --reference. Transformers and vLLM are
imported only when a model is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_hidden.check.compare import FLOOR, FP8_FACTOR, RATIO, Column, Measure, Worst, bound, rel_l2, verdict
from vllm_hidden.check.run import CheckReport, check_output, choose_samples

if TYPE_CHECKING:
    from vllm_hidden.check.against_engine import EngineCheckReport
    from vllm_hidden.check.against_output import OutputsReport



def run_check(output: str, model: str | None, reference: str, *, samples: int, seed: int, device: str,
              max_rel_l2: float | None, engine_args: list[str], s3_endpoint_url: str | None,
              progress: bool, gdn_kernels: str | None = None) -> CheckReport | EngineCheckReport | OutputsReport:
    """`vllm-hidden check`: the options that go with `reference` (hf, engine, or another
    output's location), then that comparison's report."""
    if reference != "hf" and gdn_kernels is not None:
        raise ValueError(f"--gdn-kernels goes with --reference hf (HF runs no Gated-DeltaNet layer with --reference "
                         f"{reference}), got --gdn-kernels {gdn_kernels}")
    if reference in ("hf", "engine"):
        if not model:
            raise ValueError(f"--model is required with --reference {reference}")
        if max_rel_l2 is not None:
            raise ValueError("--max-rel-l2 goes with --reference OTHER_OUTPUT")
    if reference != "engine" and engine_args:
        raise ValueError(f"unknown options {' '.join(engine_args)!r} (engine options go with --reference engine)")
    if reference == "engine" and model:
        from vllm_hidden.check.against_engine import check_against_engine

        return check_against_engine(output, model, samples=samples, seed=seed, device=device,
                                    engine_args=list(engine_args), s3_endpoint_url=s3_endpoint_url, progress=progress)
    if reference == "hf" and model:
        return check_output(output, model, samples=samples, seed=seed, device=device,
                            s3_endpoint_url=s3_endpoint_url, progress=progress, gdn_kernels=gdn_kernels)
    from vllm_hidden.check.against_output import check_against_output

    return check_against_output(output, reference, samples=samples, seed=seed, max_rel_l2=max_rel_l2,
                                s3_endpoint_url=s3_endpoint_url)


__all__ = ["FLOOR", "FP8_FACTOR", "RATIO", "CheckReport", "Column", "Measure", "Worst", "bound", "check_output",
           "choose_samples", "rel_l2", "run_check", "verdict"]
