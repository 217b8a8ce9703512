"""Colocated training on the real engine: scripts/colocated_train.py trains a tiny drafter on
`HiddenStatesStream` batches, the target (a tiny Qwen3-Next hybrid with a chat template) in the
script's own process. Killed with SIGKILL after two batches and run again from its checkpoint,
it gets every sample once, in input order, in the batches an uninterrupted run cuts; every
captured layer and the final state match HF, the loss masks are the input's, and no step's
states were copied to the host (the capture counts its host copies). The resumed run makes
each batch while the one before trains (lookahead=1)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import torch

from tests.chat_model import chat_model, expected
from tests.integration.helpers import HFReference, rel_l2, run_script

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [0, 2, 3]  # of 4: 3 is the last (before the final norm)
BUDGET = 400
CHATS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how can I help"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two"},
     {"role": "assistant", "content": "four"}, {"role": "user", "content": "and three"},
     {"role": "assistant", "content": "seven, no: five"}],
]


def _inputs(path: Path, tok) -> tuple[dict, int]:
    """Token-id records (some with their own loss mask), chat records and one bad line near the
    end; returns each good record's id -> (token ids, loss mask), worked out here, not by the
    code under test, and the bad line's number."""
    rng = random.Random(3)
    want, lines, bad = {}, [], -1
    for i in range(14):
        ids = [rng.randrange(10, 1000) for _ in range(rng.randint(20, 180))]
        rec = {"id": f"t{i}", "token_ids": ids}
        mask = [1] * len(ids)
        if i % 3 == 0:
            mask = [int(rng.random() < 0.5) for _ in ids]
            rec["loss_mask"] = mask
        lines.append(json.dumps(rec))
        want[f"t{i}"] = (ids, mask)
        if i % 5 == 1:
            c = CHATS[(i // 5) % len(CHATS)]
            lines.append(json.dumps({"id": f"c{i}", "messages": c}))
            want[f"c{i}"] = expected(tok, c)
        if i == 12:
            bad = len(lines)
            lines.append("not json")
    path.write_text("\n".join(lines) + "\n")
    return want, bad


def _train(model, inp, tmp, engine: str, *extra) -> subprocess.CompletedProcess:
    return run_script(ROOT / "scripts" / "colocated_train.py", "--model", str(model), "--input", str(inp),
                      "--layers", ",".join(map(str, LAYERS)), "--final-state", "--token-budget", str(BUDGET),
                      "--max-model-len", "512", "--engine-arg", engine, "--steps-per-batch", "3",
                      "--checkpoint", str(tmp / "ckpt.pt"), *extra)


def test_killed_then_resumed_trains_on_every_sample_once_with_hf_states(tiny_models, tmp_path):
    res = killed_then_resumed(tiny_models, tmp_path, "--enforce-eager --dtype bfloat16 --max-num-seqs 8")
    assert res["device"] == "cpu"


def killed_then_resumed(tiny_models, tmp_path, engine: str) -> dict:
    """The whole check, for this CPU test and its GPU twin (tests/gpu): returns the run's result."""
    from transformers import AutoTokenizer

    model = chat_model(tiny_models("qwen3_next", 4), tmp_path / "model")
    want, bad = _inputs(tmp_path / "in.jsonl", AutoTokenizer.from_pretrained(model))

    first = _train(model, tmp_path / "in.jsonl", tmp_path, engine, "--dump", str(tmp_path / "a"), "--die-after", "2")
    assert first.returncode == -9, first.stderr[-3000:]  # killed by its own SIGKILL, after batch 2's checkpoint
    # resumed with the next batch made while one trains: the same sequence
    again = _train(model, tmp_path / "in.jsonl", tmp_path, engine, "--dump", str(tmp_path / "b"),
                   "--result", str(tmp_path / "res.json"), "--lookahead", "1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed after batch 2" in again.stderr
    res = json.loads((tmp_path / "res.json").read_text())

    files = sorted((tmp_path / "a").glob("batch-*.pt")) + sorted((tmp_path / "b").glob("batch-*.pt"))
    assert [f.name for f in files] == [f"batch-{n:05d}.pt" for n in range(1, len(files) + 1)], files
    batches = [torch.load(f) for f in files]
    # every good record once, in input order; batches cut greedily under the budget
    order = [b for batch in batches for b in batch["ids"]]
    assert order == list(want), order
    sizes = [[len(want[i][0]) for i in batch["ids"]] for batch in batches]
    for k, s in enumerate(sizes):
        assert sum(s) <= BUDGET and (k == len(sizes) - 1 or sum(s) + sizes[k + 1][0] > BUDGET), sizes
    assert [e["line"] for e in res["errors"]] == [bad], res["errors"]  # read by the resumed run, skipped
    assert res["capture"]["host_copies"] == 0, res["capture"]  # no step's rows went through the host ring
    # the resumed run placed each of its samples' rows once (again, for a request preempted and recomputed)
    resumed_rows = sum(len(want[i][0]) for f in sorted((tmp_path / "b").glob("batch-*.pt"))
                       for i in torch.load(f)["ids"])
    placed = res["capture"]["device_rows"]
    assert placed == resumed_rows or (res["capture"]["preempted"] and placed > resumed_rows), res["capture"]

    ref = HFReference(model)
    worst = {lid: 0.0 for lid in LAYERS} | {"final": 0.0}
    for batch in batches:
        cu = batch["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == batch["token_ids"].numel() == batch["hidden_states"].shape[0]
        assert batch["hidden_states"].shape[1:] == (len(LAYERS), ref.model.config.hidden_size)
        for b, sid in enumerate(batch["ids"]):
            lo, hi = cu[b], cu[b + 1]
            ids, mask = want[sid]
            assert batch["token_ids"][lo:hi].tolist() == ids, sid
            assert batch["loss_mask"][lo:hi].int().tolist() == mask, sid
            assert batch["position_ids"][lo:hi].tolist() == list(range(hi - lo)), sid
            states = ref.states(ids)
            for k, lid in enumerate(LAYERS):
                worst[lid] = max(worst[lid], rel_l2(batch["hidden_states"][lo:hi, k], states[lid]))
            worst["final"] = max(worst["final"], rel_l2(batch["final_hidden_states"][lo:hi], ref.post_norm))
    assert max(worst.values()) <= 1e-2, worst

    # the drafter trained: three steps on each batch, each batch's loss lower after them
    losses = res["losses"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    per_batch = [losses[i : i + 3] for i in range(0, len(losses), 3)]
    assert all(b[-1] < b[0] for b in per_batch), per_batch
    return res


def test_two_ranks_split_the_prompts(tiny_models, tmp_path):
    """Two processes (rank 0 and 1 of 2, one after the other here): each trains on its own lines,
    i % 2 == rank, in order; together every good sample once, the bad line skipped by its rank."""
    model = tiny_models("qwen3_next", 4)
    rng = random.Random(6)
    lines = [json.dumps({"id": f"r{i}", "token_ids": [rng.randrange(10, 1000) for _ in range(rng.randint(8, 60))]})
             for i in range(9)]
    lines[4] = "not json"
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    seen = []
    for rank in (0, 1):
        run = run_script(ROOT / "scripts" / "colocated_train.py", "--model", str(model), "--input",
                         str(tmp_path / "in.jsonl"), "--layers", "1,3", "--token-budget", "100", "--rank", str(rank),
                         "--world-size", "2", "--engine-arg", "--enforce-eager --dtype bfloat16 --max-num-seqs 8",
                         "--dump", str(tmp_path / f"d{rank}"), "--result", str(tmp_path / f"res{rank}.json"))
        assert run.returncode == 0, run.stderr[-3000:]
        res = json.loads((tmp_path / f"res{rank}.json").read_text())
        ids = [i for f in sorted((tmp_path / f"d{rank}").glob("batch-*.pt")) for i in torch.load(f)["ids"]]
        assert ids == [f"r{i}" for i in range(rank, 9, 2) if i != 4], ids
        assert [e["line"] for e in res["errors"]] == ([4] if rank == 0 else []), res["errors"]
        seen += ids
    assert sorted(seen) == sorted(f"r{i}" for i in range(9) if i != 4)


def test_generated_responses_come_with_their_states(tiny_models, tmp_path):
    res = generated_with_states(tiny_models, tmp_path, "--enforce-eager --dtype bfloat16 --max-num-seqs 8")
    assert res["device"] == "cpu"


def generated_with_states(tiny_models, tmp_path, engine: str, drafter: str = "speculators-eagle3") -> dict:
    """`generate`: the target writes each response (greedy, at most 6 tokens) and the batch holds
    prompt + response, its states those HF computes for the final token ids, the loss on the
    response; a two-turn conversation has both assistant turns rewritten in order. The drafter
    is speculators' own EAGLE-3 model (or `drafter`: the GPU host has speculators' package but
    not all of its imports). Returns the run's result (this CPU test and its GPU twin)."""
    from transformers import AutoTokenizer

    max_tokens = 6
    model = chat_model(tiny_models("qwen3_next", 4), tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(4)
    prompts = {f"g{i}": [rng.randrange(10, 1000) for _ in range(rng.randint(10, 90))] for i in range(5)}
    lines = [json.dumps({"id": k, "token_ids": v}) for k, v in prompts.items()]
    lines.insert(2, json.dumps({"id": "chat", "messages": CHATS[1]}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    run = run_script(ROOT / "scripts" / "colocated_train.py", "--model", str(model), "--input",
                     str(tmp_path / "in.jsonl"), "--layers", ",".join(map(str, LAYERS)), "--final-state",
                     "--token-budget", "200", "--max-model-len", "512", "--max-tokens", str(max_tokens),
                     "--temperature", "0", "--engine-arg", engine,
                     "--drafter", drafter, "--steps-per-batch", "3",
                     "--dump", str(tmp_path / "d"), "--result", str(tmp_path / "res.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["capture"]["host_copies"] == 0 and res["errors"] == [], res
    batches = [torch.load(f) for f in sorted((tmp_path / "d").glob("batch-*.pt"))]
    assert [i for b in batches for i in b["ids"]] == ["g0", "g1", "chat", "g2", "g3", "g4"]

    ref = HFReference(model)
    worst = {lid: 0.0 for lid in LAYERS} | {"final": 0.0}
    for batch in batches:
        cu = batch["cu_seqlens"].tolist()
        assert cu[-1] == batch["token_ids"].numel() == batch["hidden_states"].shape[0] <= 200, cu
        for b, sid in enumerate(batch["ids"]):
            lo, hi = cu[b], cu[b + 1]
            ids, mask = batch["token_ids"][lo:hi].tolist(), batch["loss_mask"][lo:hi].tolist()
            gen = batch["generations"][b]
            if sid in prompts:  # the prompt, then its response (1..max_tokens tokens), the loss on the response
                p = len(prompts[sid])
                assert ids[:p] == prompts[sid] and 1 <= hi - lo - p <= max_tokens, (sid, len(ids))
                assert mask == [False] * p + [True] * (hi - lo - p), sid
                assert gen["response_token_ids"] == ids[p:], sid
            else:  # the template's conversation with the first response in it, then the second response
                first, last = (t["token_ids"] for t in gen["turns"])
                conv = [*CHATS[1][:2], {"role": "assistant", "content": gen["turns"][0]["text"]}, CHATS[1][3]]
                before = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]
                head = len(tok.apply_chat_template(CHATS[1][:2], add_generation_prompt=True,
                                                   tokenize=True)["input_ids"])
                assert ids == before + last and ids[head : head + len(first)] == first, (ids, gen)
                # the loss on both responses, the first with its end of turn
                n1 = len(first) + 1
                assert mask == [False] * head + [True] * n1 + [False] * (len(before) - head - n1) + \
                    [True] * len(last), mask
            states = ref.states(ids)
            for k, lid in enumerate(LAYERS):
                worst[lid] = max(worst[lid], rel_l2(batch["hidden_states"][lo:hi, k], states[lid]))
            worst["final"] = max(worst["final"], rel_l2(batch["final_hidden_states"][lo:hi], ref.post_norm))
    assert max(worst.values()) <= 1e-2, worst
    # the drafter (speculators' own EAGLE-3 model, fed through `to_speculators`) trained: its loss falls
    per_batch = [res["losses"][i : i + 3] for i in range(0, len(res["losses"]), 3)]
    assert len(per_batch) == len(batches) and all(b[-1] < b[0] for b in per_batch), per_batch
    return res
