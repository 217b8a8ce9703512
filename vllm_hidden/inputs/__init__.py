"""Input files -> prompts: records (JSONL or Parquet), their kinds, chat templates and loss masks."""

from vllm_hidden.inputs.chat import MASK_RULES
from vllm_hidden.inputs.reader import KINDS, BadLine, Prompt, PromptReader
from vllm_hidden.inputs.sources import count_lines, count_records, input_format, parse_columns

__all__ = ["KINDS", "MASK_RULES", "BadLine", "Prompt", "PromptReader", "count_lines", "count_records", "input_format",
           "parse_columns"]
