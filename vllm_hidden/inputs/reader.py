"""Input records -> prompts with their loss masks. Pure (no vLLM): validation happens here,
before the engine sees anything, so every bad record becomes an error record and the run
goes on.

A record holds exactly one of `token_ids` (optionally with a `loss_mask` of the same
length), `text`, `messages` (OpenAI role/content, optional `tools`) or `conversations`
(role/content or ShareGPT from/value turns, optional `tools`); `id` defaults to the record's
0-based line (row) number.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hidden.inputs.chat import MASK_RULES, ChatEncoder, check_messages, normalize_conversations, spans_from_mask
from vllm_hidden.inputs.sources import input_format, parse_json, records

KINDS = ("token_ids", "text", "messages", "conversations")
CHAT_KINDS = ("messages", "conversations")
# how each kind is tokenized (recorded in the manifest)
SPECIAL_TOKENS = {"text": "the tokenizer's own (add_special_tokens=True)",
                  "chat": "written by the chat template (add_special_tokens=False)",
                  "token_ids": "as given"}


@dataclass(frozen=True, slots=True)
class Prompt:
    line: int
    id: Any
    token_ids: list[int]
    # [start, end) token ranges whose loss_mask is 1; None: no mask is stored (--loss-mask none)
    loss_spans: list[tuple[int, int]] | None = None
    # --generate: what the response answers, for generations.jsonl ({"messages", "tools"} of the
    # prompt's turns, or {"text"}; {} for token_ids)
    source: dict[str, Any] | None = None
    # --regenerate all, a conversation of several user turns: per later user turn, the tokens that
    # go between the previous response and the next (`ChatEncoder.encode_turns`) and how many of
    # them are the template's end of an assistant turn
    turns: tuple[tuple[list[int], int], ...] = ()


@dataclass(frozen=True, slots=True)
class BadLine:
    line: int
    id: Any
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "line": self.line, "reason": self.reason}


def mask_rule_for(rule: str | None, kind: str, has_mask: bool) -> str:
    """The loss-mask rule a record of `kind` gets under --loss-mask `rule` (None: the default:
    assistant turns for conversations; the record's own mask, else all, for the others)."""
    if rule == "none":
        return "none"
    if kind in CHAT_KINDS:
        return rule or "assistant"
    if has_mask and rule != "all":
        return "given"
    if rule in ("assistant", "last-assistant"):
        raise ValueError(f"loss mask {rule!r} needs a messages/conversations record (or token_ids with a "
                         f"loss_mask); this one has {kind}")
    return "all"


def _tools(tools: Any) -> Any:
    """Tools as given, or as a JSON string (how many datasets store them in a table column)."""
    if isinstance(tools, str):
        try:
            return json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"tools is a string but not JSON: {e}") from None
    return tools


class PromptReader:
    """Streams an input file (JSONL or Parquet, never whole) and yields Prompt | BadLine."""

    def __init__(
        self,
        path: str | Path,
        *,
        vocab_size: int,
        max_prompt_len: int,
        tokenizer_loader: Callable[[], Any] | None = None,
        loss_mask: str | None = None,
        columns: dict[str, str] | None = None,
        room: int | None = None,
        regenerate: str = "last",
    ) -> None:
        """`room`: --generate's --max-tokens. A record is then the prompt of a response: a
        conversation up to its last user turn with the generation prompt (a final reply is
        replaced), text or token_ids as they are; its mask covers earlier assistant turns (rule
        assistant), all of it (all) or none of it, and the response is masked by the extractor.
        `regenerate` "all": a conversation keeps its system and user turns only; the prompt is
        the first response's, and the later user turns ride along as `Prompt.turns`."""
        if loss_mask is not None and loss_mask not in MASK_RULES:
            raise ValueError(f"--loss-mask must be one of {', '.join(MASK_RULES)}, got {loss_mask!r}")
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.max_prompt_len = max_prompt_len
        self.loss_mask = loss_mask
        self.columns = dict(columns or {})
        self.room = room
        self.regenerate = regenerate
        self._loader = tokenizer_loader
        self._tok: Any = None
        self._chat: ChatEncoder | str | None = None
        self._seen: set[Any] = set()
        self.kinds: Counter[str] = Counter()  # records read, by kind (the manifest says what the input was)

    @property
    def format(self) -> str:
        return input_format(self.path)

    def tokenizer(self) -> Any:
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

    def _chat_encoder(self) -> ChatEncoder:
        if self._chat is None:
            try:
                self._chat = ChatEncoder(self.tokenizer())
            except ValueError as e:
                self._chat = str(e)
        if isinstance(self._chat, str):
            raise ValueError(self._chat)
        return self._chat

    def __iter__(self) -> Iterator[Prompt | BadLine]:
        for i, obj in records(self.path, self.columns):
            yield self._record(i, obj)

    def parse(self, i: int, raw: bytes | str) -> Prompt | BadLine:
        """One JSONL line (as read from the file)."""
        return self._record(i, parse_json(raw))

    def _record(self, i: int, obj: dict[str, Any] | str) -> Prompt | BadLine:
        if isinstance(obj, str):
            return BadLine(i, i, obj)
        sid = obj.get("id", i)
        if not isinstance(sid, (int, str)) or isinstance(sid, bool):
            return BadLine(i, i, f"id must be a string or an integer, got {sid!r}")
        try:
            ids, spans, source, turns = self._encode(obj)
        except ValueError as e:
            return BadLine(i, sid, str(e))
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer refusing a lone surrogate: this record, not the run
            return BadLine(i, sid, f"cannot tokenize this record: {type(e).__name__}: {e}")
        if not ids:
            return BadLine(i, sid, "prompt has no tokens")
        if len(ids) > self.max_prompt_len:
            return BadLine(i, sid, self._too_long(len(ids)))
        if sid in self._seen:
            return BadLine(i, sid, f"duplicate id {sid!r}")
        self._seen.add(sid)
        return Prompt(i, sid, ids, spans, source, turns)

    def _too_long(self, n: int) -> str:
        if self.room is None:
            return f"prompt has {n} tokens, more than max_model_len {self.max_prompt_len}"
        return (f"prompt has {n} tokens, which leaves no room for --max-tokens {self.room} within max_model_len "
                f"{self.max_prompt_len + self.room}")

    def _encode(self, obj: dict[str, Any]) -> tuple[list[int], list[tuple[int, int]] | None, dict[str, Any] | None,
                                                    tuple[tuple[list[int], int], ...]]:
        """(token ids, loss spans, --generate's source, later turns: `Prompt`'s fields)."""
        keys = [k for k in KINDS if k in obj]
        if len(keys) != 1:
            raise ValueError(f"need exactly one of {', '.join(KINDS)}; got {keys or 'none'}")
        kind = keys[0]
        val = obj[kind]
        if "loss_mask" in obj and kind != "token_ids":
            raise ValueError(f"loss_mask goes with token_ids; this record has {kind}")
        if "tools" in obj and kind not in CHAT_KINDS:
            raise ValueError(f"tools go with messages/conversations; this record has {kind}")
        if self.room is not None:
            return self._encode_prompt(obj, kind, val)
        rule = mask_rule_for(self.loss_mask, kind, "loss_mask" in obj)
        self.kinds[kind] += 1
        if kind == "token_ids":
            ids = self._check_ids(val)
            if rule == "given":
                return ids, spans_from_mask(obj["loss_mask"], len(ids)), None, ()
        elif kind == "text":
            ids = self._text_ids(val)
        else:
            msgs = normalize_conversations(val) if kind == "conversations" else check_messages(val)
            if not msgs:
                return [], None, None, ()
            ids, spans = self._chat_encoder().encode(msgs, _tools(obj.get("tools")), rule)
            self._check_vocab(ids)
            return ids, spans, None, ()
        self._check_vocab(ids)
        return ids, ([(0, len(ids))] if rule == "all" and ids else None), None, ()

    def _text_ids(self, val: Any) -> list[int]:
        if not isinstance(val, str):
            raise ValueError(f"text must be a string, got {type(val).__name__}")
        return list(self.tokenizer()(val)["input_ids"]) if val else []

    def _encode_prompt(self, obj: dict[str, Any], kind: str,
                       val: Any) -> tuple[list[int], list[tuple[int, int]] | None, dict[str, Any],
                                          tuple[tuple[list[int], int], ...]]:
        """--generate: the record as the prompt of a response (see __init__)."""
        rule = self.loss_mask
        self.kinds[kind] += 1
        if kind in CHAT_KINDS:
            msgs = normalize_conversations(val) if kind == "conversations" else check_messages(val)
            users = [j for j, m in enumerate(msgs) if m["role"] == "user"]
            if not users:
                raise ValueError("--generate: the conversation has no user turn to respond to")
            tools = _tools(obj.get("tools"))
            if self.regenerate == "all":  # the target writes every assistant turn: only what it answers is kept
                msgs = [m for m in msgs if m["role"] in ("system", "developer", "user")]
                ids, spans, joints = self._chat_encoder().encode_turns(msgs, tools, rule or "assistant")
                for joint, _ in joints:
                    self._check_vocab(joint)
            else:
                msgs, joints = msgs[: users[-1] + 1], []
                ids, spans = self._chat_encoder().encode_prompt(msgs, tools, rule or "assistant")
            self._check_vocab(ids)
            return ids, spans, {"messages": msgs, **({"tools": tools} if tools is not None else {})}, tuple(joints)
        if kind == "token_ids":
            ids = self._check_ids(val)
            source: dict[str, Any] = {}
        else:
            ids = self._text_ids(val)
            source = {"text": val}
        self._check_vocab(ids)
        if rule == "none":
            return ids, None, source, ()
        if rule == "all":
            return ids, [(0, len(ids))] if ids else [], source, ()
        # the default, assistant and last-assistant: the response only (and a token_ids line's own mask)
        return ids, (spans_from_mask(obj["loss_mask"], len(ids)) if "loss_mask" in obj else []), source, ()

    def _check_ids(self, val: Any) -> list[int]:
        if not isinstance(val, list):
            raise ValueError(f"token_ids must be a list of ints, got {type(val).__name__}")
        if len(val) > self.max_prompt_len:  # before looking at each id: a huge line is refused at once
            raise ValueError(self._too_long(len(val)))
        for t in val:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"token_ids must be ints, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} out of range for vocab size {self.vocab_size}")
        return val

    def _check_vocab(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"tokenizer produced id {bad[0]} outside the model's vocab size {self.vocab_size}")

    def describe(self) -> dict[str, Any]:
        """What the manifest records about the input and how it was tokenized."""
        d: dict[str, Any] = {"format": self.format, "kinds": dict(sorted(self.kinds.items())),
                             "loss_mask": self.loss_mask or "default",
                             **({"prompts": "generate"} if self.room is not None else {}),
                             "special_tokens": {k: v for k, v in SPECIAL_TOKENS.items()
                                                if k == "chat" and any(self.kinds[c] for c in CHAT_KINDS)
                                                or self.kinds[k]}}
        if self.columns:
            d["columns"] = self.columns
        tok = self._tok if self._tok is not None and not isinstance(self._tok, str) else None
        if tok is not None:
            from vllm_hidden.inputs.chat import template_hash

            d["tokenizer"] = getattr(tok, "name_or_path", None) or type(tok).__name__
            d["tokenizer_class"] = type(tok).__name__
            d["chat_template_sha256"] = template_hash(tok)
        return d
