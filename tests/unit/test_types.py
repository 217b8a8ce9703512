"""mypy over vllm_hidden/ with pyproject.toml's [tool.mypy] settings finds nothing."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_nothing(tmp_path, monkeypatch):
    from mypy import api

    monkeypatch.chdir(ROOT)  # pyproject.toml's settings; paths in the report relative to the repository
    out, err, code = api.run(["--cache-dir", str(tmp_path / "cache")])
    errors = [ln for ln in (out + err).splitlines() if ": error:" in ln]
    assert not errors, "\n".join(errors)
    assert code == 0 and "Success: no issues found" in out, out + err
