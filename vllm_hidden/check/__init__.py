"""`vllm-hidden check`: recompute stored layers with HF Transformers and compare (no vLLM here;
transformers is imported when a model is loaded)."""

from vllm_hidden.check.compare import FLOOR, FP8_FACTOR, RATIO, Column, Measure, Worst, bound, rel_l2, verdict
from vllm_hidden.check.run import CheckReport, check_output, choose_samples

__all__ = ["FLOOR", "FP8_FACTOR", "RATIO", "CheckReport", "Column", "Measure", "Worst", "bound", "check_output",
           "choose_samples", "rel_l2", "verdict"]
