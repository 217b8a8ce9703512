import json
import re
from pathlib import Path

import pytest

from vllm_hidden.inputs import BadLine, Prompt, PromptReader, count_lines, scan_input
from vllm_hidden.inputs.scan import SYSTEMATIC


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


# -- the up-front pass (inputs.scan) -------------------------------------------------------------


def scan(tmp_path, lines, name="in.jsonl", **kw):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return scan_input(PromptReader(p, vocab_size=kw.get("vocab", 100), max_prompt_len=kw.get("max_len", 5),
                                   tokenizer_loader=FakeTok, loss_mask=kw.get("loss_mask"),
                                   columns=kw.get("columns")))


def test_a_wrong_field_on_every_line_stops_the_pass_naming_the_line_and_the_field(tmp_path):
    lines = ["", *(json.dumps({"id": i, "promt": "hello"}) for i in range(3))]  # a blank first line: line 2
    with pytest.raises(ValueError) as e:
        scan(tmp_path, lines)
    assert "in.jsonl line 2: unknown field 'promt' (expected one of token_ids, text, messages, conversations)" \
        in str(e.value) and "all 3 records are bad" in str(e.value), e.value
    # the field named otherwise is read through --input-columns: no longer a mistake
    assert scan(tmp_path, lines, columns={"text": "promt"}).bad == 0


def test_the_systematic_threshold_is_the_first_100_records(tmp_path):
    bad = json.dumps({"token_ids": "1 2 3"})
    good = json.dumps({"token_ids": [1, 2]})
    with pytest.raises(ValueError, match=r"line 1: token_ids must be a list of ints, got str; the first 100 records"):
        scan(tmp_path, [bad] * SYSTEMATIC + [good] * 5)
    s = scan(tmp_path, [bad] * (SYSTEMATIC - 1) + [good] + [bad] * 50)  # one good record among the first 100
    assert (s.records, s.bad, s.first_bad.line) == (SYSTEMATIC + 50, SYSTEMATIC + 49, 0)
    with pytest.raises(ValueError, match="its only record is bad"):
        scan(tmp_path, [bad])
    for content in ([], ["", "  "]):
        with pytest.raises(ValueError, match="holds no records"):
            scan(tmp_path, content)


def test_the_pass_finds_what_the_reader_finds_short_of_tokenizing(tmp_path):
    """The same records through the pass and the reader: every bad one the reader yields without
    tokenizing is counted by the pass, the first of them the same, with the same reason."""
    lines = [
        json.dumps({"id": "ok", "token_ids": [1, 2]}),
        "{not json",
        json.dumps({"id": "e", "token_ids": []}),
        json.dumps({"id": "long", "token_ids": [1] * 6}),
        json.dumps({"id": "oov", "token_ids": [1, 100]}),
        json.dumps({"id": "both", "text": "a", "token_ids": [1]}),
        json.dumps({"id": "ok", "token_ids": [2]}),  # a duplicate
        json.dumps({"id": 1.5, "token_ids": [1]}),
        json.dumps({"id": "m", "token_ids": [1, 2], "loss_mask": [1]}),
        json.dumps({"id": "t", "text": ""}),
        json.dumps({"id": "tools", "text": "a", "tools": []}),
        json.dumps({"id": "role", "messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"id": "sg", "conversations": [{"from": "alien", "value": "x"}]}),
        json.dumps({"id": "noasst", "messages": [{"role": "user", "content": "x"}]}),
        json.dumps({"id": "fine", "text": "a b"}),
    ]
    s = scan(tmp_path, lines)
    yielded = [r for r in read(tmp_path, lines) if isinstance(r, BadLine)]
    assert s.records == len(lines) and s.bad == len(yielded) == len(lines) - 2
    assert s.first_bad == yielded[0]
    assert f"{len(lines)} records checked" in s.describe() and f"; {s.bad} bad" in s.describe()
    assert "the first: line 2 (id 1): invalid JSON" in s.describe(), s.describe()


def test_parquet_rows_are_named_by_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"token_ids": [[1, 2], [1, 500], [3]]}), tmp_path / "in.parquet", row_group_size=2)
    s = scan_input(PromptReader(tmp_path / "in.parquet", vocab_size=100, max_prompt_len=5))
    assert (s.records, s.bad) == (3, 1) and "row 1 (id 1): token id 500" in s.describe(), s.describe()


# -- the example lines of docs/extract.md --------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "extract.md"
SECTION = "## Example input lines"


def docs_examples() -> list[str]:
    """Every fenced block of the section, each one line (a JSONL line as a file holds it)."""
    text = DOCS.read_text()
    assert SECTION in text, f"{DOCS.name} has no {SECTION!r} section"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```json\n(.*?)^```$", body, flags=re.S | re.M)
    for b in blocks:
        assert b.count("\n") == 1, f"an example is one line: {b!r}"
    return [b.strip() for b in blocks]


def test_every_example_line_of_the_docs_is_read_as_documented(tmp_path):
    from tests import chat_model

    tok = chat_model.tokenizer(tmp_path)
    lines = docs_examples()
    recs = [json.loads(line) for line in lines]
    # the section shows each kind and form
    shown = {
        "token_ids with loss_mask": any("token_ids" in r and "loss_mask" in r for r in recs),
        "text": any("text" in r for r in recs),
        "messages with a system turn": any(r.get("messages", [{}])[0].get("role") == "system" for r in recs),
        "messages with tools": any("messages" in r and "tools" in r for r in recs),
        "conversations, role/content": any("role" in t for r in recs for t in r.get("conversations", [])),
        "conversations, ShareGPT": any("from" in t for r in recs for t in r.get("conversations", [])),
        "a string id, an int id, no id": {type(r.get("id")) for r in recs} == {str, int, type(None)},
    }
    assert all(shown.values()), shown
    path = tmp_path / "examples.jsonl"
    path.write_text("".join(line + "\n" for line in lines))

    def reader(**kw):
        return PromptReader(path, vocab_size=1 << 20, max_prompt_len=4096, tokenizer_loader=lambda: tok, **kw)

    s = scan_input(reader())
    assert (s.records, s.bad) == (len(lines), 0), s.describe()
    out = list(reader())
    assert all(isinstance(p, Prompt) for p in out), [p for p in out if isinstance(p, BadLine)]
    for i, (rec, p) in enumerate(zip(recs, out)):
        assert p.id == rec.get("id", i)
        if "token_ids" in rec:
            assert p.token_ids == rec["token_ids"]
            assert [int(any(lo <= t < hi for lo, hi in p.loss_spans)) for t in range(len(p.token_ids))] \
                == rec["loss_mask"]
        elif "text" in rec:
            assert p.token_ids == tok(rec["text"])["input_ids"]
        else:  # the tokens and mask the template gives, worked out independently (tests/chat_model.py)
            ids, mask = chat_model.expected(tok, chat_model.messages_of(rec), rec.get("tools"))
            assert p.token_ids == ids and any(mask), rec["id"]
            assert [int(any(lo <= t < hi for lo, hi in p.loss_spans)) for t in range(len(ids))] == mask, rec["id"]
    # and each is a prompt --generate can answer
    gen = list(reader(room=16))
    assert all(isinstance(p, Prompt) for p in gen), [p for p in gen if isinstance(p, BadLine)]


def _reader(p):
    return PromptReader(p, vocab_size=100, max_prompt_len=50, tokenizer_loader=FakeTok)


def test_a_json_arrays_bad_elements_and_a_broken_tail(tmp_path, monkeypatch):
    from vllm_hidden.inputs import sources

    monkeypatch.setattr(sources, "_CHUNK", 5)
    p = tmp_path / "in.json"
    p.write_text('[{"id": "a", "token_ids": [1, 2]}, [3], {"id": "b", "token_ids": []},\n'
                 ' {"id": "c", "token_ids": [4]} {"id": "d", "token_ids": [5]}]')
    out = list(_reader(p))
    assert out[0] == Prompt(0, "a", [1, 2], [(0, 2)])
    assert isinstance(out[1], BadLine) and "array element is not a JSON object (got list)" in out[1].reason
    assert isinstance(out[2], BadLine) and out[2].reason == "prompt has no tokens"
    assert out[3] == Prompt(3, "c", [4], [(0, 1)])
    # a missing comma: what follows cannot be found, so one error record ends the file
    assert len(out) == 5 and isinstance(out[4], BadLine) and "expected ',' or ']'" in out[4].reason
    p.write_text('[{"id": "a", "token_ids": [1]}, {"id": "b", "tok')  # cut off mid-element
    out = list(_reader(p))
    assert out[0] == Prompt(0, "a", [1], [(0, 1)])
    assert len(out) == 2 and "invalid JSON in array element 1" in out[1].reason


def test_a_broken_array_element_is_not_read_to_the_end_of_the_file(tmp_path, monkeypatch):
    from vllm_hidden.inputs import sources

    monkeypatch.setattr(sources, "_CHUNK", 64)
    monkeypatch.setattr(sources, "MAX_ARRAY_ELEMENT_CHARS", 1000)
    p = tmp_path / "in.json"
    good = ", ".join(f'{{"id": "x{i}", "token_ids": [1]}}' for i in range(2000))  # ~60 KB after the break
    p.write_text(f'[{{"id": "a", "token_ids": [1]}}, {{"id": "b", "token_ids": [1,, 2]}}, {good}]')
    reads = []
    real_open = open

    def counting_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        read = f.read
        f.read = lambda n=-1: reads.append(n) or read(n)
        return f

    monkeypatch.setattr(sources, "open", counting_open, raising=False)
    out = list(_reader(p))
    assert out[0] == Prompt(0, "a", [1], [(0, 1)])
    assert len(out) == 2 and "array element 1 is not valid JSON within 1,000 characters" in out[1].reason
    assert len(reads) * 64 < 4 * 1000 < p.stat().st_size  # gave up near the cap, not at the end of the file


def test_a_scan_names_an_array_element_by_its_index(tmp_path):
    from vllm_hidden.inputs.scan import where

    p = tmp_path / "in.json"
    p.write_text('[{"token_ids": [1]}]')
    assert where(p, 3) == "array element 3"
    q = tmp_path / "in.jsonl"
    q.write_text('{"token_ids": [1]}\n')
    assert where(q, 3) == "line 4"
