"""Online training across machines: `vllm-hidden serve` started with the kv-transfer config
hs_connectors' own `MooncakeBackend.build_kv_transfer_config` gives (speculators' launch script,
`--hidden-states-backend mooncake`), a real `mooncake_master` on 127.0.0.1, and speculators' OWN
trainer path reading it (its ArrowDataset generating every missing sample, its
`MooncakeTransfer` reading each object from the manifest in the response and removing it).
Every value is checked against HF Transformers at the index the aux ids mean; every object is
gone afterwards; a full store answers 503 and serves again once the trainer has read.

Ports: the master's RPC and metrics ports, both on 127.0.0.1, free ones picked at start; the
clients (the server's and the trainer's) bind 127.0.0.1 with P2PHANDSHAKE metadata (no metadata
server), Mooncake choosing their transfer ports. One server start (tiny hybrid model, eager).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import HFReference, Server, hang_up_storm
from tests.integration.helpers import token_prompt as prompt
from tests.integration.test_connector import AUX, arrow_data, check_slots

ROW_BYTES = len(AUX) * 256 * 2 + 8  # a token in an object: its 4 layers of 256 bf16 and its id
BUDGET = 2 * (200 * ROW_BYTES + 4096) + 1000  # two 200-token objects fit, a third does not
SEGMENT_GIB = 1 / 16  # what each client contributes to the store


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """`mooncake_master` (from the mooncake-transfer-engine package) on free 127.0.0.1 ports."""
    from vllm_hidden.warmup import free_port

    rpc, metrics = free_port(), free_port()
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    exe = Path(sys.executable).parent / "mooncake_master"
    # -client_ttl 2: a client silent for 2 s (a killed server) is dropped with its segment (default 10 s)
    proc = subprocess.Popen([str(exe), f"-rpc_port={rpc}", "-rpc_address=127.0.0.1", f"-metrics_port={metrics}",
                             "-metrics_host=127.0.0.1", "-enable_metric_reporting=false", "-client_ttl=2"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    addr = f"127.0.0.1:{rpc}"
    deadline = time.time() + 30
    import socket

    while True:  # its RPC port open: ready
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)
    yield addr
    proc.terminate()
    proc.wait(timeout=30)


def backend_args(master: str) -> argparse.Namespace:
    return argparse.Namespace(mooncake_master=master, mooncake_metadata_server="P2PHANDSHAKE",
                              mooncake_protocol="tcp", mooncake_device="", mooncake_global_segment_gib=SEGMENT_GIB,
                              mooncake_local_buffer_gib=SEGMENT_GIB, mooncake_writer_threads=2)


@pytest.fixture(scope="module")
def launch(master, monkeypatch_module):
    """speculators' launch arguments for the Mooncake backend: the kv config from hs_connectors."""
    from hs_connectors.transfer import MooncakeBackend

    monkeypatch_module.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": AUX}}}
    kv = MooncakeBackend.build_kv_transfer_config(backend_args(master))
    assert kv["kv_connector"] == "MooncakeHiddenStatesConnector"
    return ["--speculative_config", json.dumps(spec), "--kv_transfer_config", json.dumps(kv)]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from vllm_hidden.demo import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "qwen3_next", "qwen3_next", 8, moe_layer=1)


@pytest.fixture(scope="module")
def ref(model):
    return HFReference(model)


@pytest.fixture(scope="module")
def server(model, launch, tmp_path_factory):
    root = tmp_path_factory.mktemp("mooncake-server")
    s = Server(model, root / "server.log", "", *launch, "--max-model-len", "1024", "--enforce-eager",
               "--max-unread-bytes", str(BUDGET), "--unread-ttl", "600")
    yield s
    s.stop()


class Recording:
    """speculators' MooncakeTransfer (the trainer's reader), noting each handle it was given."""

    def __init__(self, master: str) -> None:
        from hs_connectors.transfer import MooncakeBackend

        self.transfer = MooncakeBackend.from_train_args(backend_args(master), "")
        self.transfer.setup()
        self.handles: list[str] = []

    def get_generated(self, params):
        self.handles.append(params["handle"])
        return self.transfer.get_generated(params)

    def __getattr__(self, name):
        return getattr(self.transfer, name)

    def exists(self, key: str) -> bool:
        return self.transfer.store._require_store().is_exist(key) == 1


@pytest.fixture(scope="module")
def trainer(master, launch):
    t = Recording(master)
    yield t
    t.transfer.store._require_store().close()  # before the master goes


@torch.no_grad()
def test_speculators_trains_online_over_mooncake(server, ref, trainer, tmp_path):
    from speculators.train.data import ArrowDataset

    lengths = [37, 300, 5, 128, 1, 190]
    prompts = [prompt(500 + i, n) for i, n in enumerate(lengths)]
    data = ArrowDataset(1024, arrow_data(tmp_path / "online", prompts), transfer=trainer,
                        vllm_endpoint=server.url + "/v1", on_missing="generate")
    rows = [data[i] for i in range(len(prompts))]
    for row, p in zip(rows, prompts):
        assert isinstance(row, dict), row  # not SampleUnavailable
        check_slots(ref, row, p)
    assert len(trainer.handles) == len(prompts)
    assert not any(trainer.exists(h) for h in trainer.handles)  # each object removed once read


def test_manifest_is_hs_connectors_layout_and_the_store_bounded(server, ref, trainer):
    import openai
    import requests
    from speculators.data_generation.vllm_client import generate_hidden_states

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    name = client.models.list().data[0].id
    p = prompt(7, 50)
    handle, params = generate_hidden_states(client, name, {"input_ids": p})
    assert handle == params["handle"] and params["version"] == 1
    t = params["tensors"]
    assert t["hidden_states"] == {"shape": [50, len(AUX), 256], "dtype": "torch.bfloat16",
                                  "nbytes": 50 * len(AUX) * 256 * 2, "offset": 0}
    assert t["token_ids"]["shape"] == [50] and t["token_ids"]["dtype"] == "torch.int64"
    assert t["token_ids"]["offset"] % 64 == 0 and params["metadata"]["num_tokens"] == 50
    assert params["metadata"]["total_aligned_bytes"] % 64 == 0 and trainer.exists(handle)
    got = trainer.get_generated(params)
    assert got["token_ids"].tolist() == p and got["hidden_states"].dtype == torch.bfloat16
    states = ref.states(p)
    for k, j in enumerate(AUX):
        from tests.integration.helpers import rel_l2

        assert rel_l2(got["hidden_states"][:, k], states[j - 1]) <= 1e-2, j
    trainer.delete(handle)
    assert not trainer.exists(handle)

    # two 200-token objects fill this server's budget: a third is refused before the engine runs it
    held = [generate_hidden_states(client, name, {"input_ids": prompt(600 + i, 200)}, max_retries=0)[1]
            for i in range(2)]
    body = {"model": name, "prompt": prompt(602, 200), "max_tokens": 1, "return_token_ids": True}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, r.text)
    assert "--max-unread-bytes" in r.json()["error"]["message"]
    trainer.get_generated(held[0])  # the trainer reads one and removes it: room again
    trainer.delete(held[0]["handle"])
    _, params = generate_hidden_states(client, name, {"input_ids": prompt(602, 200)}, max_retries=0)
    for m in (params, held[1]):
        assert trainer.get_generated(m)["token_ids"].shape == (200,)
        trainer.delete(m["handle"])
    assert not any(trainer.exists(m["handle"]) for m in (params, *held))
    assert os.environ.get("MOONCAKE_LOCAL_HOSTNAME") == "127.0.0.1"


def test_clients_that_hang_up_hold_nothing(server, trainer):
    """24 clients hang up within 0.8 s, queued or running: nothing is put for them, so the whole
    budget is free again (two 200-token objects fit)."""
    import openai
    from speculators.data_generation.vllm_client import generate_hidden_states

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    name = client.models.list().data[0].id
    hang_up_storm(server, name, 24, seed=800)
    got = [generate_hidden_states(client, name, {"input_ids": prompt(820 + i, 200)}, max_retries=0)[1]
           for i in range(2)]
    for m in got:
        trainer.delete(m["handle"])


def test_a_killed_servers_unread_objects_go_with_it(server, trainer):
    """Last (it kills the module's server): two objects put and not read, then the server killed
    (SIGKILL, every process). They lived in its own segment, so the store drops them once the
    master has not heard from it for its client_ttl: nothing is left in the store for ever, and
    the store goes on serving its other clients (the trainer's)."""
    import openai
    from speculators.data_generation.vllm_client import generate_hidden_states

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    name = client.models.list().data[0].id
    held = [generate_hidden_states(client, name, {"input_ids": prompt(900 + i, 50)}, max_retries=0)[1]
            for i in range(2)]
    assert all(trainer.exists(m["handle"]) for m in held)
    server.kill()
    deadline = time.time() + 60
    while any(trainer.exists(m["handle"]) for m in held):
        assert time.time() < deadline, "a killed server's objects are still in the store 60 s later"
        time.sleep(0.5)
    assert trainer.transfer.store._require_store().is_exist("no-such-key") == 0  # the store still answers
