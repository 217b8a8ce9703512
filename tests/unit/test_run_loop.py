"""The extract driver's loop (`extract.run`) and its failure paths, through the whole job
(`extract.job.extract_file`: plan, output, feed, manifest) on a fake engine (tests/fake_engine.py:
vLLM's scheduler and model faked, our capture path real). The real engine's version of each
failure kind: tests/reliability (an engine killed: test_kill_resume.py; storage failing:
test_storage_faults.py; bad and rejected prompts: test_bad_inputs.py; NaN states:
test_not_finite.py)."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from tests.fake_engine import FINAL, FakeEngine, Faults, state
from vllm_hidden.config import ExtractConfig
from vllm_hidden.data import HiddenStatesDataset
from vllm_hidden.extract.job import extract_file, start_extractor
from vllm_hidden.extract.run import CaptureFailed, EngineDied
from vllm_hidden.storage.journal import JOURNAL

LAYERS = [3, 0, 2]
ENGINE_VOCAB = 600  # below the model's 1024: a token in between passes the reader, the engine refuses it


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen3", 4)


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 90) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out[f"p{i}"] = torch.randint(10, 500, (length,), generator=g).tolist()
    return out


def write(path, good: dict, extra=()) -> None:
    with open(path, "w") as f:
        for sid, ids in good.items():
            f.write(json.dumps({"id": sid, "token_ids": ids}) + "\n")
        for line in extra:
            f.write(line + "\n")


def extractor(model, tmp_path, faults: Faults | None = None, **kw):
    """The real Extractor (plan, engine arguments, identity), its engine the fake one."""
    cfg = ExtractConfig(model=str(model), input_path=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "out"),
                        layers=",".join(map(str, LAYERS)), max_model_len=256, dtype="float32", progress=False,
                        engine_args=["--enforce-eager"], **kw)
    ex = start_extractor(cfg, start=False)
    ex.engine = FakeEngine(ex.layer_ids, num_layers=ex.info.num_layers, hidden=ex.info.hidden_size, vocab=ENGINE_VOCAB,
                           max_num_batched_tokens=cfg.max_num_batched_tokens or 32, faults=faults)
    ex.engine_init_seconds, ex.start_report = 0.0, {}
    return ex


def expected(ids: list[int], layers: list[int]) -> torch.Tensor:
    return torch.tensor([[[state(t, p, layer)] for layer in layers] for p, t in enumerate(ids)])


def check_rows(out, good: dict, layers: list[int], final: bool = False) -> None:
    """Every sample once, each row the fake model's value for its token, position and layer."""
    ds = HiddenStatesDataset(out)
    assert ds.layer_ids == layers
    seen = {}
    for i in range(len(ds)):
        s = ds[i]
        seen[s["id"]] = s["token_ids"].tolist()
        hs = s["hidden_states"].float()
        want = expected(good[s["id"]], layers)
        assert torch.equal(hs, want.to(hs.dtype).expand_as(hs)), s["id"]
        if final:
            f = s["final_hidden_states"].float()
            assert torch.equal(f[:, 0], expected(good[s["id"]], [FINAL])[:, 0, 0].to(f.dtype)), s["id"]
    assert seen == good


def test_chunked_steps_become_exact_samples_with_errors_recorded(model, tmp_path):
    """Prompts longer than a step (32 tokens) and shorter ones, mixed in steps of 4 requests; a
    line the reader refuses and one the engine refuses. Every row lands at its place, the
    manifest counts them, the refused lines are error records."""
    good = prompts(40)
    good["long"] = list(range(10, 250))  # 8 steps of its own
    write(tmp_path / "in.jsonl", good, ['{"id": "oov", "token_ids": [1, 700]}', "{broken"])
    with extractor(model, tmp_path, max_num_batched_tokens=32, max_shard_bytes=300_000) as ex:
        summary = extract_file(ex, str(tmp_path / "in.jsonl"), str(tmp_path / "out"))
        assert ex.engine.steps > sum(map(len, good.values())) // 32  # it really took chunked steps
    out = tmp_path / "out"
    assert summary.samples == len(good) and summary.tokens == sum(map(len, good.values()))
    assert summary.errors == 2 and len(summary.shards) > 1
    errors = {json.loads(x)["id"]: json.loads(x)["reason"] for x in (out / "errors.jsonl").read_text().splitlines()}
    assert "rejected by the engine" in errors["oov"] and "Token id 700" in errors["oov"], errors
    man = json.loads((out / "manifest.json").read_text())
    assert man["num_samples"] == len(good) and man["num_errors"] == 2
    check_rows(out, good, LAYERS)


def test_one_engine_runs_several_outputs_and_the_final_state(model, tmp_path):
    """An engine reconfigured between runs: two outputs from one engine, the second with the
    final normed state riding as one more column of the same step transfer."""
    good = prompts(12, seed=1)
    write(tmp_path / "in.jsonl", good)
    with extractor(model, tmp_path, max_num_batched_tokens=16) as ex:
        extract_file(ex, str(tmp_path / "in.jsonl"), str(tmp_path / "a"))
        cfg = ExtractConfig(**{**ex.cfg.__dict__, "final_state": "post-norm"})
        from vllm_hidden.extract.plan import plan_extract

        ex.reconfigure(cfg, plan_extract(cfg))
        extract_file(ex, str(tmp_path / "in.jsonl"), str(tmp_path / "b"))
    check_rows(tmp_path / "a", good, LAYERS)
    check_rows(tmp_path / "b", good, LAYERS, final=True)


def test_an_engine_that_dies_mid_run_keeps_durable_shards_and_resume_finishes(model, tmp_path):
    good = prompts(60, seed=2)
    write(tmp_path / "in.jsonl", good)
    with extractor(model, tmp_path, Faults(die_at_step=60), max_shard_bytes=200_000) as ex, \
            pytest.raises(EngineDied, match="died mid-run.*--resume"):
        extract_file(ex, str(tmp_path / "in.jsonl"), str(tmp_path / "out"))
    out = tmp_path / "out"
    assert not (out / "manifest.json").exists()
    kept = (out / JOURNAL).read_text().splitlines()
    assert kept  # shards made durable before the death stay
    with extractor(model, tmp_path, max_shard_bytes=200_000, resume=True) as ex:
        summary = extract_file(ex, str(tmp_path / "in.jsonl"), str(out))
    assert summary.resumed > 0 and summary.resumed + summary.samples == len(good)
    assert (out / JOURNAL).read_text().splitlines()[: len(kept)] == kept
    check_rows(out, good, LAYERS)


def test_storage_failure_stops_the_run_naming_it_and_leaves_the_engine_usable(model, tmp_path, monkeypatch):
    """The writer's disk fills mid-run: the driver hears it from the worker's status RPC and
    stops with the OSError's message, aborting what is in flight; the same engine then runs
    the rest with --resume."""
    from vllm_hidden.storage import shards

    good = prompts(50, seed=3)
    write(tmp_path / "in.jsonl", good)
    real, calls = shards.commit_shard, []

    def full(*a, **kw):
        calls.append(1)
        if len(calls) == 3:  # the third shard's commit
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **kw)

    monkeypatch.setattr(shards, "commit_shard", full)
    with extractor(model, tmp_path, max_shard_bytes=100_000) as ex:
        with pytest.raises(CaptureFailed, match="No space left on device.*--resume") as e:
            extract_file(ex, str(tmp_path / "in.jsonl"), str(tmp_path / "out"))
        assert e.value.storage
        assert not ex.engine._running and not ex.engine._waiting  # its requests were aborted
        monkeypatch.setattr(shards, "commit_shard", real)
        summary = extract_file(ex, str(tmp_path / "in.jsonl"), str(tmp_path / "out"), resume=True)
    assert summary.resumed + summary.samples == len(good)
    check_rows(tmp_path / "out", good, LAYERS)


def test_rows_the_capture_cannot_place_fail_the_run_as_a_bug_not_as_storage(model, tmp_path):
    """A request whose first rows never come (as with a prefix-cache hit): the assembler stops
    the capture, the driver hears it from the status RPC and fails the run naming it."""
    good = prompts(30, seed=4, lo=20)
    write(tmp_path / "in.jsonl", good)
    with extractor(model, tmp_path, Faults(cached_prefix_request=6)) as ex, pytest.raises(CaptureFailed) as e:
        extract_file(ex, str(tmp_path / "in.jsonl"), str(tmp_path / "out"))
    assert not e.value.storage and "were prompt tokens skipped" in str(e.value), e.value
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_nan_states_become_error_records_and_the_rest_is_written(model, tmp_path):
    good = prompts(20, seed=5)
    good["p3"] = good["p3"][:5] + [777] + good["p3"][5:]
    good["p11"] = [777, *good["p11"]]
    write(tmp_path / "in.jsonl", good)
    with extractor(model, tmp_path, Faults(nan_token=777)) as ex:
        summary = extract_file(ex, str(tmp_path / "in.jsonl"), str(tmp_path / "out"))
    bad = {sid for sid, ids in good.items() if 777 in ids}
    assert bad >= {"p3", "p11"} and summary.samples == len(good) - len(bad) and summary.errors == len(bad)
    errors = {json.loads(x)["id"] for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()}
    assert errors == bad
    check_rows(tmp_path / "out", {k: v for k, v in good.items() if k not in bad}, LAYERS)


def test_generated_responses_keep_a_row_for_every_prompt_and_response_token(model, tmp_path):
    """--generate on the fake engine: it samples its model's greedy choice (next = 7 * last + 3)
    one token past --max-tokens, the driver cuts each response at a stop token or --max-tokens;
    each sample is its prompt and response, every row the fake model's value for its token and
    position (the last kept token's row too: it was run through the model)."""
    from vllm_hidden.config import GenerateConfig
    from vllm_hidden.extract.generate import stop_token_ids

    good = prompts(16, seed=6, hi=40)
    write(tmp_path / "in.jsonl", good)
    with extractor(model, tmp_path, generate=GenerateConfig(max_tokens=6, temperature=0.0)) as ex:
        summary = extract_file(ex, str(tmp_path / "in.jsonl"), str(tmp_path / "out"))
    stops = stop_token_ids(str(model), None)
    want = {}
    for sid, ids in good.items():
        toks = list(ids)
        while len(toks) - len(ids) < 6 and toks[-1] not in stops or len(toks) == len(ids):
            toks.append((toks[-1] * 7 + 3) % ENGINE_VOCAB)
        want[sid] = toks
    assert summary.samples == len(good)
    assert summary.generated_tokens == sum(len(w) - len(good[k]) for k, w in want.items())
    check_rows(tmp_path / "out", want, LAYERS)
