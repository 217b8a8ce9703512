"""Conversations -> token ids and loss masks, with a real tokenizer and a multi-turn template
written by the tests; every mask is checked against tests/chat_model.py's independent
computation. Also Parquet input (row groups, nulls, column names) against the same records
as JSONL, and the error records bad conversations get."""

from __future__ import annotations

import json

import pytest

from tests import chat_model
from vllm_hidden.inputs import BadLine, Prompt, PromptReader, parse_columns


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return chat_model.tokenizer(tmp_path_factory.mktemp("chat"))


def reader(tmp_path, tok, records, name="in.jsonl", **kw):
    p = tmp_path / name
    if name.endswith(".parquet"):
        write_parquet(p, records, kw.pop("row_group_size", 7))
    elif name.endswith(".json"):  # one array, as ShareGPT is downloaded: indented, with a BOM
        p.write_bytes(b"\xef\xbb\xbf \n" + json.dumps(records, indent=2).encode())
    else:
        p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return PromptReader(p, vocab_size=kw.pop("vocab", 512), max_prompt_len=kw.pop("max_len", 4096),
                        tokenizer_loader=lambda: tok, **kw)


def write_parquet(path, records, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # nested turns as JSON-typed structs would need one schema for every row; a column of
    # lists of structs with every key present (nulls for absent ones) is what datasets write
    keys = sorted({k for r in records for k in r})
    cols = {k: [r.get(k) for r in records] for k in keys}
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)


def mask_of(p: Prompt) -> list[int]:
    m = [0] * len(p.token_ids)
    for lo, hi in p.loss_spans:
        m[lo:hi] = [1] * (hi - lo)
    return m


@pytest.mark.parametrize("rule", ["assistant", "last-assistant", "all"])
def test_every_conversations_mask_matches_the_independent_one(tmp_path, tok, rule):
    recs = chat_model.conversations(40)
    out = list(reader(tmp_path, tok, recs, loss_mask=None if rule == "assistant" else rule))
    assert all(isinstance(p, Prompt) for p in out), [p for p in out if isinstance(p, BadLine)]
    kinds = set()
    for rec, p in zip(recs, out):
        msgs = chat_model.messages_of(rec)
        ids, mask = chat_model.expected(tok, msgs, rec.get("tools"), rule)
        assert p.id == rec["id"]
        assert p.token_ids == ids, rec["id"]
        # the tokens are exactly what the template gives through Transformers, tokenized whole
        whole = tok.apply_chat_template(msgs, tools=rec.get("tools"), tokenize=True, add_generation_prompt=False)
        assert p.token_ids == list(whole["input_ids"] if hasattr(whole, "keys") else whole)
        assert mask_of(p) == mask, rec["id"]
        kinds |= {k for k in ("messages", "conversations") if k in rec} | ({"tools"} if "tools" in rec else set())
    assert kinds == {"messages", "conversations", "tools"}


def test_tools_given_as_a_json_string_are_the_same_tools(tmp_path, tok):
    rec = next(r for r in chat_model.conversations(8) if "tools" in r)
    a, b, c = reader(tmp_path, tok, [rec, {**rec, "id": "s", "tools": json.dumps(rec["tools"])},
                                     {**rec, "id": "bad", "tools": "{not json"}])
    assert isinstance(a, Prompt) and (a.token_ids, a.loss_spans) == (b.token_ids, b.loss_spans)
    assert isinstance(c, BadLine) and "tools is a string but not JSON" in c.reason


def test_sharegpt_and_role_content_give_the_same_tokens_and_mask(tmp_path, tok):
    msgs = chat_model.messages_of(chat_model.conversations(3)[0])
    recs = [{"id": "a", "messages": msgs}, {"id": "b", "conversations": msgs},
            {"id": "c", "conversations": chat_model.to_sharegpt(msgs)}]
    a, b, c = reader(tmp_path, tok, recs)
    assert a.token_ids == b.token_ids == c.token_ids and a.loss_spans == b.loss_spans == c.loss_spans
    assert len(a.loss_spans) == sum(m["role"] == "assistant" for m in msgs) >= 1


def test_the_end_of_turn_token_is_in_the_mask_and_the_header_is_not(tmp_path, tok):
    msgs = [{"role": "user", "content": "x a"}, {"role": "assistant", "content": "b c d"}]
    (p,) = reader(tmp_path, tok, [{"messages": msgs}])
    toks = tok.convert_ids_to_tokens(p.token_ids)
    ((lo, hi),) = p.loss_spans
    assert toks == ["<|user|>", "x", "a", "<|end|>", "<|assistant|>", "b", "c", "d", "<|end|>"]
    assert (lo, hi) == (5, 9)


def test_bad_conversations_are_error_records_naming_the_value(tmp_path, tok):
    recs = [
        {"id": "role", "messages": [{"role": "wizard", "content": "x"}]},
        {"id": "from", "conversations": [{"from": "bot", "value": "x"}]},
        {"id": "empty", "conversations": []},
        {"id": "content", "messages": [{"role": "user", "content": ["a", "b"]}]},
        {"id": "no-assistant", "messages": [{"role": "user", "content": "the"}]},
        {"id": "mask-len", "token_ids": [1, 2, 3], "loss_mask": [1, 0]},
        {"id": "mask-val", "token_ids": [1, 2], "loss_mask": [1, 2]},
        {"id": "mask-text", "text": "the a", "loss_mask": [1, 1]},
        {"id": "tools-text", "text": "the a", "tools": chat_model.TOOLS},
        {"id": "turn", "conversations": ["hello"]},
        {"id": "ok", "messages": [{"role": "user", "content": "the"}, {"role": "assistant", "content": "a"}]},
    ]
    out = {p.id: p for p in reader(tmp_path, tok, recs)}
    why = {k: p.reason for k, p in out.items() if isinstance(p, BadLine)}
    assert "unknown role 'wizard'" in why["role"]
    assert "unknown ShareGPT 'from' 'bot'" in why["from"]
    assert why["empty"] == "prompt has no tokens"
    assert "content must be a string, got list" in why["content"]
    assert "no assistant turn" in why["no-assistant"]
    assert "loss_mask has 2 values for 3 token_ids" in why["mask-len"]
    assert "got 2 at 1" in why["mask-val"]
    assert "loss_mask goes with token_ids" in why["mask-text"]
    assert "tools go with messages/conversations" in why["tools-text"]
    assert "turn 0 must be an object, got str" in why["turn"]
    assert isinstance(out["ok"], Prompt)


def test_a_template_that_drops_earlier_turns_content_is_masked_as_it_is_written(tmp_path):
    # earlier assistant turns lose their content once a later one exists (as templates drop
    # earlier reasoning): the sample holds only what was written, and that is what is masked
    dropping = chat_model.TEMPLATE.replace("<|assistant|> {{ m.content }}",
                                           "<|assistant|> {% if loop.last %}{{ m.content }}{% endif %}")
    tok = chat_model.tokenizer(tmp_path, dropping)
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    (p,) = reader(tmp_path, tok, [{"id": "two", "messages": two}])
    toks = tok.convert_ids_to_tokens(p.token_ids)
    assert toks == ["<|user|>", "a", "<|end|>", "<|assistant|>", "<|end|>", "<|user|>", "c", "<|end|>",
                    "<|assistant|>", "d", "<|end|>"]
    assert mask_of(p) == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1]


def test_a_token_across_a_turns_boundary_is_an_error_record_never_a_wrong_mask(tmp_path):
    # the generation prompt ends inside what becomes one token with the content ("x" + "b")
    glued = chat_model.TEMPLATE.replace("<|assistant|> {{ m.content }}", "<|assistant|> x{{ m.content }}").replace(
        "{%- if add_generation_prompt %} <|assistant|>", "{%- if add_generation_prompt %} <|assistant|> x")
    tok = chat_model.tokenizer(tmp_path, glued)
    (p,) = reader(tmp_path, tok, [{"id": "g", "messages": [{"role": "user", "content": "a"},
                                                            {"role": "assistant", "content": "b"}]}])
    assert isinstance(p, BadLine) and "assistant turn 1: a token spans the turn's start" in p.reason


def test_a_thinking_template_that_marks_only_the_last_turn_still_gets_exact_masks(tmp_path):
    # as Qwen3's template writes an (empty) think block into the last assistant turn only, so
    # the conversation through an earlier turn is not a prefix of the whole
    thinking = chat_model.TEMPLATE.replace("<|assistant|> {{ m.content }}",
                                           "<|assistant|> {% if loop.last %}c d {% endif %}{{ m.content }}")
    # ...and, as Qwen3's does, a separator before tool calls only after non-empty content
    thinking = thinking.replace("{%- if m.tool_calls %} call",
                                "{%- if m.tool_calls %}{% if m.content %} y{% endif %} call")
    assert thinking.count("loop.last") == 1 and thinking.count(" y{% endif %}") == 1
    tok = chat_model.tokenizer(tmp_path, thinking)
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "e"},
           {"role": "user", "content": "f"}, {"role": "assistant", "content": "g"}]
    (p,) = reader(tmp_path, tok, [{"id": "two", "messages": two}])
    assert isinstance(p, Prompt), p
    toks = tok.convert_ids_to_tokens(p.token_ids)
    assert toks == ["<|user|>", "a", "<|end|>", "<|assistant|>", "e", "<|end|>", "<|user|>", "f", "<|end|>",
                    "<|assistant|>", "c", "d", "g", "<|end|>"]
    assert mask_of(p) == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    # tool calls written after the content belong to the turn too
    calls = [{"role": "user", "content": "a"},
             {"role": "assistant", "content": "e", "tool_calls": [{"type": "function", "function": {"name": "h"}}]},
             {"role": "tool", "content": "i"}, {"role": "assistant", "content": "g"}]
    (q,) = reader(tmp_path, tok, [{"id": "calls", "messages": calls}])
    qt = tok.convert_ids_to_tokens(q.token_ids)
    assert [t for t, m in zip(qt, mask_of(q)) if m] == ["e", "y", "<unk>", "h", "<|end|>", "c", "d", "g", "<|end|>"]
    # a tool-call turn with empty content: a marker in its place would change what is written
    # around it (the separator), so its end is found from the turn followed by a user turn
    empty = [{**m, "content": ""} if m.get("tool_calls") else m for m in calls]
    (e,) = reader(tmp_path, tok, [{"id": "empty", "messages": empty}])
    et = tok.convert_ids_to_tokens(e.token_ids)
    assert isinstance(e, Prompt) and "y" not in et
    assert [t for t, m in zip(et, mask_of(e)) if m] == ["<unk>", "h", "<|end|>", "c", "d", "g", "<|end|>"]


def test_a_template_failure_is_an_error_record(tmp_path):
    tok = chat_model.tokenizer(tmp_path, "{{ raise_exception('roles must alternate') }}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    (p,) = reader(tmp_path, tok, [{"id": "x", "messages": msgs}])
    assert isinstance(p, BadLine) and "chat template failed" in p.reason and "roles must alternate" in p.reason


def test_loss_mask_none_stores_no_mask_and_assistant_on_text_is_refused(tmp_path, tok):
    recs = chat_model.conversations(4) + [{"id": "t", "text": "the a of"}]
    out = list(reader(tmp_path, tok, recs, loss_mask="none"))
    assert all(isinstance(p, Prompt) and p.loss_spans is None for p in out)
    out = list(reader(tmp_path, tok, recs, loss_mask="assistant"))
    assert isinstance(out[-1], BadLine) and "needs a messages/conversations record" in out[-1].reason


def test_parquet_with_row_groups_nulls_and_a_bad_row_equals_the_same_records_as_jsonl(tmp_path, tok):
    import pyarrow.parquet as pq

    # one kind per column, nulls elsewhere (a table mixing kinds row by row); a bad row
    recs = [{"id": f"t{i}", "token_ids": [3 + i, 4, 5], "loss_mask": [0, 1, 1]} for i in range(5)]
    recs += [{"id": f"x{i}", "text": "the a of to"[: 3 + i]} for i in range(5)]
    recs += [{"id": r["id"], "messages": chat_model.messages_of(r)} for r in chat_model.conversations(12)]
    recs.insert(9, {"id": "bad", "token_ids": [1, 99999]})
    jsonl = list(reader(tmp_path, tok, recs))
    pq_reader = reader(tmp_path, tok, recs, name="in.parquet", row_group_size=4)
    assert pq.ParquetFile(str(tmp_path / "in.parquet")).num_row_groups > 2
    parquet = list(pq_reader)
    assert parquet == jsonl
    assert sum(isinstance(p, BadLine) for p in parquet) == 1 and "99999" in next(
        p.reason for p in parquet if isinstance(p, BadLine))
    assert pq_reader.describe()["format"] == "parquet"
    assert pq_reader.describe()["kinds"] == {"messages": 12, "text": 5, "token_ids": 6}


def test_parquet_columns_are_mapped_by_input_columns(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    convs = [chat_model.to_sharegpt(chat_model.messages_of(r)) for r in chat_model.conversations(6) if "tools" not in r]
    pq.write_table(pa.table({"uid": [f"u{i}" for i in range(len(convs))], "conv": convs}), tmp_path / "c.parquet",
                   row_group_size=2)
    mapped = PromptReader(tmp_path / "c.parquet", vocab_size=512, max_prompt_len=4096, tokenizer_loader=lambda: tok,
                          columns=parse_columns("conversations=conv,id=uid"))
    out = list(mapped)
    assert [p.id for p in out] == [f"u{i}" for i in range(len(convs))] and all(isinstance(p, Prompt) for p in out)
    with pytest.raises(ValueError, match="no column holds token_ids"):
        list(PromptReader(tmp_path / "c.parquet", vocab_size=512, max_prompt_len=4096))
    with pytest.raises(ValueError, match="has no column 'nope'"):
        list(PromptReader(tmp_path / "c.parquet", vocab_size=512, max_prompt_len=4096,
                          columns=parse_columns("text=nope")))


@pytest.mark.parametrize("spec,msg", [("text", "expected field=column"), ("bogus=x", "unknown field 'bogus'"),
                                      ("text=a,text=b", "given twice"), ("=a", "expected field=column")])
def test_bad_input_columns_are_refused_naming_them(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse_columns(spec)


def test_a_conversation_that_opens_with_an_assistant_turn_masks_only_that_turn(tmp_path, tok):
    # the template reads messages[0] (system prompt, tools), so the empty conversation cannot
    # be rendered: the turn is placed by its content, never from character 0
    (p,) = reader(tmp_path, tok, [{"messages": [{"role": "assistant", "content": "b c"},
                                                {"role": "user", "content": "d"}],
                                   "tools": chat_model.TOOLS}])
    toks = tok.convert_ids_to_tokens(p.token_ids)
    assert toks[0] == "<|system|>" and [t for t, m in zip(toks, mask_of(p)) if m] == ["b", "c", "<|end|>"]


def test_a_record_the_tokenizer_cannot_take_is_an_error_record_and_the_run_goes_on(tmp_path, tok):
    bad = {"id": "surrogate", "messages": [{"role": "user", "content": "\ud800"},
                                           {"role": "assistant", "content": "b"}]}
    text = {"id": "surrogate-text", "text": "a \ud800"}
    ok = {"id": "ok", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    out = list(reader(tmp_path, tok, [bad, text, ok]))
    assert isinstance(out[0], BadLine) and "cannot tokenize this record" in out[0].reason
    assert isinstance(out[1], BadLine) and "cannot tokenize this record" in out[1].reason
    assert isinstance(out[2], Prompt)


def test_a_column_mapped_onto_another_fields_name_is_read_once(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    (tmp_path / "m.jsonl").write_text(json.dumps({"id": "j", "conversations": msgs}) + "\n")
    pq.write_table(pa.table({"id": ["q"], "conversations": [msgs]}), tmp_path / "m.parquet")
    for name in ("m.jsonl", "m.parquet"):
        (p,) = PromptReader(tmp_path / name, vocab_size=512, max_prompt_len=4096, tokenizer_loader=lambda: tok,
                            columns=parse_columns("messages=conversations"))
        assert isinstance(p, Prompt), (name, p)
        r = PromptReader(tmp_path / name, vocab_size=512, max_prompt_len=4096, tokenizer_loader=lambda: tok,
                         columns=parse_columns("messages=conversations"))
        list(r)
        assert r.kinds == {"messages": 1}


def _expected_prompt(tok, rec, rule="assistant"):
    """--generate's prompt, worked out with chat_model: the turns up to the last user turn,
    masked under `rule` (the last assistant turn is the response, so 'last-assistant' masks
    none of the prompt), then the generation prompt's one token."""
    msgs = chat_model.messages_of(rec)
    turns = msgs[: max(j for j, m in enumerate(msgs) if m["role"] == "user") + 1]
    ids, mask = chat_model.expected(tok, turns, rec.get("tools"), "all" if rule == "all" else "assistant")
    if rule == "last-assistant":
        mask = [0] * len(mask)
    return ids + [tok.convert_tokens_to_ids("<|assistant|>")], mask + [int(rule == "all")], turns


@pytest.mark.parametrize("rule", [None, "last-assistant", "all", "none"])
def test_generate_prompts_end_at_the_last_user_turn_with_the_generation_prompt(tmp_path, tok, rule):
    recs = chat_model.conversations(16, seed=4)
    recs += [{"id": "t", "text": "a b c"}, {"id": "m", "token_ids": [20, 21, 22], "loss_mask": [0, 1, 1]},
             {"id": "no-user", "conversations": [{"from": "system", "value": "a"}, {"from": "gpt", "value": "b"}]}]
    got = list(reader(tmp_path, tok, recs, loss_mask=rule, room=8, max_len=4096 - 8))
    bad = [g for g in got if isinstance(g, BadLine)]
    assert [b.id for b in bad] == ["no-user"] and "no user turn" in bad[0].reason
    for p in got:
        if isinstance(p, BadLine):
            continue
        rec = next(r for r in recs if r["id"] == p.id)
        if "text" in rec or "token_ids" in rec:
            ids = rec.get("token_ids") or tok(rec["text"])["input_ids"]
            mask = {"all": [1] * len(ids), "none": None}.get(rule, rec.get("loss_mask", [0] * len(ids)))
            assert p.token_ids == ids and p.source == ({"text": rec["text"]} if "text" in rec else {})
        else:
            ids, mask, turns = _expected_prompt(tok, rec, rule or "assistant")
            assert p.token_ids == ids, p.id
            assert p.source["messages"] == turns and p.source.get("tools") == rec.get("tools")
            if rule == "none":
                mask = None
        if mask is None:
            assert p.loss_spans is None
        else:
            flat = [0] * len(ids)
            for lo, hi in p.loss_spans:
                flat[lo:hi] = [1] * (hi - lo)
            assert flat == mask, (p.id, rule)


def test_generate_prompt_that_leaves_no_room_is_an_error_record(tmp_path, tok):
    got = list(reader(tmp_path, tok, [{"id": 1, "token_ids": list(range(10, 30))}], room=8, max_len=12))
    assert isinstance(got[0], BadLine)
    assert got[0].reason == "prompt has 20 tokens, which leaves no room for --max-tokens 8 within max_model_len 20"


def test_regenerate_all_keeps_system_and_user_turns_and_joins_turns_as_the_template_writes_them(tmp_path, tok):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a b"},
            {"role": "assistant", "content": "x", "tool_calls": [{"type": "function", "function": {"name": "lookup"}}]},
            {"role": "tool", "content": "r"}, {"role": "assistant", "content": "y"},
            {"role": "system", "content": "t"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "z"},
            {"role": "user", "content": "d e"}]
    recs = [{"id": "m", "messages": msgs, "tools": chat_model.TOOLS},
            {"id": "one", "conversations": chat_model.to_sharegpt(msgs[:2] + msgs[4:5])}]
    p, one = reader(tmp_path, tok, recs, room=4, regenerate="all")
    kept = [m for m in msgs if m["role"] in ("system", "user")]
    assert p.source == {"messages": kept, "tools": chat_model.TOOLS}
    first, first_mask = chat_model.expected(tok, kept[:2], chat_model.TOOLS)
    assert p.token_ids == first + tok.convert_tokens_to_ids(["<|assistant|>"]) and p.loss_spans == []
    names = [tok.convert_ids_to_tokens(joint) for joint, _ in p.turns]
    assert names == [["<|end|>", "<|system|>", "t", "<|end|>", "<|user|>", "c", "<|end|>", "<|assistant|>"],
                     ["<|end|>", "<|user|>", "d", "e", "<|end|>", "<|assistant|>"]]
    assert [closing for _, closing in p.turns] == [1, 1]
    assert one.turns == () and one.source == {"messages": msgs[:2]}  # one user turn: one response
    (last,) = reader(tmp_path, tok, recs[:1], room=4, regenerate="last")
    assert last.turns == () and last.source["messages"] == msgs  # as written up to the last user turn
    (masked,) = reader(tmp_path, tok, recs[:1], room=4, regenerate="all", loss_mask="all")
    assert masked.loss_spans == [(0, len(masked.token_ids))] and masked.turns == p.turns


def test_regenerate_all_refuses_a_template_that_ends_turns_otherwise_before_a_user_turn(tmp_path):
    # the end of a turn written differently when a user turn follows than when it is the last
    odd = chat_model.TEMPLATE.replace("{%- if m.tool_calls %} call", "{%- if not loop.last %} a{% endif %}"
                                      "{%- if m.tool_calls %} call")
    tok = chat_model.tokenizer(tmp_path, odd)
    msgs = [{"role": "user", "content": "b"}, {"role": "user", "content": "c"}]
    (p,) = reader(tmp_path, tok, [{"id": "x", "messages": msgs}], room=4, regenerate="all")
    assert isinstance(p, BadLine) and "--regenerate last" in p.reason and "user turn 1" in p.reason


@pytest.mark.parametrize("chunk", [7, 1 << 24])  # elements split across reads, and all in one
def test_a_json_array_file_gives_what_its_jsonl_form_gives(tmp_path, tok, monkeypatch, chunk):
    """Conversations in one JSON array (read element by element, never whole) become the
    prompts and loss masks of the same records as JSONL; the record number is the index."""
    from vllm_hidden.inputs import count_records, input_format, sources

    monkeypatch.setattr(sources, "_CHUNK", chunk)
    recs = chat_model.conversations(40)
    arr, lines = reader(tmp_path, tok, recs, "in.json"), reader(tmp_path, tok, recs)
    assert input_format(arr.path) == "json" and input_format(lines.path) == "jsonl"
    got = list(arr)
    assert got == list(lines) and len(got) == 40 and all(isinstance(p, Prompt) for p in got)
    assert count_records(arr.path) == 40
    assert list(reader(tmp_path, tok, [], "empty.json")) == []
