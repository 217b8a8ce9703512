"""Input lines -> prompts. Pure (no vLLM): validation happens here, before the engine sees
anything, so every bad line becomes an error record and the run goes on.

A line is one JSON object: {"id": ..., "token_ids": [...]} | {"id": ..., "text": "..."} |
{"id": ..., "messages": [...]} (chat template applied). `id` defaults to the 0-based line
index.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Prompt:
    line: int
    id: Any
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class BadLine:
    line: int
    id: Any
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "line": self.line, "reason": self.reason}


def count_lines(path: str | Path) -> int:
    n = 0
    last = b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


class PromptReader:
    """Streams a JSONL file line by line (never whole) and yields Prompt | BadLine."""

    def __init__(
        self,
        path: str | Path,
        *,
        vocab_size: int,
        max_prompt_len: int,
        tokenizer_loader: Callable[[], Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.max_prompt_len = max_prompt_len
        self._loader = tokenizer_loader
        self._tok: Any = None
        self._seen: set[Any] = set()

    def _tokenizer(self) -> Any:
        if self._tok is None:
            if self._loader is None:
                self._tok = "text/messages input needs a tokenizer, and none is available"
            else:
                try:
                    self._tok = self._loader()
                except Exception as e:  # noqa: BLE001 - every text line gets this error record
                    self._tok = f"cannot load the model's tokenizer for text/messages input: {e}"
        if isinstance(self._tok, str):  # loading failed once; do not retry per line
            raise ValueError(self._tok)
        return self._tok

    def __iter__(self) -> Iterator[Prompt | BadLine]:
        with open(self.path, "rb") as f:
            for i, raw in enumerate(f):
                if i == 0 and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[len(codecs.BOM_UTF8):]  # files saved by some editors begin with one
                if not raw.strip():
                    continue  # blank lines (e.g. a trailing newline) are not samples
                yield self.parse(i, raw)

    def parse(self, i: int, raw: bytes | str) -> Prompt | BadLine:
        try:
            # decoded as UTF-8 ourselves: json.loads would guess UTF-16/32 from a stray BOM
            obj = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
        except UnicodeDecodeError as e:
            return BadLine(i, i, f"line is not UTF-8: {e}")
        except json.JSONDecodeError as e:
            return BadLine(i, i, f"invalid JSON: {e}")
        if not isinstance(obj, dict):
            return BadLine(i, i, f"line is not a JSON object (got {type(obj).__name__})")
        sid = obj.get("id", i)
        if not isinstance(sid, (int, str)) or isinstance(sid, bool):
            return BadLine(i, i, f"id must be a string or an integer, got {sid!r}")
        try:
            ids = self._token_ids(obj)
        except ValueError as e:
            return BadLine(i, sid, str(e))
        if not ids:
            return BadLine(i, sid, "prompt has no tokens")
        if len(ids) > self.max_prompt_len:
            return BadLine(i, sid, f"prompt has {len(ids)} tokens, more than max_model_len {self.max_prompt_len}")
        if sid in self._seen:
            return BadLine(i, sid, f"duplicate id {sid!r}")
        self._seen.add(sid)
        return Prompt(i, sid, ids)

    def _token_ids(self, obj: dict[str, Any]) -> list[int]:
        keys = [k for k in ("token_ids", "text", "messages") if k in obj]
        if len(keys) != 1:
            raise ValueError(f"need exactly one of token_ids, text, messages; got {keys or 'none'}")
        key = keys[0]
        val = obj[key]
        if key == "token_ids":
            if not isinstance(val, list):
                raise ValueError(f"token_ids must be a list of ints, got {type(val).__name__}")
            if len(val) > self.max_prompt_len:  # before looking at each id: a huge line is refused at once
                raise ValueError(f"prompt has {len(val)} tokens, more than max_model_len {self.max_prompt_len}")
            for t in val:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"token_ids must be ints, got {t!r}")
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"token id {t} out of range for vocab size {self.vocab_size}")
            return val
        if key == "text":
            if not isinstance(val, str):
                raise ValueError(f"text must be a string, got {type(val).__name__}")
            if not val:
                return []
            ids = list(self._tokenizer()(val)["input_ids"])
        else:
            if not isinstance(val, list) or not all(isinstance(m, dict) and "role" in m for m in val):
                raise ValueError("messages must be a list of {role, content} objects")
            if not val:
                return []
            try:
                out = self._tokenizer().apply_chat_template(val, tokenize=True, add_generation_prompt=False)
            except Exception as e:  # template errors name the problem
                raise ValueError(f"chat template failed: {e}") from None
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"tokenizer produced id {bad[0]} outside the model's vocab size {self.vocab_size}")
        return ids
