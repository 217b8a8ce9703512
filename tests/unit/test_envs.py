"""Environment variables: every one the package names is on docs/environment.md, every one of
ours the page lists exists, and renamed ones still work with a warning (vllm_hidden/envs.py)."""

import re
from pathlib import Path

import pytest

from vllm_hidden import envs

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "environment.md").read_text()
# a quoted environment variable name in the code: ours, vLLM's, Triton's, Inductor's, CUDA's
NAMED = re.compile(r"[\"']((?:VHIDDEN|VLLM|TRITON|TORCHINDUCTOR|CUDA)_[A-Z0-9_]*[A-Z0-9])[\"']")


def _named_in(paths) -> set[str]:
    return {m for p in paths for m in NAMED.findall(p.read_text())}


def test_every_variable_the_package_names_is_documented():
    named = _named_in((ROOT / "vllm_hidden").rglob("*.py"))
    assert "VHIDDEN_CACHE_DIR" in named and "VLLM_CPU_OMP_THREADS_BIND" in named  # the scan finds them
    missing = sorted(v for v in named if f"`{v}`" not in PAGE)
    assert not missing, f"docs/environment.md does not list {missing}"


def test_every_variable_of_ours_on_the_page_exists():
    code = _named_in([*(ROOT / "vllm_hidden").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
                      *(ROOT / "scripts").glob("*.py")])
    listed = set(re.findall(r"`(VHIDDEN_[A-Z0-9_]*[A-Z0-9])`", PAGE))
    ghosts = sorted(v for v in listed if v not in code and v not in envs.RENAMED.values())
    assert listed and not ghosts, f"docs/environment.md lists {ghosts}, which nothing reads"


def test_renamed_variables_keep_working_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(envs, "_warned", set())
    with caplog.at_level("WARNING", logger="vllm_hidden"):
        assert envs.get("VHIDDEN_MAX_HIDDEN_TOKENS", {"VHIDDEN_MAX_TOKENS": "5"}) == "5"
        assert envs.get("VHIDDEN_MAX_HIDDEN_TOKENS", {"VHIDDEN_MAX_TOKENS": "5"}) == "5"
    assert caplog.text.count("VHIDDEN_MAX_TOKENS is deprecated") == 1  # once per process
    assert "set VHIDDEN_MAX_HIDDEN_TOKENS instead" in caplog.text
    both = {"VHIDDEN_MAX_TOKENS": "5", "VHIDDEN_MAX_HIDDEN_TOKENS": "7"}
    assert envs.get("VHIDDEN_MAX_HIDDEN_TOKENS", both) == "7"  # the new name wins
    assert envs.get("VHIDDEN_MAX_HIDDEN_TOKENS", {"VHIDDEN_MAX_HIDDEN_TOKENS": ""}) is None  # empty is unset
    assert envs.get("VHIDDEN_CACHE_DIR", {}) is None
    for new, old in envs.RENAMED.items():  # each old name is on the page beside its new one
        assert re.search(rf"`{old}` \| `{new}`", PAGE), (old, new)


@pytest.mark.parametrize("old,new", sorted((old, new) for new, old in envs.RENAMED.items()))
def test_new_names_match_the_prefix(old, new):
    assert new.startswith("VHIDDEN_") and old != new


def test_our_variables_are_named_in_envs_only():
    """Each of ours is spelled once, in vllm_hidden/envs.py; every other module names it from there."""
    spelled = {str(p.relative_to(ROOT)): sorted(v for v in NAMED.findall(p.read_text()) if v.startswith("VHIDDEN_"))
               for p in (ROOT / "vllm_hidden").rglob("*.py") if p.name != "envs.py"}
    assert {p: v for p, v in spelled.items() if v} == {}
    assert envs.CACHE_DIR == "VHIDDEN_CACHE_DIR" and envs.PREFIX == "VHIDDEN_"
