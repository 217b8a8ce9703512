"""Input files -> prompts: records (JSONL, a JSON array or Parquet), their kinds, chat templates and loss masks, and the
up-front pass over a file (scan)."""

from vllm_hidden.inputs.chat import MASK_RULES
from vllm_hidden.inputs.reader import KINDS, BadLine, Prompt, PromptReader
from vllm_hidden.inputs.scan import InputScan, scan_input
from vllm_hidden.inputs.sources import count_lines, count_records, input_format, parse_columns

__all__ = ["KINDS", "MASK_RULES", "BadLine", "InputScan", "Prompt", "PromptReader", "count_lines", "count_records",
           "input_format", "parse_columns", "scan_input"]
