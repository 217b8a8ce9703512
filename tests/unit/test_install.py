"""What a new install shows: `--version`, a LICENSE, and a missing or unsupported vLLM reported in
one line (exit 2) wherever it is first imported, not as a traceback."""

import sys
import types
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vllm_hidden import cli

ROOT = Path(__file__).resolve().parents[2]


def test_version_names_ours_and_the_installed_vllm():
    r = CliRunner().invoke(cli.app, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"vllm-hidden {version('vllm-hidden')} (")
    import vllm

    assert vllm.__version__.split("+")[0] in r.output


def test_license_file_is_the_one_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject and 'license-files = ["LICENSE"]' in pyproject


def _fresh_compat(monkeypatch, vllm_module):
    """Import engine.compat again with `vllm_module` as vLLM (None: not installed)."""
    monkeypatch.setitem(sys.modules, "vllm", vllm_module)
    monkeypatch.delitem(sys.modules, "vllm_hidden.engine.compat", raising=False)
    import importlib

    return importlib.import_module("vllm_hidden.engine.compat")


def test_a_missing_vllm_names_the_install_command(monkeypatch):
    with pytest.raises(ImportError, match=r"vLLM is not installed; .*pip install -e \"\.\[gpu\]\""):
        _fresh_compat(monkeypatch, None)


def test_an_unsupported_vllm_is_refused_on_import(monkeypatch):
    fake = types.ModuleType("vllm")
    fake.__version__ = "0.40.1"
    with pytest.raises(ImportError, match=r"supports vLLM 0\.26 \.\. 0\.33, found '0\.40\.1'") as e:
        _fresh_compat(monkeypatch, fake)
    assert type(e.value).__name__ == "UnsupportedVllm"


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'vllm.engine'", name="vllm.engine"),
                                   type("UnsupportedVllm", (ImportError,), {})("vllm-hidden supports vLLM ..")])
def test_the_console_script_reports_vllm_import_errors_in_one_line(monkeypatch, capsys, error):
    def app():
        raise error

    monkeypatch.setattr(cli, "app", app)
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_other_import_errors_are_not_hidden(monkeypatch):
    def app():
        raise ModuleNotFoundError("No module named 'boto3'", name="boto3")

    monkeypatch.setattr(cli, "app", app)
    with pytest.raises(ModuleNotFoundError, match="boto3"):
        cli.main()
