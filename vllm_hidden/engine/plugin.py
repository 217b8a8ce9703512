"""`vllm.general_plugins` entry point. vLLM calls `register()` in every process it starts, in
every environment where vllm-hidden is installed: a user's plain `vllm serve` too.

`register()` acts only in a vLLM process that is ours (`is_ours`): one whose environment has
`VHIDDEN_PLUGIN=1` (set by `activate()`, which vllm-hidden's own commands call before they
start vLLM, and inherited by every process vLLM starts below them), or a `vllm serve` whose
own arguments name vllm_hidden (`--middleware vllm_hidden.server.HiddenStatesMiddleware`, an
`--additional-config` with a `vllm_hidden` entry). Anywhere else it returns at once: no
environment change, no directory sweep, no hook check, nothing replaced, so that a vLLM that
moved a hooked attribute still runs plain vLLM. `VLLM_PLUGINS` without `vllm_hidden` keeps
vLLM from calling it at all.

In a process of ours, `activate()` sets the marker for the processes it starts (and lets
vLLM's Ray executors copy our variables to their workers), puts the server's channel key and
the name of its fetch-form directory in the environment (strings; nothing is opened or made),
then installs the hooks (`hooks.install`: every target checked first, a missing one raises
`HookError`, then the class attributes replaced). They are pass-throughs unless the engine's
`additional_config` carries a `vllm_hidden` capture config or its model was truncated by us.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence

import vllm_hidden.envs as envs
from vllm_hidden.engine import flags

log = logging.getLogger("vllm_hidden")

PLUGIN_NAME = "vllm_hidden"  # the entry point's name (pyproject.toml), as VLLM_PLUGINS names it
# vLLM's Ray DP engine actors and its older Ray executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0)
# copy only variables with these prefixes (and vLLM's own) to their processes; RayExecutorV2,
# the default, copies the whole environment. vLLM hashes this variable into its compile-cache
# key, so it is set only where the arguments ask for Ray.
RAY_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
OUR_PREFIX = envs.PREFIX
_RAY_FLAGS = (("--distributed-executor-backend",), ("--data-parallel-backend", "-dpb"))

# An argument naming this package: a dotted path in it (`--middleware vllm_hidden.server...`,
# `--worker-extension-cls=vllm_hidden...`), our key in a JSON `--additional-config`, or vLLM's
# dotted form of that flag (`--additional-config.vllm_hidden.layer_ids ...`). A model path that
# merely contains the name (`/models/vllm_hidden_test`) does not count.
_NAMES_US = re.compile(r'(?:^|=)vllm_hidden\.|"vllm_hidden"|^--additional[-_]config\.vllm_hidden(?:$|[.=])')

_registered = False


def named_in(argv: Sequence[object]) -> bool:
    """Whether a process's arguments (without the program) name vllm_hidden (`_NAMES_US`)."""
    return any(isinstance(a, str) and _NAMES_US.search(a) for a in argv)


def is_ours(env: Mapping[str, str] | None = None, argv: Sequence[object] | None = None) -> bool:
    """Whether this vLLM process was started for vllm-hidden: the marker in `env` (default this
    process's), or `argv` (default this process's arguments) naming vllm_hidden."""
    env = os.environ if env is None else env
    if env.get(envs.PLUGIN) == "1":
        return True
    argv = list(getattr(sys, "argv", None) or [])[1:] if argv is None else argv
    return named_in(argv)


def uses_ray(argv: Sequence[object]) -> bool:
    """Whether vLLM arguments put the engine's workers or its data-parallel engines on Ray."""
    return any(flags.last(argv, names) == "ray" for names in _RAY_FLAGS)


def _carry_to_ray() -> None:
    prefixes = [p.strip() for p in os.environ.get(RAY_PREFIXES_ENV, "").split(",") if p.strip()]
    if OUR_PREFIX not in prefixes:
        os.environ[RAY_PREFIXES_ENV] = ",".join([*prefixes, OUR_PREFIX])


def register() -> None:
    """vLLM's call: `activate()` in a process of ours, nothing anywhere else."""
    if _registered or not is_ours():
        return
    # A `vllm serve ... --middleware` server gets here while vLLM parses its arguments, before
    # it starts its API server and engine processes: they inherit what activate() sets.
    activate()


def activate(engine_argv: Sequence[str] = ()) -> None:
    """Make this process and every process started from it ours, and install the hooks now.
    vllm-hidden's commands call it before they start vLLM (`engine_argv`: the engine's vLLM
    arguments where they are not this process's own): vLLM registers plugins once per process,
    and its call may have come (and passed, unmarked) before. Idempotent."""
    global _registered
    os.environ[envs.PLUGIN] = "1"
    if uses_ray([*(getattr(sys, "argv", None) or [])[1:], *engine_argv]):
        _carry_to_ray()
    if _registered:
        return
    from vllm_hidden.capture.server_env import ensure_dir_env, ensure_key
    from vllm_hidden.engine import hooks  # imports vLLM's worker and runner modules

    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        log.warning("vllm-hidden: VLLM_PLUGINS=%r leaves out %s: the processes vLLM starts will not install its "
                    "hooks, so capture cannot run in them", allowed, PLUGIN_NAME)
    ensure_key()
    ensure_dir_env()
    hooks.install()
    _registered = True
