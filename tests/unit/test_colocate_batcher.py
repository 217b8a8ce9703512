"""The colocated stream's batches without an engine (`colocate.batcher.PromptBatcher`): each
rank takes the input lines i with i % world_size == rank, in order; batches are cut greedily
under the token budget; a cursor brings a new batcher to the next batch; a prompt over the
budget is refused naming both sizes; bad records are skipped and kept."""

import json
import random

import pytest

from vllm_hidden.colocate.batcher import PromptBatcher
from vllm_hidden.inputs.reader import PromptReader


def _input(path, n=40, seed=0):
    rng = random.Random(seed)
    lens, lines = {}, []
    for i in range(n):
        if i % 13 == 5:
            lines.append("{broken")
            continue
        ids = [rng.randrange(1, 100) for _ in range(rng.randint(1, 60))]
        lines.append(json.dumps({"id": f"s{i}", "token_ids": ids}))
        lens[i] = len(ids)
    path.write_text("\n".join(lines) + "\n")
    return lens


def _batcher(path, rank=0, world=1, budget=100):
    return PromptBatcher(PromptReader(path, vocab_size=100, max_prompt_len=1000), rank, world, budget)


def _all(b):
    out = []
    while batch := b.next_batch():
        out.append([p.line for p in batch])
        b.done(batch)
    return out


def test_ranks_split_the_lines_in_order_and_batches_fit_the_budget(tmp_path):
    lens = _input(tmp_path / "in.jsonl")
    seen = []
    for rank in range(3):
        b = _batcher(tmp_path / "in.jsonl", rank, 3, budget=100)
        batches = _all(b)
        lines = [x for batch in batches for x in batch]
        assert lines == [i for i in sorted(lens) if i % 3 == rank]
        for k, batch in enumerate(batches):
            used = sum(lens[i] for i in batch)
            assert used <= 100
            if k + 1 < len(batches):  # greedy: the next prompt did not fit
                assert used + lens[batches[k + 1][0]] > 100
        assert sorted(e.line for e in b.errors) == [i for i in range(40) if i % 13 == 5 and i % 3 == rank]
        seen += lines
    assert sorted(seen) == sorted(lens)  # every good line once, over the ranks


def test_a_cursor_brings_a_new_batcher_to_the_next_batch(tmp_path):
    _input(tmp_path / "in.jsonl")
    whole = _all(_batcher(tmp_path / "in.jsonl", 1, 2, budget=90))
    b = _batcher(tmp_path / "in.jsonl", 1, 2, budget=90)
    for _ in range(3):
        b.done(b.next_batch())
    b.next_batch()  # read, not handed over: the cursor stays before it
    resumed = _batcher(tmp_path / "in.jsonl", 1, 2, budget=90)
    resumed.seek(b.cursor)
    assert whole[:3] + _all(resumed) == whole


def test_a_prompt_over_the_budget_is_refused_naming_both(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "long", "token_ids": list(range(1, 51))}) + "\n")
    with pytest.raises(ValueError, match="input line 0 .id 'long'. has 50 tokens, more than token_budget 40"):
        _batcher(tmp_path / "in.jsonl", budget=40).next_batch()
    with pytest.raises(ValueError, match="cursor must be a non-negative int, got -1"):
        _batcher(tmp_path / "in.jsonl").seek(-1)


def test_stream_options_are_checked_before_anything_starts(tmp_path, monkeypatch):
    from vllm_hidden.colocate.stream import HiddenStatesStream, _rank_and_world

    with pytest.raises(ValueError, match="token_budget must be a positive int, got 0"):
        HiddenStatesStream("m", tmp_path / "in.jsonl", token_budget=0)
    with pytest.raises(ValueError, match=r"lookahead must be 0 \(pull-through\) or 1 .*, got 2"):
        HiddenStatesStream("m", tmp_path / "in.jsonl", lookahead=2)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\), got 1.5"):
        HiddenStatesStream("m", tmp_path / "in.jsonl", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"generate: unknown option\(s\) 'max_token'; it takes max_tokens, "):
        HiddenStatesStream("m", tmp_path / "in.jsonl", generate={"max_token": 8})
    with pytest.raises(ValueError, match="--max-tokens must be a positive int, got 0"):
        HiddenStatesStream("m", tmp_path / "in.jsonl", generate={"max_tokens": 0})
    with pytest.raises(ValueError, match="generate must be a GenerateConfig, a dict of its fields or None, got 8"):
        HiddenStatesStream("m", tmp_path / "in.jsonl", generate=8)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _rank_and_world(None, None) == (3, 4)  # torchrun's
    assert _rank_and_world(0, 2) == (0, 2)
    with pytest.raises(ValueError, match=r"rank must be an int in 0..1, got 2"):
        _rank_and_world(2, 2)
    monkeypatch.setenv("RANK", "first")
    with pytest.raises(ValueError, match="RANK must be an integer, got 'first'"):
        _rank_and_world(None, None)


def test_a_cost_cuts_the_batches_and_seeking_back_reads_the_same_ids_again(tmp_path):
    """Under generation a prompt costs the rows its sample may reach (here its tokens + 20); a
    batcher sent back to an earlier cursor reads those records again, not as duplicates."""
    lens = _input(tmp_path / "in.jsonl")
    b = PromptBatcher(PromptReader(tmp_path / "in.jsonl", vocab_size=100, max_prompt_len=1000), 0, 1, 100,
                      cost=lambda p: len(p.token_ids) + 20)
    first = b.next_batch()
    assert sum(lens[p.line] + 20 for p in first) <= 100 < sum(lens[p.line] + 20 for p in first) + \
        lens[b.next_batch()[0].line] + 20  # greedy under the cost (the next one did not fit)
    b.seek(0)
    batches = _all(b)
    assert [x for batch in batches for x in batch] == sorted(lens) and b.errors[0].line == 5, b.errors[:2]
    assert [e.line for e in b.errors] == [i for i in range(40) if i % 13 == 5], b.errors  # once each, none a duplicate
    with pytest.raises(ValueError, match="up to 82 tokens with its responses, more than token_budget 81"):
        PromptBatcher(PromptReader(tmp_path / "in.jsonl", vocab_size=100, max_prompt_len=1000), 0, 1, 81,
                      cost=lambda p: 82).next_batch()


def test_a_saved_stream_state_is_refused_where_the_batches_would_differ(tmp_path):
    """`load_state_dict` takes a state only from a stream whose batches are the same sequence:
    the same input, rank, world size, budget and generation settings (no engine needed here)."""
    from vllm_hidden.colocate.stream import HiddenStatesStream
    from vllm_hidden.config import GenerateConfig

    _input(tmp_path / "in.jsonl")

    def bare(**kw):
        s = HiddenStatesStream.__new__(HiddenStatesStream)  # the state's part of a stream, no engine
        s.input, s.rank, s.world_size, s.token_budget, s.generate = str(tmp_path / "in.jsonl"), 1, 2, 90, None
        s.__dict__.update(kw)
        s._cursor = s._batches = s._samples = 0
        s._maker = None
        s._batcher = _batcher(tmp_path / "in.jsonl", s.rank, s.world_size, budget=s.token_budget)
        return s

    # a batch that raised is made again from the same prompts; one left with no sample is not handed over
    s = bare()
    s._responses, calls = None, []

    def compute(prompts):
        calls.append([p.line for p in prompts])
        if len(calls) == 1:
            raise RuntimeError("the engine failed")
        return None if len(calls) == 2 else {"ids": [p.id for p in prompts]}  # None: no sample left

    s._compute = compute
    with pytest.raises(RuntimeError, match="the engine failed"):
        s._make()
    batch, cursor, n = s._make()
    assert calls[0] == calls[1] != calls[2] and batch["ids"] == [f"s{i}" for i in calls[2]] and n == len(calls[2])
    assert cursor > calls[2][-1], (cursor, calls)  # past the batch handed over

    saved = {**bare().state_dict(), "cursor": 9, "batches": 2, "samples": 4}
    s = bare()
    s.load_state_dict(saved)
    assert (s.state_dict()["cursor"], s._batcher.cursor, s.state_dict()["batches"]) == (9, 9, 2)
    for kw, name in (({"input": "other.jsonl"}, "input"), ({"rank": 0}, "rank"), ({"world_size": 3}, "world_size"),
                     ({"token_budget": 91}, "token_budget"),
                     ({"generate": GenerateConfig(max_tokens=64)}, "generate")):
        with pytest.raises(ValueError, match=f"the saved stream had {name}=.*this one has"):
            bare(**kw).load_state_dict(saved)
    gen = bare(generate=GenerateConfig(max_tokens=64))
    with pytest.raises(ValueError, match="the saved stream had generate=.'max_tokens': 32"):
        gen.load_state_dict(bare(generate=GenerateConfig(max_tokens=32)).state_dict())
    with pytest.raises(ValueError, match="not a HiddenStatesStream state"):
        bare().load_state_dict({"cursor": 3})


def test_a_resumed_batcher_skips_the_duplicates_an_uninterrupted_one_skips(tmp_path):
    """An id repeated after the cursor of an earlier record's: the up-front scan names it, so a
    batcher resumed past the first one skips it too (its reader never saw the first)."""
    from vllm_hidden.inputs import scan_input

    ids = ["a", "b", "c", "a", "d"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "token_ids": [5] * 30}) + "\n" for i in ids))

    def batcher():
        reader = PromptReader(tmp_path / "in.jsonl", vocab_size=100, max_prompt_len=1000)
        dups = scan_input(PromptReader(tmp_path / "in.jsonl", vocab_size=100, max_prompt_len=1000)).duplicates
        return PromptBatcher(reader, 0, 1, 60, duplicates=dups)

    whole = batcher()
    assert _all(whole) == [[0, 1], [2, 4]] and [(e.line, e.reason) for e in whole.errors] == [(3, "duplicate id 'a'")]
    resumed = batcher()
    resumed.seek(2)
    assert _all(resumed) == [[2, 4]] and [e.line for e in resumed.errors] == [3]
