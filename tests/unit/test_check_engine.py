"""`check --reference engine` without an engine: the final norm and LM head built alone from
a checkpoint give HF's own logprobs, the engine's prompt logprobs land on the right rows, the
fp8 probe measures e4m3's error, the engine gets the output's dtype and quantization, and an
`extract --generate` output's response rows are held to the engine's decode-vs-prefill noise."""

from __future__ import annotations

import pytest
import torch

from vllm_hidden.capture.records import Rows
from vllm_hidden.check.against_engine import _noise, _source, decode_noise, engine_cli_args, fp8_regrid
from vllm_hidden.check.head import Head, engine_pairs
from vllm_hidden.check.reference import FINAL, Reference


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3"])
def test_the_head_alone_gives_hfs_logprobs(tiny_models, arch):
    """Qwen3-Next's norm scales by 1 + w, Qwen3's by w: the head uses the model's own module."""
    from transformers import AutoModelForCausalLM

    model = tiny_models(arch, 4)
    ids = list(range(3, 60, 2))
    ref = Reference(str(model))
    states = ref.run(ids, {3, FINAL})
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    head = Head(str(model))
    rows = torch.arange(len(ids)).repeat_interleave(3)
    cols = torch.tensor([5, 17, 101] * len(ids))
    for x, normed in ((states[3], False), (states[FINAL], True)):
        got = head.logprobs(x, rows, cols, normed=normed)
        assert torch.allclose(got, want[rows, cols], atol=1e-4), (got - want[rows, cols]).abs().max()
    # at the engine's precision the numbers move by bf16 rounding, not more
    low = head.logprobs(states[3], rows, cols, normed=False, dtype=torch.bfloat16)
    assert 0 < (low - want[rows, cols]).abs().mean() < 0.05


def test_engine_logprobs_belong_to_the_row_before():
    rows, cols, vals = engine_pairs([None, {4: -1.0, 9: -2.0}, {7: -0.5}])
    assert rows.tolist() == [0, 0, 1] and cols.tolist() == [4, 9, 7] and vals.tolist() == [-1.0, -2.0, -0.5]
    # the engine's noise: the same (position, token) pairs of the run alone; a token one run lacks is left out
    assert _noise([None, {4: -1.5, 9: -2.0}, {8: -0.1}], rows, cols, vals) == pytest.approx(0.25)


def test_the_fp8_probe_draws_e4m3s_error_afresh():
    x = torch.randn(64, 256)
    once = fp8_regrid(x)
    err = ((once - x).norm() / x.norm()).item()
    assert 0.01 < err < 0.05, err
    again = ((fp8_regrid(once) - once).norm() / once.norm()).item()  # values already on an e4m3 grid move too
    assert 0.5 * err < again < 2 * err, (err, again)


def test_the_engine_gets_the_outputs_dtype_and_online_quantization():
    class M:
        dtype = "bfloat16"
        quantization = {"method": "fp8", "source": "online"}

    assert engine_cli_args(M, []) == ["--dtype", "bfloat16", "--quantization", "fp8"]
    assert engine_cli_args(M, ["--dtype=float16", "-q", "fp8_per_tensor"]) == ["--dtype=float16", "-q",
                                                                                  "fp8_per_tensor"]
    M.quantization = {"method": "fp8", "source": "checkpoint"}  # the checkpoint says it itself
    assert engine_cli_args(M, ["--enforce-eager"]) == ["--enforce-eager", "--dtype", "bfloat16"]


def test_each_sample_must_meet_its_own_bound():
    ok = {"a": {"mean_abs": 0.003, "max_abs": 0.02, "rounding": 0.002, "noise": 0.0005, "top1": 1.0},
          "b": {"mean_abs": 0.009, "max_abs": 0.01, "rounding": 0.0001, "noise": 0.003, "top1": 0.5}}
    s = _source("last layer", ok)  # b: within 4 x (floor + engine noise), though 90 x its rounding
    assert s.ok and s.worst_sample == "b" and s.bound == pytest.approx(4 * (0.001 + 0.003)) and s.noise == 0.003
    assert s.top1_agree == 0.75 and s.max_abs == 0.02
    # rounding and noise of a size add up (triangle inequality), beyond 4 x either alone
    both = {"d": {"mean_abs": 0.012, "max_abs": 0.05, "rounding": 0.002, "noise": 0.002, "top1": 1.0}}
    assert _source("final state", both).ok
    both["d"]["mean_abs"] = 0.0161
    assert not _source("final state", both).ok
    bad = {**ok, "c": {"mean_abs": 0.5, "max_abs": 3.0, "rounding": 0.002, "noise": 0.001, "top1": 0.0}}
    s = _source("last layer", bad)
    assert not s.ok and s.worst_sample == "c"
    nan = {"d": {"mean_abs": float("nan"), "max_abs": float("nan"), "rounding": 0.002, "noise": 0.0, "top1": 0.0}}
    assert not _source("final state", nan).ok


def test_one_output_against_another(tmp_path):
    """--reference OTHER_OUTPUT: shared layers of the samples with the same id and tokens; others
    are skipped; outputs of different models are refused; --max-rel-l2 makes it a verdict."""
    from tests.outputs import random_sample, write_output
    from vllm_hidden.check.against_output import check_against_output

    a = {f"s{i}": random_sample(i, 6 + i, 2, 16) for i in range(4)}
    noise = torch.Generator().manual_seed(9)
    b = {}
    for sid, (tok, hs) in a.items():
        near = (hs.float() * (1 + 0.01 * torch.randn(hs.shape, generator=noise))).to(torch.bfloat16)
        b[sid] = (tok, near[:, [1, 0]].contiguous())  # b stores layers 5, 1
    b["s3"] = (a["s3"][0] + 1, b["s3"][1])  # other tokens: not comparable
    del b["s2"]  # missing
    write_output(tmp_path / "a", [1, 5], 16, a)
    write_output(tmp_path / "b", [5, 1], 16, b)
    r = check_against_output(tmp_path / "a", tmp_path / "b")
    assert r.ok and r.samples == ["s0", "s1"] and sorted(r.skipped) == ["s2", "s3"] and list(r.columns) == [1, 5]
    for k, lid in enumerate([1, 5]):  # column order follows each output's own layer ids
        want = max(((a[s][1][:, k].float() - b[s][1][:, 1 - k].float()).norm() / b[s][1][:, 1 - k].float().norm()
                    ).item() for s in ("s0", "s1"))
        assert abs(r.columns[lid].rel_l2 - want) < 1e-6 and 0.005 < want < 0.02
    assert not check_against_output(tmp_path / "a", tmp_path / "b", max_rel_l2=1e-3).ok
    assert check_against_output(tmp_path / "a", tmp_path / "b", max_rel_l2=0.05).ok
    write_output(tmp_path / "c", [1, 5], 16, a, manifest={"num_model_layers": 9})
    with pytest.raises(ValueError, match="8 layers of width 16, .* 9 of width 16: not the same model"):
        check_against_output(tmp_path / "a", tmp_path / "c")
    with pytest.raises(ValueError, match="--max-rel-l2 must be a positive number, got 0"):
        check_against_output(tmp_path / "a", tmp_path / "b", max_rel_l2=0)


def _top(logits: torch.Tensor, ids: list[int], k: int = 5) -> list:
    """Prompt logprobs as vLLM reports them, from full logits [T, vocab]: position t >= 1 holds
    the top k and the prompt's own token, as predicted from row t - 1."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = [None]
    for t in range(1, len(ids)):
        top = torch.topk(lp[t - 1], k).indices.tolist()
        out.append({tok: lp[t - 1, tok].item() for tok in {*top, ids[t]}})
    return out


def test_against_the_engine_fails_on_another_models_logprobs(tiny_models, tmp_path, monkeypatch):
    """The whole comparison with HF standing in for the engine: an output of model A's last layer
    passes against A's own logprobs and fails against model B's (the engine side itself runs in
    tests/integration/test_extract.py)."""
    from transformers import AutoModelForCausalLM

    from tests.outputs import write_output
    from vllm_hidden.check import against_engine
    from vllm_hidden.demo import make_tiny_model
    from vllm_hidden.engine import logprobs as engine_logprobs

    a = tiny_models("qwen3_next", 4)
    b = make_tiny_model(tmp_path / "b", arch="qwen3_next", num_layers=4, seed=1)
    prompts = {f"s{i}": [(7 * i + 3 * t) % 1000 + 1 for t in range(20 + 9 * i)] for i in range(3)}
    prompts["one"] = [5]  # no position to compare: passed over
    ref = Reference(str(a))
    samples = {sid: (torch.tensor(ids), ref.run(ids, {3})[3].to(torch.bfloat16)[:, None])
               for sid, ids in prompts.items()}
    write_output(tmp_path / "out", [3], ref.hidden_size, samples, manifest={"model": str(a), "num_model_layers": 4})

    def hf_logprobs(model):
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()

        def fake(model_arg, cli_args, token_lists, k):
            with torch.no_grad():
                runs = [_top(hf(torch.tensor([ids])).logits[0], ids, k) for ids in token_lists]
            return runs, runs

        return fake

    def no_decode(*a, **kw):
        raise AssertionError("a prompt-only output has no response to generate")

    monkeypatch.setattr(engine_logprobs, "prompt_logprobs", hf_logprobs(a))
    monkeypatch.setattr(engine_logprobs, "prompt_and_decode_logprobs", no_decode)
    r = against_engine.check_against_engine(str(tmp_path / "out"), str(a), samples=10, top_k=5)
    (s,) = r.sources
    assert r.ok and s.name == "last layer" and r.positions == sum(len(p) - 1 for p in prompts.values()), r.table()
    assert s.mean_abs < s.bound / 2 and s.top1_agree > 0.9, r.table()
    # nothing of decode in a prompt-only output's report
    d = r.to_dict()
    assert "decode" not in d and not any(k.startswith(("decode", "prefill")) for k in d["sources"]["last layer"])
    assert "decode" not in " ".join(r.table()), r.table()
    monkeypatch.setattr(engine_logprobs, "prompt_logprobs", hf_logprobs(b))
    r = against_engine.check_against_engine(str(tmp_path / "out"), str(a), samples=10, top_k=5)
    assert not r.ok and r.sources[0].mean_abs > 50 * r.sources[0].bound, r.table()
    assert r.message().startswith("fail: the stored states do not give the engine's logprobs; worst: the last layer")


def test_against_the_engine_refuses_bad_input_before_any_engine(tiny_models, tmp_path, monkeypatch):
    from tests.outputs import random_sample, write_output
    from vllm_hidden.check import against_engine
    from vllm_hidden.engine import logprobs as engine_logprobs

    def no_engine(*a, **kw):
        raise AssertionError("the engine must not start")

    monkeypatch.setattr(engine_logprobs, "prompt_logprobs", no_engine)
    model = tiny_models("qwen3_next", 4)
    write_output(tmp_path / "mid", [1], 256, {"a": random_sample(0, 5, 1, 256)}, manifest={"num_model_layers": 4})
    with pytest.raises(ValueError, match=r"needs the model's last layer \(3\) or --final-state post-norm.*\[1\]"):
        against_engine.check_against_engine(str(tmp_path / "mid"), str(model))
    write_output(tmp_path / "wide", [3], 64, {"a": random_sample(0, 5, 1, 64)}, manifest={"num_model_layers": 4})
    with pytest.raises(ValueError, match="has 4 layers of width 256; the output was written from one with 4 of "
                                         "width 64"):
        against_engine.check_against_engine(str(tmp_path / "wide"), str(model))


@pytest.mark.parametrize("argv, says", [
    (["--reference", "engine"], "--model is required with --reference engine"),
    (["--model", "m"], None),  # --reference hf by default: it too needs --model, which is given
    (["--model", "m", "--max-rel-l2", "0.1"], "--max-rel-l2 goes with --reference OTHER_OUTPUT"),
    (["--model", "m", "--reference", "engine", "--max-rel-l2", "0.1"], "--max-rel-l2 goes with --reference OTHER"),
    (["--model", "m", "--enforce-eager"], "unknown options '--enforce-eager' (engine options go with --reference"),
    (["--reference", "other-out", "--enforce-eager"], "unknown options '--enforce-eager'"),
])
def test_check_refuses_options_that_do_not_go_with_its_reference(tmp_path, argv, says):
    from typer.testing import CliRunner

    from vllm_hidden.cli import app

    r = CliRunner().invoke(app, ["check", str(tmp_path / "no-output"), *argv])
    assert r.exit_code == 2, r.output
    # past the option rules, the missing output is what is named
    assert (says or "not an extract output") in r.output, r.output


# -- an `extract --generate` output: response rows computed in decode steps ----------------------

def test_decode_noise_stops_where_the_generation_leaves_the_stored_response():
    """Generated token j is predicted from row p + j - 1 (j = 0: the prompt's prefill, not a
    decode row); the prefill's logprobs of that row are at position p + j. Once the engine has
    generated another token than the stored one, what follows has another context."""
    p, tokens = 2, [1, 2, 10, 11, 12, 13, 14]  # response 10 .. 14: rows 2 .. 5 compared (a token follows each)
    prefill = [None, {2: -1.0}] + [{t: -1.0, 99: -3.0} for t in tokens[2:]]
    lps = [{10: -9.0}, {11: -1.1, 99: -3.1}, {12: -1.2}, {13: -1.3, 77: -0.1}, {14: -5.0}]
    same = (tokens[2:], lps)
    got, n = decode_noise(same, prefill, tokens, p)
    assert n == 4 and got == pytest.approx((0.1 + 0.1 + 0.2 + 0.3 + 4.0) / 5)  # j = 0's -9.0 is not a decode row
    # the engine generated 20 where 11 is stored: j = 1 still saw the stored tokens, j >= 2 did not
    diverged = ([10, 20, 12, 13, 14], lps)
    got, n = decode_noise(diverged, prefill, tokens, p)
    assert n == 1 and got == pytest.approx((0.1 + 0.1) / 2)
    # another first token: no position to compare
    assert decode_noise(([30, 11, 12, 13, 14], lps), prefill, tokens, p) == (None, 0)
    assert decode_noise(None, prefill, tokens, p) == (None, 0)


def test_the_engine_generates_each_response_greedily_with_raw_logprobs(monkeypatch):
    """prompt_and_decode_logprobs, a stand-in engine recording what it is asked: prefills as
    prompt_logprobs asks them, then one greedy request per sample with a response (its prompt,
    as many tokens as its response, EOS ignored, top-k logprobs), all in flight together; each
    generated token's logprobs and the tokens come back per sample."""
    from types import SimpleNamespace

    from vllm.logprobs import Logprob

    from vllm_hidden.engine import args as engine_args_mod
    from vllm_hidden.engine import compat
    from vllm_hidden.engine import logprobs as engine_logprobs

    made = []

    class Engine:
        def __init__(self, args):
            self.args, self.pending, self.steps, self.stopped = args, [], [], False
            made.append(self)

        def add_request(self, rid, prompt, sp):
            self.pending.append((rid, prompt["prompt_token_ids"], sp))

        def has_unfinished_requests(self):
            return bool(self.pending)

        def step(self):
            batch, self.pending = self.pending, []
            self.steps.append(batch)
            outs = []
            for rid, ids, sp in batch:
                if sp.prompt_logprobs is not None:
                    outs.append(SimpleNamespace(request_id=rid, finished=True, prompt_logprobs=[None] + [
                        {t: Logprob(-0.5 * t)} for t in ids[1:]]))
                else:
                    gen = [100 + j for j in range(sp.max_tokens)]
                    outs.append(SimpleNamespace(request_id=rid, finished=True, outputs=[SimpleNamespace(
                        token_ids=gen, logprobs=[{t: Logprob(-0.25), 7: Logprob(-2.0)} for t in gen])]))
            return outs

    monkeypatch.setattr(engine_args_mod, "engine_args",
                        lambda model, cli, n: SimpleNamespace(max_logprobs=20, logprobs_mode="raw_logprobs", n=n))
    monkeypatch.setattr(compat, "start_engine", Engine)
    monkeypatch.setattr(compat, "shutdown_engine", lambda e: setattr(e, "stopped", True))
    monkeypatch.setattr(compat, "spawn_on_cuda", lambda: None)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    together, alone, decoded = engine_logprobs.prompt_and_decode_logprobs("m", [], prompts, 5, [2, None, 4])
    (e,) = made
    assert e.stopped and e.args.logprobs_mode == "raw_logprobs" and e.args.max_logprobs == 20 and e.args.n == 5
    assert together[1] == [None, {7: -3.5}, {8: -4.0}] and together == alone
    assert decoded[1] is None and decoded[2] is None  # no prompt length; a prompt length of the whole sequence
    assert decoded[0] == ([100, 101, 102], [{100: -0.25, 7: -2.0}, {101: -0.25, 7: -2.0}, {102: -0.25, 7: -2.0}])
    (last,) = [b for b in e.steps if any(rid.startswith("decode") for rid, _, _ in b)]
    assert [(rid, ids) for rid, ids, _ in last] == [("decode-0", [1, 2])]
    sp = last[0][2]
    assert (sp.max_tokens, sp.temperature, sp.logprobs, sp.ignore_eos, sp.detokenize) == (3, 0.0, 5, True, False)
    # a prompt-only call asks for no generation
    made.clear()
    engine_logprobs.prompt_logprobs("m", [], prompts, 5)
    assert not any(sp.prompt_logprobs is None for b in made[0].steps for _, _, sp in b)
    monkeypatch.setattr(engine_args_mod, "engine_args",
                        lambda model, cli, n: SimpleNamespace(max_logprobs=20, logprobs_mode="raw_logits"))
    with pytest.raises(ValueError, match="--logprobs-mode 'raw_logits'"):
        engine_logprobs.prompt_and_decode_logprobs("m", [], prompts, 5, [2, None, 4])


def _generated_output(root, model, samples) -> None:
    """An `extract --generate`-shaped output of layer 3: {id: (token ids, prompt length, states [T, H])}."""
    import json

    from tests.outputs import shard_writer, write_manifest

    hidden = next(iter(samples.values()))[2].shape[1]
    w = shard_writer(root, [3], hidden, generate=True)
    for sid, (ids, p, hs) in samples.items():
        rows = hs.to(torch.bfloat16)[:, None]
        w.add_rows(sid, ids, Rows(rows, rows.float().abs().amax(-1)), loss_spans=None, num_prompt=p,
                   record=json.dumps({"id": sid}) + "\n")
    write_manifest(root, w.close(), [3], hidden, model=str(model), num_model_layers=4)


def test_generated_rows_are_held_to_the_engines_decode_noise(tiny_models, tmp_path, monkeypatch):
    """The stored response rows are off by what a decode step moves (5% of each value: ~0.02 in
    logprobs at the top 5 tokens), the prompt rows are not. The stand-in engine's prefill is HF
    on the stored tokens; its decode logprobs are the stored rows' own (a decode that moves the
    rows as the extract's did) or the prefill's (a decode that moves nothing): the check passes
    with the first and fails with the second, as it does when no response position can be
    compared (the engine's greedy response begins with another token)."""
    from transformers import AutoModelForCausalLM

    from vllm_hidden.check import against_engine
    from vllm_hidden.engine import logprobs as engine_logprobs

    model = tiny_models("qwen3_next", 4)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    ref = Reference(str(model))
    g = torch.Generator().manual_seed(3)
    samples, moved = {}, {}
    for i in range(3):
        ids = [(5 * i + 3 * t) % 1000 + 1 for t in range(12 + 3 * i)] + [(11 * t + i) % 1000 + 1 for t in range(18)]
        p = 12 + 3 * i
        x = ref.run(ids, {3})[3]
        x[p:] *= 1 + 0.05 * torch.randn(x[p:].shape, generator=g)
        samples[f"s{i}"] = (ids, p, x)
        moved[tuple(ids)] = x.to(torch.bfloat16).float()
    samples["short"] = ([4, 5, 6, 7], 3, ref.run([4, 5, 6, 7], {3})[3])  # one response token: no row to compare
    _generated_output(tmp_path / "out", model, samples)
    asked = []

    def engine(decode_moves: bool, first: int | None = None):
        def fake(model_arg, cli_args, token_lists, k, num_prompt):
            asked.append(num_prompt)
            runs, decoded = [], []
            with torch.no_grad():
                for ids, p in zip(token_lists, num_prompt):
                    logits = hf(torch.tensor([ids])).logits[0]
                    runs.append(_top(logits, ids, k))
                    lp = torch.log_softmax(logits.float(), dim=-1)  # as _top's
                    if p is None:
                        decoded.append(None)
                        continue
                    if decode_moves:
                        lp = torch.log_softmax(hf.lm_head(hf.model.norm(moved[tuple(ids)])).float(), dim=-1)
                    gen = list(ids[p:]) if first is None else [first, *ids[p + 1:]]
                    # generated token j from row p + j - 1, its top k and itself
                    rows = [lp[p + j - 1] for j in range(len(gen))]
                    decoded.append((gen, [{t: row[t].item() for t in {*torch.topk(row, k).indices.tolist(), tok}}
                                          for row, tok in zip(rows, gen)]))
            return runs, runs, decoded

        return fake

    def check():
        return against_engine.check_against_engine(str(tmp_path / "out"), str(model), samples=10, top_k=5)

    monkeypatch.setattr(engine_logprobs, "prompt_logprobs", None)  # one engine does both
    monkeypatch.setattr(engine_logprobs, "prompt_and_decode_logprobs", engine(decode_moves=True))
    r = check()
    (s,) = r.sources
    # the one-token response has no row to compare: nothing to generate for it
    assert sorted(n for n in asked[-1] if n is not None) == [12, 15, 18] and asked[-1].count(None) == 1, asked
    assert r.ok and s.decode_noise > 0.01 and s.noise > s.prefill_noise == 0.0, r.table()
    assert r.decode == {"positions": 17 * 3, "of": 17 * 3, "fallback": []}, r.decode
    assert s.decode_positions == [17, 17] and "decode noise" in r.table()[0], r.table()
    assert r.to_dict()["decode"] == r.decode and r.to_dict()["sources"]["last layer"]["decode_positions"] == [17, 17]
    # the sample's noise: its prompt rows at the prefill noise (0 here), its 17 response rows at the decode noise
    p = int(s.worst_sample[1:]) * 3 + 12
    assert s.noise == pytest.approx(17 * s.decode_noise / (p + 17))

    monkeypatch.setattr(engine_logprobs, "prompt_and_decode_logprobs", engine(decode_moves=False))
    r = check()
    assert not r.ok and r.sources[0].decode_noise == 0.0 and r.decode["positions"] == 17 * 3, r.table()

    monkeypatch.setattr(engine_logprobs, "prompt_and_decode_logprobs", engine(decode_moves=True, first=999))
    r = check()
    (s,) = r.sources
    assert not r.ok and r.decode["positions"] == 0 and sorted(r.decode["fallback"]) == ["s0", "s1", "s2"], r.decode
    assert s.decode_noise is None and s.noise == 0.0, r.table()
    assert "none for samples" in r.message() and "none (0/17)" in " ".join(r.table()), r.table()
