"""vllm-hidden: extract hidden states of selected layers from vLLM at prefill speed."""

__version__ = "0.1.0"
