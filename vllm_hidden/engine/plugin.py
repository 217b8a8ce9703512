"""`vllm.general_plugins` entry point. vLLM calls `register()` in every process it starts.

It puts the server's channel key and the name of its fetch-form directory in the environment
(strings; nothing is opened or made) for the processes vLLM starts, then installs the hooks
(`hooks.install`: every target checked first, then the class attributes replaced). They are
pass-throughs unless the engine's `additional_config` carries a `vllm_hidden` capture config
or its model was truncated by us, so installing the package does not change plain vLLM.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_hidden.capture.channel import ensure_dir_env, ensure_key
    from vllm_hidden.engine import hooks

    # vLLM registers plugins while parsing its arguments, before it starts the engine's
    # processes: a `vllm serve --middleware ...` server gets its channel key here.
    ensure_key()
    ensure_dir_env()
    hooks.install()
    _registered = True
