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
