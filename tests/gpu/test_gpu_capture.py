"""GPU host only (skipped without CUDA): the capture hook on vLLM's GPU runners with
torch.compile + CUDA graphs (vLLM defaults) and with enforce_eager, checked against HF
Transformers on the same weights. The runner is vLLM's own choice: on vLLM 0.26 the dense
qwen3 runs on the V2 model runner, the hybrid qwen3_next on V1 (`EXPECTED_RUNNER`; the
manifest records which ran). Run: `pytest -q -s tests/gpu` on the GPU host."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BOUND = 1e-2
# what vLLM picks by itself, by version: 0.26 runs dense non-MoE models on V2, hybrids on V1
EXPECTED_RUNNER = {(0, 26): {"qwen3": "v2", "qwen3_next": "v1", "qwen3_5": "v1"}}


def expected_runner(arch: str) -> str | None:
    from vllm_hidden.engine.compat import version_tuple

    return EXPECTED_RUNNER.get(version_tuple(), {}).get(arch)


def manifest_runner(out) -> str:
    return json.loads((out / "manifest.json").read_text())["engine"]["model_runner"]
ENGINE = ["--gdn-prefill-backend", "triton", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "64"]


def _prompts(path, vocab=1024, seed=0):
    rng = random.Random(seed)
    good = {}
    with open(path, "w") as f:
        for i in range(24):
            n = int(min(1000, max(1, rng.lognormvariate(4.5, 1.0))))
            good[f"s{i}"] = [rng.randrange(vocab) for _ in range(n)]
        good["exact"] = [rng.randrange(vocab) for _ in range(1024)]
        for sid, ids in good.items():
            f.write(json.dumps({"id": sid, "token_ids": ids}) + "\n")
    return good


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3"])
def test_gpu_capture_matches_hf_graphs_and_eager(arch, tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    from vllm_hidden.config import ExtractConfig
    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.extract import run_extract

    model = tiny_models(arch)
    good = _prompts(tmp_path / "in.jsonl")
    outs, runners = {}, {}
    for mode, extra in (("graphs", []), ("eager", ["--enforce-eager"])):
        outs[mode] = tmp_path / mode
        s = run_extract(ExtractConfig(model=str(model), input_path=str(tmp_path / "in.jsonl"),
                                      output_dir=str(outs[mode]), layers="0,3,7", max_model_len=1024,
                                      max_num_batched_tokens=256, dtype="bfloat16",
                                      progress=False, engine_args=ENGINE + extra))
        assert s.samples == len(good) and s.errors == 0
        runners[mode] = manifest_runner(outs[mode])
        assert runners[mode] in ("v1", "v2") and runners[mode] == (expected_runner(arch) or runners[mode]), runners
        print(f"{arch} {mode} (model runner {runners[mode]}): {s.to_dict()}")
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
    last = {}
    hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    worst = {m: [0.0, 0.0, 0.0] for m in outs}
    ds = {m: HiddenStatesDataset(p) for m, p in outs.items()}
    by_id = {m: {d[i]["id"]: d[i] for i in range(len(d))} for m, d in ds.items()}
    for sid, ids in good.items():
        with torch.no_grad():
            r = hf(torch.tensor([ids], device="cuda"), output_hidden_states=True)
        refs = [r.hidden_states[1][0], r.hidden_states[4][0], last["h"][0]]
        for m in outs:
            smp = by_id[m][sid]
            assert smp["token_ids"].tolist() == ids
            for k, ref in enumerate(refs):
                got = smp["hidden_states"][:, k].cuda().float()
                err = ((got - ref).norm() / ref.norm()).item()
                worst[m][k] = max(worst[m][k], err)
                assert err <= BOUND, (arch, m, sid, k, err)
    print(f"{arch} worst rel L2 per layer [0, 3, 7]: {worst}")
    # the per-layer statistics, reduced on the device beside the gather: those of the rows written
    for m, out in outs.items():
        stats = json.loads((out / "manifest.json").read_text())["layer_stats"]
        rows = torch.cat([s["hidden_states"] for s in by_id[m].values()]).double()
        for k, lid in enumerate([0, 3, 7]):
            x, v = rows[:, k], stats[str(lid)]
            std = float(x.std(correction=0))
            assert v["rows"] == x.shape[0] and v["nonfinite_rows"] == 0, (arch, m, lid, v)
            assert v["mean"] == pytest.approx(float(x.mean()), rel=1e-5, abs=1e-6 * std), (arch, m, lid, v)
            assert v["std"] == pytest.approx(std, rel=1e-5), (arch, m, lid, v)
            assert v["absmax"] == float(x.abs().max()), (arch, m, lid, v)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu-parity-{arch}.json"), "w") as f:
            json.dump({"arch": arch, "worst_rel_l2": worst, "layers": [0, 3, 7], "model_runner": runners}, f)


def test_gpu_freed_prompt_blocks_reused_under_async_scheduling(tiny_models, tmp_path, monkeypatch):
    """A KV cache of a few dozen blocks and many short prompts, so that the step made while a
    full one runs takes the blocks that step's prompt-only requests freed at scheduling
    (engine.scheduler; async scheduling, vLLM's default on a GPU): every row still matches HF,
    and the run takes fewer steps than with the blocks held until each request finishes (vLLM's
    own behaviour, VHIDDEN_RELEASE=0: a full step, then one of the few requests the blocks left
    free allow, made while the full one runs)."""
    from transformers import AutoModelForCausalLM

    from vllm_hidden import envs
    from vllm_hidden.config import ExtractConfig
    from vllm_hidden.data import HiddenStatesDataset
    from vllm_hidden.extract import run_extract

    model = tiny_models("qwen3_next")
    rng = random.Random(1)
    good = {f"p{i}": [rng.randrange(1024) for _ in range(rng.randrange(8, 65))] for i in range(96)}
    with open(tmp_path / "in.jsonl", "w") as f:
        for sid, ids in good.items():
            f.write(json.dumps({"id": sid, "token_ids": ids}) + "\n")
    steps = {}
    for release in ("1", "0"):
        trace = tmp_path / f"steps-{release}.txt"
        monkeypatch.setenv(envs.STEP_TRACE, str(trace))
        monkeypatch.setenv(envs.RELEASE, release)
        s = run_extract(ExtractConfig(model=str(model), input_path=str(tmp_path / "in.jsonl"),
                                      output_dir=str(tmp_path / f"out-{release}"), layers="0,3,7", max_model_len=128,
                                      max_num_batched_tokens=2048, dtype="bfloat16", progress=False,
                                      engine_args=ENGINE + ["--enforce-eager", "--num-gpu-blocks-override", "48"]))
        assert s.samples == len(good) and s.errors == 0
        made = [line.split() for line in trace.read_text().splitlines()]  # time, tokens, requests, ...
        assert sum(int(m[1]) for m in made) == sum(map(len, good.values())), made
        steps[release] = [int(m[2]) for m in made]
    # seen on an H100, the steps after the first: [11, 11, 11, 11, 11, 11, 11, 10, 5, 4] against
    # [10, 1, 10, 1, ..., 10, 2, 4, 4] (18)
    print(f"requests per step with release: {steps['1']}; without: {steps['0']}")
    assert len(steps["1"]) < 0.75 * len(steps["0"]), steps
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
    last = {}
    hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    ds = HiddenStatesDataset(tmp_path / "out-1")
    worst = [0.0, 0.0, 0.0]
    for i in range(len(ds)):
        smp = ds[i]
        ids = good[smp["id"]]
        assert smp["token_ids"].tolist() == ids
        with torch.no_grad():
            r = hf(torch.tensor([ids], device="cuda"), output_hidden_states=True)
        for k, ref in enumerate([r.hidden_states[1][0], r.hidden_states[4][0], last["h"][0]]):
            got = smp["hidden_states"][:, k].cuda().float()
            worst[k] = max(worst[k], ((got - ref).norm() / ref.norm()).item())
    print(f"release: worst rel L2 per layer [0, 3, 7]: {worst}")
    assert max(worst) <= BOUND, worst
