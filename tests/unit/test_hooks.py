"""The table of vLLM attributes we replace or set (engine.hooks), against the installed vLLM:
every target exists, a missing one fails before anything is replaced with the version and
its name, and installing twice wraps once."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import vllm

from vllm_hidden.engine import hooks

_ABSENT = object()


@pytest.fixture
def restored():
    """Every hooked class attribute as it was before the test (the hooks are process-wide)."""
    saved = []
    for h in hooks.HOOKS:
        if h.kind == "class" and hooks._applies(h):
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
        assert (h.wrap is not None) == (h.kind in ("class", "instance")), h.name


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
        if h.kind != "class" or not hooks._applies(h):
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
