"""Where input records come from: a JSONL file (one JSON object per line), a JSON file holding
one array of objects (ShareGPT as downloaded; streamed element by element, never whole), or a
Parquet file (one row per sample, read one row group at a time), chosen by the extension
(Parquet) or the file's first character (`[`: an array). All yield (record number, dict |
error text); the record number is the line's 0-based index (JSONL), the element's (array) or
the row's (Parquet), and is what `id` defaults to."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PARQUET_SUFFIXES = (".parquet", ".pq")
# what a record may hold; a Parquet column of another name is mapped to one with --input-columns
FIELDS = ("id", "token_ids", "loss_mask", "text", "messages", "conversations", "tools")


def input_format(path: str | Path) -> str:
    """"parquet" (by extension), "json" (the file begins with `[`: one array) or "jsonl"."""
    if str(path).lower().endswith(PARQUET_SUFFIXES):
        return "parquet"
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:  # not readable: the caller's open says why
        return "jsonl"
    return "json" if head.removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"[") else "jsonl"


def parse_columns(spec: str | dict[str, str] | None) -> dict[str, str]:
    """--input-columns "field=column,..." -> {field: column}; fields are those in FIELDS."""
    if not spec:
        return {}
    if isinstance(spec, dict):
        pairs = list(spec.items())
    else:
        pairs = []
        for part in spec.split(","):
            field, sep, col = part.strip().partition("=")
            if not sep or not field.strip() or not col.strip():
                raise ValueError(f"--input-columns: expected field=column, got {part.strip()!r}")
            pairs.append((field.strip(), col.strip()))
    out: dict[str, str] = {}
    for field, col in pairs:
        if field not in FIELDS:
            raise ValueError(f"--input-columns: unknown field {field!r}; fields are {', '.join(FIELDS)}")
        if field in out:
            raise ValueError(f"--input-columns: field {field!r} given twice")
        out[field] = col
    return out


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("Parquet input needs pyarrow: pip install pyarrow (in a clone of vllm-hidden: "
                          "pip install -e '.[parquet]')") from None
    return pq


def count_records(path: str | Path) -> int:
    """Samples the file holds, for the progress bar (JSONL: lines; Parquet: rows, from its
    footer; an array: its elements, read through)."""
    fmt = input_format(path)
    if fmt == "parquet":
        return _pyarrow_parquet().ParquetFile(str(path)).metadata.num_rows
    if fmt == "json":
        return sum(1 for _ in json_array_records(path))
    return count_lines(path)


def count_lines(path: str | Path) -> int:
    n = 0
    last = b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def jsonl_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Streams the file line by line; blank lines are skipped (not samples)."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            if i == 0 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]  # files saved by some editors begin with one
            if not raw.strip():
                continue
            yield i, parse_json(raw)


# the longest array element (a conversation) read before the element is called invalid
MAX_ARRAY_ELEMENT_CHARS = 64 << 20
_CHUNK = 1 << 24
_SPACE = " \t\r\n"


class _ArrayText:
    """A JSON array file's text, decoded as it is read: `buf[pos:]` is what is not consumed yet."""

    def __init__(self, f: Any) -> None:
        self.f, self.buf, self.pos, self.eof = f, "", 0, False
        self.utf8 = codecs.getincrementaldecoder("utf-8-sig")()  # and drops a leading BOM

    def more(self, at_least: int = 1) -> None:
        """Read on until `at_least` characters are unconsumed (or the file ends)."""
        parts = [self.buf[self.pos:]]
        have = len(parts[0])
        while not self.eof and (have < at_least or len(parts) == 1):
            chunk = self.f.read(_CHUNK)
            self.eof = not chunk
            parts.append(self.utf8.decode(chunk, final=self.eof))
            have += len(parts[-1])
        self.buf, self.pos = "".join(parts), 0

    def peek(self) -> str:
        """The next character that is not white space ("" at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _SPACE:
                self.pos += 1
            if self.pos < len(self.buf) or self.eof:
                return self.buf[self.pos:self.pos + 1]
            self.more()


def json_array_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """A file holding one JSON array of objects, one element decoded at a time (a ShareGPT
    download of a few GB needs a few MB). An element that is not an object is a bad record; a
    file that stops being valid JSON ends with one error record (nothing after it can be found)."""
    dec = json.JSONDecoder()
    with open(path, "rb") as f:
        t = _ArrayText(f)
        i = 0
        try:
            t.more()
            if t.peek() != "[":
                yield 0, "not a JSON array"
                return
            t.pos += 1
            if t.peek() == "]":
                return
            while True:
                while True:
                    try:
                        obj, t.pos = dec.raw_decode(t.buf, t.pos)
                        break
                    except json.JSONDecodeError as e:
                        pending = len(t.buf) - t.pos
                        if t.eof:  # the element is not complete in the whole rest of the file
                            yield i, f"invalid JSON in array element {i}: {e.msg}; the rest of the file is skipped"
                            return
                        if pending > MAX_ARRAY_ELEMENT_CHARS:  # not read to the end of a file of GBs
                            yield i, (f"array element {i} is not valid JSON within {MAX_ARRAY_ELEMENT_CHARS:,} "
                                      f"characters ({e.msg}); the rest of the file is skipped")
                            return
                        t.more(2 * pending)  # each retry on twice the text: linear in the element's size
                yield i, obj if isinstance(obj, dict) else \
                    f"array element is not a JSON object (got {type(obj).__name__})"
                i += 1
                c = t.peek()
                if c == "]":
                    return
                if c != ",":
                    yield i, f"invalid JSON after array element {i - 1}: expected ',' or ']', got {c or 'the end'!r}"
                    return
                t.pos += 1
                t.peek()
        except UnicodeDecodeError as e:
            yield i, f"file is not UTF-8: {e}; the rest of the file is skipped"


def parse_json(raw: bytes | str) -> dict[str, Any] | str:
    try:
        # decoded as UTF-8 ourselves: json.loads would guess UTF-16/32 from a stray BOM
        obj = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except UnicodeDecodeError as e:
        return f"line is not UTF-8: {e}"
    except json.JSONDecodeError as e:
        return f"invalid JSON: {e}"
    if not isinstance(obj, dict):
        return f"line is not a JSON object (got {type(obj).__name__})"
    return obj


def check_input(path: str | Path, columns: dict[str, str]) -> None:
    """What can be checked of an input before the engine starts: a Parquet file's footer
    (readable, holding the mapped columns and one of the kinds)."""
    if input_format(path) == "parquet":
        pq = _pyarrow_parquet()
        try:
            pf = pq.ParquetFile(str(path))
        except Exception as e:  # noqa: BLE001 - pyarrow's own message, with the file named
            raise ValueError(f"--input: {str(path)!r} is not a readable Parquet file: {e}") from None
        _parquet_fields(pf, path, columns)


def _parquet_fields(pf: Any, path: str | Path, columns: dict[str, str]) -> dict[str, str]:
    names = set(pf.schema_arrow.names)
    missing = sorted(col for col in columns.values() if col not in names)
    if missing:
        raise ValueError(f"--input-columns: {str(path)!r} has no column {missing[0]!r} (columns: {sorted(names)})")
    # a mapped field reads its column; an unmapped one a column of its own name, unless that
    # column is mapped to another field (--input-columns messages=conversations)
    want = {f: columns.get(f, f) for f in FIELDS if columns.get(f, f) in names
            and (f in columns or f not in columns.values())}
    if not any(f in want for f in ("token_ids", "text", "messages", "conversations")):
        raise ValueError(f"{str(path)!r}: no column holds token_ids, text, messages or conversations "
                         f"(columns: {sorted(names)}); map one with --input-columns")
    return want


def parquet_records(path: str | Path, columns: dict[str, str]) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """One row group in memory at a time. Columns are mapped to record fields (`columns`:
    field -> column; unmapped fields are read from a column of their own name); a null is an
    absent field, so a table can mix kinds row by row."""
    pf = _pyarrow_parquet().ParquetFile(str(path))
    want = _parquet_fields(pf, path, columns)
    i = 0
    for g in range(pf.num_row_groups):
        table = pf.read_row_group(g, columns=sorted(set(want.values())))
        cols = {f: table.column(c).to_pylist() for f, c in want.items()}
        for r in range(table.num_rows):
            yield i, {f: _without_nulls(v[r]) for f, v in cols.items() if v[r] is not None}
            i += 1


def _without_nulls(v: Any) -> Any:
    """A struct's null field is an absent one: a column of turns holds every key any turn has
    (ShareGPT `from`/`value` beside `role`/`content`, `tool_calls`), null where a turn has none."""
    if isinstance(v, dict):
        return {k: _without_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_without_nulls(x) for x in v]
    return v


def records(path: str | Path, columns: dict[str, str] | None = None) -> Iterator[tuple[int, dict[str, Any] | str]]:
    fmt = input_format(path)
    if fmt == "parquet":
        return parquet_records(path, columns or {})
    recs = json_array_records(path) if fmt == "json" else jsonl_records(path)
    return _renamed(recs, columns) if columns else recs


def _renamed(recs: Iterator[tuple[int, dict[str, Any] | str]],
             columns: dict[str, str]) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """JSONL lines whose keys are named otherwise (--input-columns applies to both formats)."""
    for i, obj in recs:
        if isinstance(obj, dict):
            sources = set(columns.values())
            obj = {**{k: v for k, v in obj.items() if k not in columns and k not in sources},
                   **{f: obj[c] for f, c in columns.items() if c in obj}}
        yield i, obj
