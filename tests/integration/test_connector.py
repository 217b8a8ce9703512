"""Online training with speculators: `vllm-hidden serve` started with the arguments
speculators' scripts/launch_vllm.py gives `vllm serve` (vLLM's hidden-states connector, or
hs_connectors' FP8 one), fed by speculators' OWN code, unmodified (0.9.0, installed --no-deps):
its ArrowDataset generating every missing sample from the server, its offline generation, its
FP8 reader. Every value is checked against HF Transformers at the index the aux ids mean (aux
j = input of layer j = HF hidden_states[j]; aux N = the last layer's output before the norm).

One tiny hybrid (Gated DeltaNet) model, eager. Two server starts: the bf16 connector, killed
mid-run by the last test and restarted as the FP8 connector on the same port and storage path
(the client's retries reach the new server; its reader takes either file layout)."""

from __future__ import annotations

import argparse
import json
import re
import threading
import time

import pytest
import torch

from tests.integration.helpers import HFReference, Server, hang_up_storm, rel_l2
from tests.integration.helpers import token_prompt as prompt

NUM_LAYERS = 8
# scripts/launch_vllm.py's default: [2, N // 2, N - 3] and the last layer N appended
AUX = [2, NUM_LAYERS // 2, NUM_LAYERS - 3, NUM_LAYERS]
CUT_AUX = AUX[:-1]  # --no-include-last-layer: the model cut after layer 5
BOUND = 1e-2  # rel. L2 against HF float32 for bf16 states
FP8_BOUND = 6e-2  # e4m3 keeps 3 mantissa bits: ~2-3% rel. L2 seen on these states
ROW_BYTES = len(AUX) * 256 * 2 + 8  # a token in a bf16 file: its 4 layers of 256 and its id
BUDGET = 2 * (200 * ROW_BYTES + 4096) + 1000  # two 200-token files fit, a third does not
LENGTHS = [37, 300, 5, 128, 1, 190, 64, 250]  # 300: more than one chunk of the GDN kernels


def launch_args(storage, backend: str = "file", aux: list[int] = AUX) -> list[str]:
    """What speculators' scripts/launch_vllm.py passes `vllm serve` (its speculative config; the
    transfer config from hs_connectors' own backend, as the script takes it)."""
    from hs_connectors.transfer import HiddenStatesBackend

    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}}}
    kv = HiddenStatesBackend.registry[backend].build_kv_transfer_config(
        argparse.Namespace(hidden_states_path=str(storage)))
    return ["--speculative_config", json.dumps(spec), "--kv_transfer_config", json.dumps(kv)]


def start(model, root, name: str, backend: str, port: int | None = None, aux: list[int] = AUX) -> Server:
    return Server(model, root / f"{name}.log", "", *launch_args(root / "hs", backend, aux), "--max-model-len",
                  "1024", "--enforce-eager", "--max-unread-bytes", str(BUDGET), "--unread-ttl", "600", port=port)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Its one MoE layer is layer 1 (vLLM's Qwen3-Next will not build without one, so a cut
    keeps it), its top-k is every expert (no routing near-ties to confound the comparison)."""
    from vllm_hidden.demo import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "qwen3_next", "qwen3_next", NUM_LAYERS, moe_layer=1)


@pytest.fixture(scope="module")
def ref(model):
    return HFReference(model)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("connector")


@pytest.fixture(scope="module")
def server(model, root):
    s = start(model, root, "bf16", "file")
    yield s
    s.stop()


def our_files(root) -> list:
    return sorted(p.name for p in (root / "hs").iterdir())


def check_slots(ref: HFReference, row: dict, ids: list[int], bound: float = BOUND, aux: list[int] = AUX) -> None:
    """A sample as speculators' trainer reads it: hidden_states = the aux layers but the last,
    flattened; verifier_last_hidden_states = the last (aux N: before the final norm)."""
    assert row["input_ids"].tolist() == ids
    r = ref.model(torch.tensor([ids]), output_hidden_states=True)
    ref.states(ids)  # the hook: the last layer's output before the norm
    for k, j in enumerate(aux[:-1]):
        assert rel_l2(row["hidden_states"][:, k * 256:(k + 1) * 256], r.hidden_states[j][0]) <= bound, (j, ids[:4])
    last = ref._last[0] if aux[-1] == NUM_LAYERS else r.hidden_states[aux[-1]][0]
    assert rel_l2(row["verifier_last_hidden_states"], last) <= bound


def arrow_data(path, prompts: list[list[int]]):
    """A dataset as speculators' prepare-data writes it (input_ids, loss_mask, seq_len)."""
    import datasets

    table = datasets.Dataset.from_dict({"input_ids": prompts, "loss_mask": [[1] * len(p) for p in prompts],
                                        "seq_len": [len(p) for p in prompts]})
    table.set_format(type="torch")
    table.save_to_disk(str(path))
    return str(path)


@torch.no_grad()
def test_speculators_trains_online_from_the_server(server, ref, root):
    from hs_connectors.transfer import FileTransfer
    from speculators.train.data import ArrowDataset, CollateFn

    prompts = [prompt(100 + i, n) for i, n in enumerate(LENGTHS)]
    data = ArrowDataset(1024, arrow_data(root / "online", prompts), transfer=FileTransfer(root / "hs"),
                        vllm_endpoint=server.url + "/v1", on_missing="generate")
    rows = [data[i] for i in range(len(prompts))]
    for row, p in zip(rows, prompts):
        assert isinstance(row, dict), row  # not SampleUnavailable
        check_slots(ref, row, p)
    assert our_files(root) == []  # each file (and its lock) gone once read
    batch = CollateFn(1024, 256, num_target_layers=3)(rows[:3])
    assert batch["hidden_states"].shape == (1, 1024, 768)


def test_file_layout_lock_and_chat_as_speculators_sends_it(server, ref, root, model):
    """One file read raw: vLLM's connector layout (hidden_states [T, K, H] in the model's
    dtype, token_ids int64), the aux ids recorded, the `.lock` vLLM's own loader opens; then
    a chat request as speculators sends one (add_generation_prompt false)."""
    import openai
    from safetensors import safe_open
    from speculators.data_generation.vllm_client import generate_hidden_states
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    name = client.models.list().data[0].id
    p = prompt(7, 50)
    path, params = generate_hidden_states(client, name, {"input_ids": p})
    assert params == {"hidden_states_path": path} and path.startswith(str(root / "hs"))
    assert our_files(root) == sorted([path.rsplit("/", 1)[1], path.rsplit("/", 1)[1] + ".lock"])
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        hs, tok = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        assert sorted(f.keys()) == ["hidden_states", "token_ids"]
    assert json.loads(meta["aux_layer_ids"]) == AUX and hs.dtype == torch.bfloat16 and tok.dtype == torch.int64
    assert hs.shape == (50, len(AUX), 256) and tok.tolist() == p
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    assert torch.equal(load_hidden_states(path)["hidden_states"], hs)  # vLLM's own reader (flock on the .lock)
    cleanup_hidden_states(path)
    assert our_files(root) == []

    tok = AutoTokenizer.from_pretrained(str(model))
    messages = [{"role": "user", "content": "abc de fgh ij"}, {"role": "assistant", "content": "x y z"}]
    ids = list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
                                       return_dict=True)["input_ids"])
    path, _ = generate_hidden_states(client, name, {"input_ids": ids, "messages": messages})
    from hs_connectors.transfer import FileTransfer

    got = FileTransfer(root / "hs").get_generated({"hidden_states_path": path})
    FileTransfer(root / "hs").delete(path)
    states = ref.states(ids)
    assert got["token_ids"].tolist() == ids
    for k, j in enumerate(AUX):
        assert rel_l2(got["hidden_states"][:, k], states[j - 1]) <= BOUND, j
    assert our_files(root) == []

    # the buffers vLLM profiled at start are the ones the server's requests use: named in the start log,
    # laid out for the server (layers only) at load, not reallocated when the first request came
    text = server.log.read_text(errors="replace")
    assert re.search(rf"the capture path holds [0-9.]+ GiB of device memory \(the step buffer [0-9]+ tokens x "
                     rf"{len(AUX)} columns x 256 bfloat16 with per-row statistics [0-9.]+ GiB\), allocated at model "
                     "load inside vLLM's memory profile", text), text[-3000:]
    assert "row-sum scratch" not in text and "capture buffers were reallocated" not in text
    # and the forward writes the layers into it: no aux outputs in the model's graphs (engine.stash)
    assert "written into the step buffer by the forward" in text, text[-3000:]


def test_render_answers_speculators_prepare_data(server, model, root):
    """speculators' prepare-data builds its loss masks from vLLM's /v1/chat/completions/render,
    through its own client: the server answers it (vLLM's), the ids the model's chat template
    gives, and no file is written for it."""
    from speculators.data_generation.render_client import render_conversation
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "abc de fgh ij"}, {"role": "assistant", "content": "x y z"}]
    tok = AutoTokenizer.from_pretrained(str(model))
    for gen in (False, True):
        want = list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                            return_dict=True)["input_ids"])
        assert render_conversation(server.url, messages, add_generation_prompt=gen) == want
    assert our_files(root) == []


def test_clients_that_hang_up_leave_no_files(server, root):
    """24 clients hang up within 0.8 s, queued or running: none leaves a file, and the whole
    budget is free again (two 200-token files fit). (A hang-up while the file is written:
    tests/unit/test_server_forms.py.)"""
    import openai
    from hs_connectors.transfer import FileTransfer
    from speculators.data_generation.vllm_client import generate_hidden_states

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    name = client.models.list().data[0].id
    hang_up_storm(server, name, 24, seed=700)
    assert our_files(root) == []
    paths = [generate_hidden_states(client, name, {"input_ids": prompt(720 + i, 200)}, max_retries=0)[0]
             for i in range(2)]
    transfer = FileTransfer(root / "hs")
    for p in paths:  # as the trainer reads them (its read takes the lock away)
        transfer.get_generated({"hidden_states_path": p})
        transfer.delete(p)
    assert our_files(root) == []


def test_offline_generation_writes_what_offline_training_reads(server, ref, root):
    from speculators.cli.generate_offline_data import generate_offline_data
    from speculators.train.data import ArrowDataset

    prompts = [prompt(200 + i, n) for i, n in enumerate([20, 90, 3, 150, 61])]
    path = arrow_data(root / "offline", prompts)
    generate_offline_data(endpoint=server.url + "/v1", preprocessed_data=path, concurrency=4,
                          validate_outputs=True, fail_on_error=True)
    assert sorted(p.name for p in (root / "offline" / "hidden_states").iterdir()) == \
        [f"hs_{i}.safetensors" for i in range(len(prompts))]
    assert our_files(root) == []  # moved into the dataset, locks taken away
    data = ArrowDataset(1024, path, on_missing="raise")  # offline: never asks a server
    for i, p in enumerate(prompts):
        row = data[i]
        assert isinstance(row, dict), row
        check_slots(ref, row, p)


def test_unread_files_are_bounded_503_then_served_once_the_trainer_deletes(server, root):
    import openai
    import requests
    from hs_connectors.transfer import FileTransfer
    from speculators.data_generation.vllm_client import generate_hidden_states

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    name = client.models.list().data[0].id
    held = [generate_hidden_states(client, name, {"input_ids": prompt(300 + i, 200)}, max_retries=0)[0]
            for i in range(2)]
    body = {"model": name, "prompt": prompt(302, 200), "max_tokens": 1, "return_token_ids": True}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, r.text)
    assert "--max-unread-bytes" in r.json()["error"]["message"]
    assert len(our_files(root)) == 4  # nothing written for it
    with pytest.raises(openai.APIStatusError):  # speculators' client sees it as a failed attempt (it retries)
        generate_hidden_states(client, name, {"input_ids": prompt(302, 200)}, max_retries=0)
    transfer = FileTransfer(root / "hs")
    transfer.get_generated({"hidden_states_path": held[0]})  # the trainer reads one (taking its lock)...
    transfer.delete(held[0])  # ...and deletes it
    path, _ = generate_hidden_states(client, name, {"input_ids": prompt(302, 200)}, max_retries=0)
    for p in (path, held[1]):
        transfer.get_generated({"hidden_states_path": p})
        transfer.delete(p)
    assert our_files(root) == []
    # a plain request beside them: vLLM's own answer, its file the same way
    r = client.completions.create(model=name, prompt=prompt(303, 10), max_tokens=3, temperature=0)
    assert len(r.choices[0].text) > 0 and r.model_extra["kv_transfer_params"]["hidden_states_path"]
    transfer.delete(r.model_extra["kv_transfer_params"]["hidden_states_path"])
    # and the inline form on the same server
    r = client.completions.create(model=name, prompt=prompt(304, 12), max_tokens=1,
                                  extra_body={"hidden_states": {"layers": [1, 7]}})
    assert r.model_extra["hidden_states"]["layer_ids"] == [1, 7] and r.model_extra.get("kv_transfer_params") is None


@torch.no_grad()
def test_killed_server_restarted_as_fp8_the_client_retries_through(server, model, ref, root):
    """The bf16 server is killed (SIGKILL, every process) while speculators' dataset generates
    samples; a new server with hs_connectors' FP8 connector takes the same port and storage
    path. speculators' client retries with its own back-off; its FP8 reader dequantizes. Every
    sample is whole and right: bf16 ones within bf16 noise, FP8 ones within e4m3's error.
    (One start for three things: the new server is also launched without the last layer,
    `--no-include-last-layer` in the launch script, so its model is cut after layer 5 and its
    files hold aux 2, 4, 5: speculators reads aux 5 as the last slot.)"""
    from hs_connectors.transfer import FP8Transfer
    from safetensors import safe_open
    from speculators.train.data import ArrowDataset

    prompts = [prompt(400 + i, n) for i, n in enumerate([90, 40, 120, 33, 77, 150, 12, 60])]
    seen: list[str] = []
    aux_of: list[list[int]] = []

    class Watching(FP8Transfer):  # speculators' reader, watched: which layout each file had
        def get_generated(self, params):
            with safe_open(params["hidden_states_path"], "pt") as f:
                seen.append(str(f.get_slice("hidden_states").get_dtype()))
                aux_of.append(json.loads(f.metadata()["aux_layer_ids"]))
            return super().get_generated(params)

    data = ArrowDataset(1024, arrow_data(root / "restart", prompts), transfer=Watching(root / "hs"),
                        vllm_endpoint=server.url + "/v1", on_missing="generate", max_retries=6)
    rows: list = []
    errors: list = []

    def run():
        try:
            rows.extend(data[i] for i in range(len(prompts)))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    while len(seen) < 2 and t.is_alive():
        time.sleep(0.05)
    server.kill()
    killed_at = len(seen)
    restarted = start(model, root, "fp8", "fp8", port=server.port, aux=CUT_AUX)
    try:
        t.join(600)
        assert not t.is_alive() and not errors, errors
        assert 2 <= killed_at < len(prompts) and seen[:2] == ["BF16", "BF16"] and seen[-1] == "F8_E4M3", seen
        assert aux_of[0] == AUX and aux_of[-1] == CUT_AUX
        for row, p, dtype, aux in zip(rows, prompts, seen, aux_of):
            assert isinstance(row, dict), row
            check_slots(ref, row, p, BOUND if dtype == "BF16" else FP8_BOUND, aux)
        assert "runs its first 5 decoder layers only" in restarted.log.read_text()
        # at most the one file of the request in flight at the kill is left (no reader will
        # come for it: deleted after --unread-ttl); never a partial one
        left = our_files(root)
        assert len([n for n in left if n.endswith(".safetensors")]) <= 1 and not [n for n in left if "part" in n], left
    finally:
        restarted.stop()
