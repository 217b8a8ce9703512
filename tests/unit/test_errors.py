"""The CLI's one error seam (cli._failures over errors.VllmHiddenError): what a user can fix is
one line and its exit code; a bug keeps its traceback; an exit asked for stays what it was."""

import pytest
import typer

from vllm_hidden.cache_archive import CacheArchiveError
from vllm_hidden.cli import _failures
from vllm_hidden.engine.compat import UnsupportedVllm
from vllm_hidden.errors import VllmHiddenError
from vllm_hidden.extract.coordinator import RankFailed
from vllm_hidden.extract.run import CaptureFailed, EngineDied


def _exit_of(exc: BaseException, *also) -> int:
    with pytest.raises(typer.Exit) as got, _failures(*also):
        raise exc
    return got.value.exit_code


@pytest.mark.parametrize("exc", [
    ValueError("--layers: 99 out of range"), ImportError("S3 needs boto3"), OSError(28, "No space left"),
    RankFailed("1 of 2 engines failed"), EngineDied("the vLLM engine process died"),
    CacheArchiveError("made for vLLM 0.26.0"), UnsupportedVllm("vllm-hidden supports vLLM 0.26 .. 0.33"),
    CaptureFailed({"message": "writing a shard failed", "storage": True}),
])
def test_what_a_user_can_fix_is_one_line_and_exit_2(exc, capsys):
    assert _exit_of(exc) == 2
    err = capsys.readouterr().err
    assert err == f"error: {exc}\n" and "Traceback" not in err


def test_the_packages_errors_share_one_base_and_keep_their_builtin_one():
    # code that catches the builtin error it always was still catches them
    assert issubclass(CaptureFailed, RuntimeError) and issubclass(EngineDied, RuntimeError)
    assert issubclass(RankFailed, RuntimeError) and issubclass(CacheArchiveError, ValueError)
    assert issubclass(UnsupportedVllm, ImportError)
    assert all(issubclass(c, VllmHiddenError) for c in (CaptureFailed, EngineDied, RankFailed, CacheArchiveError,
                                                         UnsupportedVllm))


def test_a_bug_keeps_its_traceback():
    bug = CaptureFailed({"message": "hidden-state capture failed: KeyError('x')", "storage": False})
    assert bug.exit_code is None
    with pytest.raises(CaptureFailed), _failures(RuntimeError):  # not even `also` swallows it
        raise bug
    with pytest.raises(KeyError), _failures():
        raise KeyError("x")
    with pytest.raises(RuntimeError), _failures():  # a RuntimeError is a bug unless the command says otherwise
        raise RuntimeError("boom")
    assert _exit_of(RuntimeError("the warmup server did not answer"), RuntimeError) == 2


def test_an_exit_asked_for_stays_as_it_was():
    with pytest.raises(typer.Exit) as got, _failures(RuntimeError):  # click's Exit is a RuntimeError
        raise typer.Exit(3)
    assert got.value.exit_code == 3
