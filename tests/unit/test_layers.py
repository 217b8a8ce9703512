import json

import pytest

from vllm_hidden.layers import dflash_default_layer_ids, resolve_layer_ids, to_aux_ids


def test_dflash_default_matches_dflash_for_64_layers():
    # DFlash spreads n ids over 1..N-3: for Qwen3.6-27B (64 layers), 5 draft layers
    assert dflash_default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert dflash_default_layer_ids(36, 1) == [18]
    assert resolve_layer_ids(64) == [1, 16, 31, 46, 61]


def test_explicit_layers_keep_their_order():
    assert resolve_layer_ids(8, layers="7,0,3") == [7, 0, 3]
    assert resolve_layer_ids(8, layers=[2, 5]) == [2, 5]


@pytest.mark.parametrize(
    "spec, needle",
    [("8", "layer id 8 out of range; the model has 8 layers"), ("-1", "layer id -1 out of range"),
     ("1,1", "duplicate layer id 1"), ("", "empty"), ("1,,2", "empty layer id"), ("a,b", "must be integers")],
)
def test_bad_layer_specs_name_the_value(spec, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_layer_ids(8, layers=spec)


def test_aux_ids_are_layer_ids_plus_one():
    # aux j = input of layer j = output of layer j-1
    assert resolve_layer_ids(8, aux_layers="1,4,8") == [0, 3, 7]
    assert resolve_layer_ids(8, aux_layers="8,1") == [7, 0]
    assert to_aux_ids([0, 3, 7]) == [1, 4, 8]
    with pytest.raises(ValueError, match="aux id 0 out of range.*embedding"):
        resolve_layer_ids(8, aux_layers="0,2")
    with pytest.raises(ValueError, match="aux id 9 out of range; the model has 8 layers"):
        resolve_layer_ids(8, aux_layers="9")


def test_drafter_configs(tmp_path):
    d = tmp_path / "dflash"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"dflash_config": {"target_layer_ids": [1, 3, 5]}}))
    assert resolve_layer_ids(8, layers_from=d) == [1, 3, 5]
    e = tmp_path / "eagle.json"
    e.write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}))
    assert resolve_layer_ids(8, layers_from=e) == [1, 3, 7]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"dflash_config": {"target_layer_ids": [1, 30]}}))
    with pytest.raises(ValueError, match="layer id 30 out of range; the model has 8 layers"):
        resolve_layer_ids(8, layers_from=bad)
    none = tmp_path / "none.json"
    none.write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        resolve_layer_ids(8, layers_from=none)
    with pytest.raises(ValueError, match="no such drafter config"):
        resolve_layer_ids(8, layers_from=tmp_path / "missing.json")


def test_only_one_source():
    with pytest.raises(ValueError, match="only one of"):
        resolve_layer_ids(8, layers="1", aux_layers="2")


def test_capture_config_orders():
    from vllm_hidden.config import CaptureConfig

    c = CaptureConfig(layer_ids=(7, 0, 3))
    assert c.aux_ids == (1, 4, 8)  # what the model is asked for, ascending
    assert c.emit_order == (2, 0, 1)  # layer 7 is the model's 3rd aux output
    with pytest.raises(ValueError, match="unique"):
        CaptureConfig(layer_ids=(1, 1))
