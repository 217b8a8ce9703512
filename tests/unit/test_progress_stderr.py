"""Progress bars draw on stderr: `extract ... | jq` and `export ... | jq` get only the summary
on stdout."""

from vllm_hidden.export.run import samples
from vllm_hidden.extract.job import ProgressBar


def test_extract_progress_leaves_stdout_alone(capsys):
    bar = ProgressBar(4, enabled=True)
    bar.update(2, 100, 0)
    bar.update(4, 200, 0)
    bar.close()
    out, err = capsys.readouterr()
    assert out == "" and "extract" in err


def test_export_progress_leaves_stdout_alone(capsys):
    assert [i for i, _ in samples([{"x": 1}] * 3, True, "export")] == [0, 1, 2]
    out, err = capsys.readouterr()
    assert out == "" and "export" in err
