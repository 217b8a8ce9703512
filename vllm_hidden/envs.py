"""Reading vllm-hidden's environment variables. Ours share the VHIDDEN_ prefix and, where one
stands for a flag, the flag's name (`--max-hidden-tokens`: VHIDDEN_MAX_HIDDEN_TOKENS).
docs/environment.md lists every variable the package reads or sets, ours and vLLM's
(tests/unit/test_envs.py keeps the page and the code in step). A renamed variable's old name
still works, with a warning naming the new one."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("vllm_hidden")

# Every variable of ours is named here, and only here (tests/unit/test_envs.py)
PREFIX = "VHIDDEN_"
CACHE_DIR = "VHIDDEN_CACHE_DIR"  # --cache-dir's default
LAYER_STATS = "VHIDDEN_LAYER_STATS"  # "0": shards without per-layer statistics
STEP_TRACE = "VHIDDEN_STEP_TRACE"  # a file: the scheduler appends each step's time, tokens and requests (benchmarks)
TAPER = "VHIDDEN_TAPER"  # "0": the end of an extract run is not tapered (benchmarks: what the taper costs)
RELEASE = "VHIDDEN_RELEASE"  # "0": prompt-only requests keep their KV blocks until they finish (benchmarks)
# set by the commands that start vLLM, for its processes
CAPTURE_LAYOUT = "VHIDDEN_CAPTURE_LAYOUT"  # the capture buffers' layout (config.CaptureLayout)
CONNECTOR = "VHIDDEN_CONNECTOR"  # the connector form's configuration (config.ConnectorConfig)
PLUGIN = "VHIDDEN_PLUGIN"  # "1": this process tree runs our plugin
CHANNEL_KEY = "VHIDDEN_CHANNEL_KEY"  # the result channel's shared key
FETCH_DIR = "VHIDDEN_FETCH_DIR"  # where the fetch form keeps unfetched states
# `serve`'s limits (config.ServeConfig), each its flag's name
SERVE_LIMITS = {"max_hidden_tokens": "VHIDDEN_MAX_HIDDEN_TOKENS", "max_request_bytes": "VHIDDEN_MAX_REQUEST_BYTES",
                "max_concurrent": "VHIDDEN_MAX_CONCURRENT", "timeout_s": "VHIDDEN_HIDDEN_STATES_TIMEOUT",
                "fetch_ttl_s": "VHIDDEN_FETCH_TTL", "max_unfetched_bytes": "VHIDDEN_MAX_UNFETCHED_BYTES",
                "max_unread_bytes": "VHIDDEN_MAX_UNREAD_BYTES", "unread_ttl_s": "VHIDDEN_UNREAD_TTL"}

# new name -> the old one it replaced
RENAMED = {
    "VHIDDEN_LAYER_STATS": "VLLM_HIDDEN_LAYER_STATS",
    "VHIDDEN_MAX_HIDDEN_TOKENS": "VHIDDEN_MAX_TOKENS",
    "VHIDDEN_HIDDEN_STATES_TIMEOUT": "VHIDDEN_TIMEOUT",
}
_warned: set[str] = set()


def get(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """`name`'s value in `env` (default: this process's environment), else its old name's (with a
    warning, once per process), else None. Empty counts as unset."""
    env = os.environ if env is None else env
    value = env.get(name)
    if value:
        return value
    old = RENAMED.get(name)
    if old and env.get(old):
        if old not in _warned:
            _warned.add(old)
            log.warning("vllm-hidden: %s is deprecated and will be removed; set %s instead", old, name)
        return env[old]
    return None
