"""The extract job, above the engine: check and plan the run (plan), one engine over a
prompt file (job), or several fed from one shared queue (coordinator: local processes via
rank, or Ray actors via ray_ranks), prompts handed out by feed; one engine started and
reconfigured (extractor), the loop that steps it (run) and the responses of --generate
(generate). vLLM itself is reached only through `vllm_hidden.engine`; the output is
`vllm_hidden.storage`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_hidden.config import ExtractConfig
    from vllm_hidden.extract.job import Summary


def run_extract(cfg: ExtractConfig) -> Summary:
    """`vllm-hidden extract`: one engine in this process, or `--dp` engines (`--ray`: on a cluster)."""
    if cfg.dp > 1 or cfg.ray_address is not None:
        from vllm_hidden.extract.coordinator import run_parallel

        return run_parallel(cfg)
    from vllm_hidden.extract.job import run_one

    return run_one(cfg)
