import json

import pytest

from vllm_hidden.layers import dflash_default_layer_ids, drafter_layers, layer_source, resolve_layer_ids, to_aux_ids


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


def _config(tmp_path, name, cfg):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


# One config of each kind, in the shape its project writes (the ids of each mean layers 1, 3, 5 of 8;
# the sources of each meaning are cited in docs/train-a-drafter.md):
KINDS = [
    # z-lab DFlash / SpecForge DFlash: target_layer_ids index HF hidden_states[id + 1]
    ("dflash", {"architectures": ["DFlashDraftModel"], "dflash_config": {"target_layer_ids": [1, 3, 5],
                                                                         "mask_token_id": 9}}, [1, 3, 5]),
    # SpecForge EAGLE-3 draft config: SGLang adds 1 and captures before that layer = output of layer id
    ("sglang-eagle3", {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}}, [1, 3, 5]),
    # a vLLM EAGLE-3 config: aux id j = input of layer j
    ("vllm-eagle3", {"architectures": ["Eagle3LlamaForCausalLM"], "eagle_aux_hidden_state_layer_ids": [2, 4, 6]},
     [1, 3, 5]),
    # speculators: vLLM aux ids without the final layer, which its data always holds last
    ("speculators-eagle3", {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [2, 4, 6],
                            "speculators_config": {"algorithm": "eagle3"}}, [1, 3, 5, 7]),
    ("speculators-dflash", {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 4, 6]},
     [1, 3, 5, 7]),
]


@pytest.mark.parametrize("kind, cfg, ids", KINDS, ids=[k[0] for k in KINDS])
def test_drafter_configs_are_read_as_their_project_means_them(tmp_path, kind, cfg, ids):
    p = _config(tmp_path, "config.json", cfg)
    d = drafter_layers(tmp_path, 8)  # a directory: its config.json
    assert (d.kind, d.layer_ids) == (kind, ids)
    assert resolve_layer_ids(8, layers_from=p) == ids
    src = layer_source(8, layers_from=p)
    assert src["option"] == "--layers-from" and src["kind"] == kind and src["path"] == str(p)
    assert kind in d.describe(p) and str(ids) in d.describe(p)


def test_the_same_key_means_two_things():
    """eagle_aux_hidden_state_layer_ids under eagle_config (SpecForge/SGLang) is one more than
    the same numbers at the top level (vLLM): the off-by-one every project has shipped."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as t:
        sg = _config(Path(t), "sg.json", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}})
        vl = _config(Path(t), "vl.json", {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]})
        assert resolve_layer_ids(8, layers_from=sg) == [2, 4, 6]
        assert resolve_layer_ids(8, layers_from=vl) == [1, 3, 5]


def test_drafter_config_errors(tmp_path):
    bad = _config(tmp_path, "bad.json", {"dflash_config": {"target_layer_ids": [1, 30]}})
    with pytest.raises(ValueError, match="layer id 30 out of range; the model has 8 layers"):
        resolve_layer_ids(8, layers_from=bad)
    aux0 = _config(tmp_path, "aux0.json", {"eagle_aux_hidden_state_layer_ids": [0, 3]})
    with pytest.raises(ValueError, match="aux id 0"):
        resolve_layer_ids(8, layers_from=aux0)
    for cfg in ({}, {"target_layer_ids": [1, 2]}, {"speculators_model_type": "eagle3"}):
        with pytest.raises(ValueError, match="cannot tell which layers.*--layers.*--aux-layers"):
            resolve_layer_ids(8, layers_from=_config(tmp_path, "none.json", cfg))
    with pytest.raises(ValueError, match="no such drafter config"):
        resolve_layer_ids(8, layers_from=tmp_path / "missing.json")


def test_layer_source_names_the_option():
    assert layer_source(8, layers="1,2") == {"option": "--layers"}
    assert layer_source(8, aux_layers="2,3") == {"option": "--aux-layers", "aux_ids": [2, 3]}
    assert layer_source(8)["option"] == "default"


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
