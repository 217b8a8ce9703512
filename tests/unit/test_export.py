"""`export` without an engine: what each layout's files hold (keys, dtypes, shapes, values),
the destination's life (export.json last, an interrupted export finished by a rerun, other
exports refused), the errors naming the flag or layers that fix them, and an S3 source.
Loading through the trainers' own code is in tests/integration/test_training_data.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from tests.outputs import random_sample, write_output
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.export import export_output, to_specforge, to_speculators
from vllm_hidden.export.run import DONE, PARTIAL

K, H, N = 3, 8, 8
LAYERS = [1, 4, 7]  # of 8: 7 is the last (speculators' final slot)


def samples(n=9, k=K):
    out = {}
    for i in range(n):
        t = 3 + (i * 5) % 11
        tok, hs, final = random_sample(i, t, k, H, final=True)
        spans = [[0, 1]] if i == 2 else [[1, t]]  # sample 2: one supervised token (no DFlash pair)
        out[f"s{i}"] = (tok, hs, final, spans)
    return out


def output(root, *, layers=LAYERS, final=True, mask=True, n=9, **manifest):
    data = samples(n, len(layers))
    rows = {sid: (tok, hs, fin if final else None, spans if mask else None)
            for sid, (tok, hs, fin, spans) in data.items()}
    write_output(root, layers, H, rows, rows=25, writer_threads=2, final_state=final, loss_mask=mask,
                 manifest={"final_state": "post-norm" if final else "none", "num_model_layers": N,
                           "input": {"loss_mask": "default" if mask else "none"}, **manifest})
    return HiddenStatesDataset(root)


def test_specforge_eagle3_files(tmp_path):
    ds = output(tmp_path / "out")
    rec = export_output(str(tmp_path / "out"), "specforge-eagle3", tmp_path / "e3", layers=[7, 1, 4])
    assert rec["layer_ids"] == [7, 1, 4] and rec["exported_samples"] == len(ds)
    files = sorted((tmp_path / "e3").rglob("*.ckpt"))
    assert [f.relative_to(tmp_path / "e3").as_posix() for f in files] == sorted(
        f"rows_0-2000/data_{i}.ckpt" for i in range(len(ds)))
    for i in range(len(ds)):
        s, d = ds[i], torch.load(to_specforge.sample_path(tmp_path / "e3", i), weights_only=True)
        t = s["token_ids"].shape[0]
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert d["input_ids"].dtype == d["loss_mask"].dtype == torch.int64
        assert torch.equal(d["input_ids"], s["token_ids"]) and torch.equal(d["loss_mask"], s["loss_mask"].long())
        assert d["hidden_state"].shape == (1, t, H) and torch.equal(d["hidden_state"][0], s["final_hidden_states"])
        aux = d["aux_hidden_state"]
        assert aux.shape == (1, t, 3 * H) and aux.dtype == torch.bfloat16
        for k, col in enumerate([2, 0, 1]):  # --layers 7,1,4: the output's columns in that order
            assert torch.equal(aux[0, :, k * H:(k + 1) * H], s["hidden_states"][:, col])
        # each file holds its own tensors, not the storage they were cut from
        assert to_specforge.sample_path(tmp_path / "e3", i).stat().st_size < 2 * 2 * (4 * H * t) + 4096
    done = json.loads((tmp_path / "e3" / DONE).read_text())
    assert done["settings"]["run_config"]["model.aux_hidden_state_layer_ids"] == [7, 1, 4]
    assert not (tmp_path / "e3" / PARTIAL).exists()
    # default: the output's three layers, low to high
    assert export_output(str(tmp_path / "out"), "specforge-eagle3", tmp_path / "e3b")["layer_ids"] == [1, 4, 7]


def test_specforge_dflash_files_leave_out_samples_it_cannot_train_on(tmp_path):
    ds = output(tmp_path / "out")
    rec = export_output(str(tmp_path / "out"), "specforge-dflash", tmp_path / "df", layers=[4, 1])
    assert rec["skipped"]["count"] == 1 and rec["skipped"]["ids"] == ["s2"]
    assert rec["exported_samples"] == len(ds) - 1
    assert rec["settings"]["draft_config"]["dflash_config.target_layer_ids"] == [4, 1]
    for i in range(len(ds)):
        s, p = ds[i], to_specforge.sample_path(tmp_path / "df", i)
        if s["id"] == "s2":
            assert not p.exists()
            continue
        d = torch.load(p, weights_only=True)
        assert set(d) == {"input_ids", "loss_mask", "hidden_states"}
        t = s["token_ids"].shape[0]
        assert torch.equal(d["hidden_states"], torch.cat([s["hidden_states"][:, 1], s["hidden_states"][:, 0]],
                                                         -1).unsqueeze(0))
        assert d["hidden_states"].shape == (1, t, 2 * H)


def test_speculators_export_json_and_token_freq(tmp_path):
    ds = output(tmp_path / "out")
    rec = export_output(str(tmp_path / "out"), "speculators", tmp_path / "sp")
    done = json.loads((tmp_path / "sp" / DONE).read_text())
    assert done["target_layer_ids"] == [2, 5] == rec["target_layer_ids"]  # vLLM aux ids of layers 1 and 4
    assert "--target-layer-ids 2 5" in done["settings"]["flags"]
    want = Counter()
    for i in range(len(ds)):
        s = ds[i]
        want.update(s["token_ids"][s["loss_mask"]].tolist())
        hs = load_file(str(tmp_path / "sp" / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["hidden_states"], s["hidden_states"]) and torch.equal(hs["token_ids"], s["token_ids"])
    assert torch.load(tmp_path / "sp" / to_speculators.TOKEN_FREQ, weights_only=True) == dict(want)


@pytest.mark.parametrize("kind, after", [("specforge-eagle3", 5), ("specforge-dflash", 5), ("speculators", 5),
                                         ("speculators", 20)])  # 20: every sample written, token_freq.pt not
def test_an_interrupted_export_is_finished_by_running_it_again(tmp_path, monkeypatch, kind, after):
    ds = output(tmp_path / "out", n=20)
    src = str(tmp_path / "out")
    whole = export_output(src, kind, tmp_path / "whole")
    mod = to_speculators if kind == "speculators" else to_specforge
    real, calls = mod.save_atomic, []

    def dies_after_five(obj, path, save):
        calls.append(path)
        if len(calls) > after:
            raise OSError(28, "No space left on device")
        real(obj, path, save)

    monkeypatch.setattr(mod, "save_atomic", dies_after_five)
    with pytest.raises(OSError, match="No space left"):
        export_output(src, kind, tmp_path / "dest")
    dest = tmp_path / "dest"
    assert not (dest / DONE).exists() and (dest / PARTIAL).exists()  # recognisably unfinished
    assert not list(dest.rglob(".*.part"))  # no half-written file under a sample's name or beside it
    monkeypatch.setattr(mod, "save_atomic", real)
    with pytest.raises(ValueError, match="unfinished export with kind"):
        export_output(src, "speculators" if kind != "speculators" else "specforge-eagle3", dest)
    again = export_output(src, kind, dest)
    # writes run in a pool: which of them finished before the failure is not fixed, only that some did
    assert again["resumed"] and (0 < again["written"] < len(ds) if after < len(ds) else again["written"] == 0)
    if kind == "speculators":
        freq = to_speculators.TOKEN_FREQ
        assert torch.load(dest / freq) == torch.load(tmp_path / "whole" / freq)
    for key in ("exported_samples", "exported_tokens", "layer_ids"):
        assert again[key] == whole[key]
    names = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file() and "hs_" in p.name
                   or p.suffix == ".ckpt")
    assert names == sorted(p.relative_to(tmp_path / "whole").as_posix() for p in (tmp_path / "whole").rglob("*")
                           if p.is_file() and "hs_" in p.name or p.suffix == ".ckpt")
    for n in names:
        a, b = dest / n, tmp_path / "whole" / n
        if n.endswith(".ckpt"):
            x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        else:
            assert load_file(str(a)).keys() == load_file(str(b)).keys()
    with pytest.raises(ValueError, match="already holds a finished export"):
        export_output(src, kind, dest)


@pytest.mark.parametrize("kind, flags, needle", [
    ("specforge-eagle3", {"final": False}, "extract again with --final-state post-norm"),
    ("specforge-eagle3", {"mask": False}, "--loss-mask none"),
    ("specforge-dflash", {"mask": False}, "--loss-mask none"),
    ("specforge-eagle3", {"layers": [1, 2, 4, 7]}, r"EAGLE-3 takes 3 layers and the output has \[1, 2, 4, 7\].*1,3,4"),
])
def test_what_a_layout_needs_is_named(tmp_path, kind, flags, needle):
    output(tmp_path / "out", **flags)
    with pytest.raises(ValueError, match=needle):
        export_output(str(tmp_path / "out"), kind, tmp_path / "d")
    assert not (tmp_path / "d").exists()  # checked before anything is written


def test_layer_errors_suggest_the_right_layers(tmp_path):
    output(tmp_path / "out")
    src = str(tmp_path / "out")
    with pytest.raises(ValueError, match="the last exported layer is 4: pass --layers 1,4,7"):
        export_output(src, "speculators", tmp_path / "a", layers=[1, 4])
    output(tmp_path / "nofinal", layers=[1, 3, 4])
    with pytest.raises(ValueError, match="the last exported layer is 4: extract with --layers 1,3,4,7"):
        export_output(str(tmp_path / "nofinal"), "speculators", tmp_path / "b")
    with pytest.raises(ValueError, match="layer id 5 is not in the output"):
        export_output(src, "specforge-dflash", tmp_path / "c", layers=[1, 5])
    with pytest.raises(ValueError, match="EAGLE-3 takes 3 layers, got --layers 1,4"):
        export_output(src, "specforge-eagle3", tmp_path / "d", layers=[1, 4])
    with pytest.raises(ValueError, match="--to must be one of"):
        export_output(src, "eagle", tmp_path / "e")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        export_output(src, "specforge-dflash", tmp_path / "full")


def test_export_from_s3(s3, tmp_path):
    url, bucket, client = s3
    ds = output(tmp_path / "out")
    for f in (tmp_path / "out").iterdir():
        client.upload_file(str(f), bucket, f"run/{f.name}")
    export_output(f"s3://{bucket}/run", "specforge-dflash", tmp_path / "df", s3_endpoint_url=url)
    export_output(str(tmp_path / "out"), "specforge-dflash", tmp_path / "local")
    for i in range(len(ds)):
        a, b = to_specforge.sample_path(tmp_path / "df", i), to_specforge.sample_path(tmp_path / "local", i)
        assert a.exists() == b.exists()
        if a.exists():
            assert torch.equal(torch.load(a)["hidden_states"], torch.load(b)["hidden_states"])
