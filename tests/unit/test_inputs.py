import json

from vllm_hidden.inputs import BadLine, Prompt, PromptReader, count_lines


class FakeTok:
    """Whitespace 'tokenizer' (the engine-level tests use a real HF tokenizer)."""

    def __call__(self, text):
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return {"input_ids": [len(m["content"]) for m in messages]}


def read(tmp_path, lines, **kw):
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return list(PromptReader(p, vocab_size=kw.get("vocab", 100), max_prompt_len=kw.get("max_len", 5),
                             tokenizer_loader=FakeTok, loss_mask=kw.get("loss_mask")))


def test_good_lines_and_default_ids(tmp_path):
    out = read(tmp_path, [json.dumps({"token_ids": [1, 2]}), json.dumps({"id": "x", "text": "ab cde"}),
                          json.dumps({"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})])
    # the default mask: all tokens for text/token_ids, unless the line carries one
    assert out == [Prompt(0, 0, [1, 2], [(0, 2)]), Prompt(1, "x", [2, 3], [(0, 2)]), Prompt(2, 2, [1, 2, 3], [(1, 3)])]
    out = read(tmp_path, [json.dumps({"token_ids": [1, 2]}), json.dumps({"token_ids": [1, 2], "loss_mask": [1, 0]})],
               loss_mask="none")
    assert out == [Prompt(0, 0, [1, 2], None), Prompt(1, 1, [1, 2], None)]


def test_bad_lines_become_error_records(tmp_path):
    lines = [
        "{not json",
        json.dumps({"id": "e", "token_ids": []}),
        json.dumps({"id": "long", "token_ids": [1] * 6}),
        json.dumps({"id": "oov", "token_ids": [1, 100]}),
        json.dumps({"id": "none"}),
        json.dumps({"id": "both", "text": "a", "token_ids": [1]}),
        json.dumps([1, 2]),
        json.dumps({"id": "ok", "token_ids": [1]}),
        json.dumps({"id": "ok", "token_ids": [2]}),
        json.dumps({"id": "neg", "token_ids": [-1]}),
        json.dumps({"id": "emptytext", "text": ""}),
    ]
    out = read(tmp_path, lines)
    bad = {b.id: b.reason for b in out if isinstance(b, BadLine)}
    assert "invalid JSON" in bad[0]
    assert bad["e"] == "prompt has no tokens"
    assert "6 tokens, more than max_model_len 5" in bad["long"]
    assert "token id 100 out of range for vocab size 100" in bad["oov"]
    assert "need exactly one of" in bad["none"] and "need exactly one of" in bad["both"]
    assert "not a JSON object" in bad[6]
    assert "token id -1 out of range" in bad["neg"]
    assert bad["emptytext"] == "prompt has no tokens"
    assert [p for p in out if isinstance(p, Prompt)] == [Prompt(7, "ok", [1], [(0, 1)])]
    assert any(b.reason == "duplicate id 'ok'" for b in out if isinstance(b, BadLine))


def test_count_lines(tmp_path):
    p = tmp_path / "a"
    p.write_bytes(b"a\nb\nc")
    assert count_lines(p) == 3
    p.write_bytes(b"a\nb\n")
    assert count_lines(p) == 2


def test_text_without_a_tokenizer_is_an_error_record(tmp_path):
    def broken():
        raise OSError("no tokenizer files")

    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps({"id": "t", "text": "hi"}) + "\n" + json.dumps({"id": "k", "token_ids": [1]}) + "\n")
    out = list(PromptReader(p, vocab_size=10, max_prompt_len=5, tokenizer_loader=broken))
    assert isinstance(out[0], BadLine) and "cannot load the model's tokenizer" in out[0].reason
    assert out[1] == Prompt(1, "k", [1], [(0, 1)])


def test_empty_and_blank_only_files_give_nothing(tmp_path):
    for content in (b"", b"\n  \n\r\n\n", b"\xef\xbb\xbf\n"):
        p = tmp_path / "in.jsonl"
        p.write_bytes(content)
        assert list(PromptReader(p, vocab_size=100, max_prompt_len=5, tokenizer_loader=FakeTok)) == [], content
