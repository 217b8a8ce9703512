"""The connector form's pieces without an engine: speculators' launch arguments read (and every
wrong one refused, naming the value, before anything starts), the storage path's budget,
expiry and restart adoption, the FP8 file layout read back by hs_connectors' own reader."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
import torch

from vllm_hidden.config import ConnectorConfig
from vllm_hidden.server.connector import ConnectorStore, file_pieces
from vllm_hidden.server.launch import connector_from_argv

AUX = [2, 4, 5, 8]


def args(aux=AUX, connector="ExampleHiddenStatesConnector", path="/tmp/hs", spec_flag="--speculative_config",
         kv_flag="--kv_transfer_config", method="extract_hidden_states", **extra) -> list[str]:
    spec = {"method": method, "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}}}
    kv = {"kv_connector": connector, "kv_role": "kv_producer",
          "kv_connector_extra_config": {**({"shared_storage_path": path} if path else {}), **extra}}
    return [spec_flag, json.dumps(spec), f"{kv_flag}={json.dumps(kv)}", "--port", "8000"]


@pytest.mark.parametrize("spec_flag", ["--speculative_config", "--speculative-config", "-sc"])
@pytest.mark.parametrize("kv_flag", ["--kv_transfer_config", "--kv-transfer-config"])
def test_both_spellings_are_taken_and_removed_from_vllms_arguments(spec_flag, kv_flag):
    cfg, rest = connector_from_argv(args(spec_flag=spec_flag, kv_flag=kv_flag), 8)
    assert rest == ["--port", "8000"]
    assert cfg == ConnectorConfig(connector="ExampleHiddenStatesConnector", storage_path="/tmp/hs",
                                  aux_layer_ids=(2, 4, 5, 8))
    assert not cfg.fp8 and ConnectorConfig.from_env(cfg.to_env()) == cfg


def test_fp8_connector_and_unsorted_ids():
    cfg, _ = connector_from_argv(args(aux=[5, 2, 8], connector="FP8HiddenStatesConnector",
                                      use_synchronization_lock=False), 8)
    assert cfg.fp8 and cfg.file_aux_ids == (2, 5, 8) and cfg.aux_layer_ids == (5, 2, 8) and not cfg.use_lock


def test_a_relative_storage_path_is_the_servers_cwd():
    cfg, _ = connector_from_argv(args(path="rel/hs"), 8)
    assert cfg.storage_path == os.path.join(os.getcwd(), "rel", "hs")


def test_other_speculative_methods_and_connectors_stay_vllms():
    argv = ["--speculative-config", json.dumps({"method": "eagle3", "model": "x"}),
            "--kv-transfer-config", json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})]
    assert connector_from_argv(argv, 8) == (None, argv)
    assert connector_from_argv(["--port", "1"], 8) == (None, ["--port", "1"])


@pytest.mark.parametrize("argv, said", [
    (args(aux=[2, 9]), "aux id 9 is out of range; the model has 8 layers"),
    (args(aux=[0, 2]), "aux id 0 is out of range"),
    (args(aux=[2, 2]), "repeated id"),
    (args(aux=[]), "must be a non-empty list, got []"),
    (args(connector="MooncakeHiddenStatesConnector"), "puts the states into a Mooncake store; shared_storage_path"),
    (args(connector="MooncakeHiddenStatesConnector", path=None, mooncake={"master": "x"}),
     "mooncake has unknown keys ['master']"),
    (args(connector="MooncakeHiddenStatesConnector", path=None, mooncake={"master_server_address": "nohost"}),
     "master_server_address must be HOST:PORT, got 'nohost'"),
    (args(connector="MooncakeHiddenStatesConnector", path=None, mooncake={"protocol": "udp"}),
     "protocol must be 'tcp' or 'rdma', got 'udp'"),
    (args(connector="MooncakeHiddenStatesConnector", path=None, mooncake={"global_segment_size": "4GB"}),
     "global_segment_size must be int, got '4GB'"),
    (args(connector="NixlConnector"), "got 'NixlConnector'"),
    (args(path=None), "shared_storage_path (where the files go) is missing, got None"),
    (args(allow_custom_save_path=True), "allow_custom_save_path is not supported"),
    (args()[:2], "needs --kv-transfer-config"),
    (["--kv-transfer-config", json.dumps({"kv_connector": "ExampleHiddenStatesConnector"})],
     "needs --speculative-config"),
    (["--speculative-config", "{not json"], "must be a JSON object, got '{not json'"),
])
def test_wrong_arguments_are_refused_naming_the_value(argv, said):
    with pytest.raises(ValueError) as e:
        connector_from_argv(argv, 8)
    assert said in str(e.value)


def test_mooncake_launch_arguments_as_hs_connectors_builds_them(monkeypatch):
    """speculators' launch script with `--hidden-states-backend mooncake`: the transfer config from
    hs_connectors' own backend, every store setting kept for the server's client."""
    import argparse

    from hs_connectors.transfer import MooncakeBackend

    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.0.0.7")
    kv = MooncakeBackend.build_kv_transfer_config(argparse.Namespace(
        mooncake_master="10.0.0.1:50051", mooncake_metadata_server="P2PHANDSHAKE", mooncake_protocol="rdma",
        mooncake_device="mlx5_0", mooncake_global_segment_gib=8.0, mooncake_local_buffer_gib=1.0,
        mooncake_writer_threads=3))
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": AUX}}}
    cfg, rest = connector_from_argv(["--speculative-config", json.dumps(spec), "--kv-transfer-config",
                                     json.dumps(kv), "--port", "1"], 8)
    assert rest == ["--port", "1"] and cfg.transport == "mooncake" and cfg.storage_path is None and not cfg.fp8
    assert cfg.mooncake == {"local_hostname": "10.0.0.7", "metadata_server": "P2PHANDSHAKE",
                            "master_server_address": "10.0.0.1:50051", "global_segment_size": 8 << 30,
                            "local_buffer_size": 1 << 30, "protocol": "rdma", "device_name": "mlx5_0",
                            "num_writer_threads": 3}
    assert ConnectorConfig.from_env(cfg.to_env()) == cfg
    # a config without the mooncake object gets hs_connectors' MooncakeStoreConfig defaults
    cfg, _ = connector_from_argv(args(connector="MooncakeHiddenStatesConnector", path=None), 8)
    assert cfg.mooncake["master_server_address"] == "127.0.0.1:50051" and cfg.mooncake["num_writer_threads"] == 4


@pytest.mark.parametrize("tokens", [1, 7, 50])
def test_mooncake_manifest_is_hs_connectors_packed_layout(tokens):
    """Our manifest against hs_connectors' own layout function and version, as its connector
    makes it (request_finished)."""
    from hs_connectors.mooncake_store import VERSION, packed_layout

    from vllm_hidden.server.mooncake import manifest

    spec, total = packed_layout({"hidden_states": ([tokens, 4, 5120], torch.bfloat16),
                                 "token_ids": ([tokens], torch.int64)})
    ours = manifest("vh-x", tokens, 4, 5120, torch.bfloat16)
    assert ours == {"handle": "vh-x", "version": VERSION, "tensors": json.loads(json.dumps(spec)),
                    "metadata": {"num_tokens": tokens, "total_aligned_bytes": total, "extract_mode": "prompt_only"}}


def test_cli_exits_2_before_the_engine_starts(tiny_models, tmp_path):
    from tests.integration.helpers import cli

    model = tiny_models("qwen3", 4)
    r = cli("serve", str(model), *args(aux=[2, 7], path=str(tmp_path / "hs")))
    assert r.returncode == 2 and "aux id 7 is out of range; the model has 4 layers" in r.stderr
    r = cli("serve", str(model), "--layers", "1", *args(aux=[2, 4], path=str(tmp_path / "hs")))
    assert r.returncode == 2 and "drop --layers" in r.stderr


def _pieces(cfg, t=3, k=4, h=8):
    rows = torch.randn(t, k, h).to(torch.bfloat16)
    return file_pieces(cfg, rows, None, list(range(t))), rows


def test_budget_sweep_expiry_and_adoption(tmp_path):
    cfg = ConnectorConfig(connector="ExampleHiddenStatesConnector", storage_path=str(tmp_path), aux_layer_ids=AUX)
    pieces, rows = _pieces(cfg)
    size = sum(len(memoryview(p).cast("B")) for p in pieces)
    store = ConnectorStore(cfg, 2 * size, ttl_s=600)

    async def put():
        assert store.reserve(size) is None
        return await store.put(pieces, size)

    a, _ = asyncio.run(put())
    b, _ = asyncio.run(put())
    from safetensors.torch import load_file

    assert torch.equal(load_file(a)["hidden_states"], rows) and os.path.exists(a + ".lock")
    why = store.reserve(size)
    assert "no room for" in why and "--max-unread-bytes" in why
    os.unlink(a)  # a client read it (its lock left behind)
    assert store.reserve(size) is None and not os.path.exists(a + ".lock")
    store.release(size)
    # a restarted server: b is adopted (held until read or expired), a dead writer's part deleted
    part = tmp_path / f".vh-{'x' * 32}.999999999.part"
    part.write_bytes(b"partial")
    later = ConnectorStore(cfg, 2 * size, ttl_s=600)
    later.adopt(time.time() + 1)
    assert later.held == size and not part.exists() and os.path.exists(b)
    later.ttl = 0
    later._own = {n: type(e)(e.size, 0.0) for n, e in later._own.items()}
    later.sweep()
    assert later.held == 0 and not os.path.exists(b) and os.listdir(tmp_path) == []


def test_fp8_file_is_what_hs_connectors_reads(tmp_path):
    from hs_connectors.transfer import FP8Transfer

    from vllm_hidden.format import quant

    cfg = ConnectorConfig(connector="FP8HiddenStatesConnector", storage_path=str(tmp_path), aux_layer_ids=AUX)
    x = torch.randn(5, 4, 64) * torch.tensor([1.0, 10.0, 0.1, 3.0])[None, :, None]
    x[2] = 0  # an all-zero token
    values = torch.empty(5, 4, 64, dtype=quant.FP8)
    scale, work = torch.empty(5, 4), torch.empty(5, 4)
    quant.quantize(x, values, scale, work, torch.empty(5, 1))
    assert torch.equal(scale, scale[:, :1].expand(5, 4))  # one scale per token, in every column
    assert torch.allclose(scale[:, 0], x.abs().amax(dim=(1, 2)) / 448)
    path = tmp_path / "f.safetensors"
    path.write_bytes(b"".join(bytes(memoryview(p).cast("B")) for p in file_pieces(cfg, values, scale, [1, 2, 3, 4, 5])))
    got = FP8Transfer(tmp_path, dequantize_dtype=torch.float32).get_generated({"hidden_states_path": str(path)})
    assert got["token_ids"].tolist() == [1, 2, 3, 4, 5] and got["hidden_states"].dtype == torch.float32
    assert torch.equal(got["hidden_states"][2], torch.zeros(4, 64))
    err = (got["hidden_states"] - x).norm() / x.norm()
    assert err < 0.05, err
