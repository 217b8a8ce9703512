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

from vllm_hidden.inputs.chat import (
    MASK_RULES,
    ChatEncoder,
    check_messages,
    check_tools,
    masked_turns,
    normalize_conversations,
    spans_from_mask,
)
from vllm_hidden.inputs.sources import FIELDS, input_format, parse_json, records

KINDS = ("token_ids", "text", "messages", "conversations")
CHAT_KINDS = ("messages", "conversations")
NO_TOKENS = "prompt has no tokens"
# rules under which a token_ids record's own loss_mask is read: "given" (prefill), and under
# --generate the default and the assistant rules (its prompt's mask beside the response's)
OWN_MASK = (None, "given", "assistant", "last-assistant")
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


@dataclass(frozen=True, slots=True)
class Record:
    """A record whose fields passed every check that needs no tokenizer (`PromptReader.check`):
    its kind and value (token ids; text; a conversation as messages, ShareGPT turns normalized,
    under --generate cut to what the response answers), its parsed tools, the loss-mask rule
    of its own tokens, and a token_ids record's loss spans."""

    line: int
    id: Any
    kind: str
    value: Any
    tools: Any = None
    rule: str | None = None
    spans: list[tuple[int, int]] | None = None


def duplicate(sid: Any) -> str:
    return f"duplicate id {sid!r}"


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
            yield self.prompt(i, obj)

    def forget_ids(self) -> None:
        """Duplicate ids are found among the records read since this call (a stream that goes
        back to an earlier record reads it again)."""
        self._seen.clear()

    def parse(self, i: int, raw: bytes | str) -> Prompt | BadLine:
        """One JSONL line (as read from the file)."""
        return self.prompt(i, parse_json(raw))

    def check(self, i: int, obj: dict[str, Any] | str) -> Record | BadLine:
        """Record `i` (a dict, or the text of why its line is not one) checked for everything
        that needs no tokenizer: its id, kind, fields and their types, token ids against the
        vocabulary and --max-model-len, its loss mask, its turns and tools (and counts the
        kinds it sees, for `describe`). Duplicate ids are the caller's to find (`duplicate`).
        What reading the file yields, and the up-front pass over it (`inputs.scan`), both go
        through here."""
        if isinstance(obj, str):
            return BadLine(i, i, obj)
        sid = obj.get("id", i)
        if not isinstance(sid, (int, str)) or isinstance(sid, bool):
            return BadLine(i, i, f"id must be a string or an integer, got {sid!r}")
        try:
            return self._fields(i, sid, obj)
        except ValueError as e:
            return BadLine(i, sid, str(e))

    def prompt(self, i: int, obj: dict[str, Any] | str) -> Prompt | BadLine:
        """Record `i` (as `inputs.sources.records` yields it) checked and tokenized."""
        rec = self.check(i, obj)
        if isinstance(rec, BadLine):
            return rec
        try:
            ids, spans, source, turns = self._encode(rec)
        except ValueError as e:
            return BadLine(i, rec.id, str(e))
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer refusing a lone surrogate: this record, not the run
            return BadLine(i, rec.id, f"cannot tokenize this record: {type(e).__name__}: {e}")
        if not ids:
            return BadLine(i, rec.id, NO_TOKENS)
        if len(ids) > self.max_prompt_len:
            return BadLine(i, rec.id, self._too_long(len(ids)))
        if rec.id in self._seen:
            return BadLine(i, rec.id, duplicate(rec.id))
        self._seen.add(rec.id)
        return Prompt(i, rec.id, ids, spans, source, turns)

    def _too_long(self, n: int) -> str:
        if self.room is None:
            return f"prompt has {n} tokens, more than max_model_len {self.max_prompt_len}"
        return (f"prompt has {n} tokens, which leaves no room for --max-tokens {self.room} within max_model_len "
                f"{self.max_prompt_len + self.room}")

    def _kind(self, obj: dict[str, Any]) -> str:
        keys = [k for k in KINDS if k in obj]
        if len(keys) == 1:
            return keys[0]
        unknown = [k for k in obj if k not in FIELDS]
        if keys or not unknown:
            raise ValueError(f"need exactly one of {', '.join(KINDS)}; got {keys or 'none'}")
        # no kind, and a field we do not read: most likely the kind's field, named otherwise
        mapped = f"; --input-columns maps {self.columns}" if self.columns else ""
        raise ValueError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown[:5]))} "
                         f"(expected one of {', '.join(KINDS)}{mapped})")

    def _fields(self, i: int, sid: Any, obj: dict[str, Any]) -> Record:
        kind = self._kind(obj)
        val = obj[kind]
        if "loss_mask" in obj and kind != "token_ids":
            raise ValueError(f"loss_mask goes with token_ids; this record has {kind}")
        if "tools" in obj and kind not in CHAT_KINDS:
            raise ValueError(f"tools go with messages/conversations; this record has {kind}")
        # --generate: the rule of the prompt's own tokens (the response is masked by the extractor)
        rule = mask_rule_for(self.loss_mask, kind, "loss_mask" in obj) \
            if kind in CHAT_KINDS or self.room is None else self.loss_mask
        self.kinds[kind] += 1
        if kind in CHAT_KINDS:
            tools = _tools(obj.get("tools"))
            check_tools(tools)
            chat_rule = mask_rule_for(self.loss_mask, kind, "loss_mask" in obj)
            return Record(i, sid, kind, self._turns(kind, val, chat_rule), tools, chat_rule)
        if kind == "text":
            if not isinstance(val, str):
                raise ValueError(f"text must be a string, got {type(val).__name__}")
            if not val:
                raise ValueError(NO_TOKENS)
            return Record(i, sid, kind, val, rule=rule)
        ids = self._check_ids(val)
        if not ids:
            raise ValueError(NO_TOKENS)
        own = spans_from_mask(obj["loss_mask"], len(ids)) if "loss_mask" in obj and rule in OWN_MASK else None
        return Record(i, sid, kind, ids, rule=rule, spans=self._plain_spans(rule, len(ids), own))

    def _turns(self, kind: str, val: Any, rule: str) -> list[dict[str, Any]]:
        """A conversation's turns as messages; under --generate, what the response answers (see
        __init__)."""
        msgs = normalize_conversations(val) if kind == "conversations" else check_messages(val)
        if self.room is None:
            if not msgs:
                raise ValueError(NO_TOKENS)
            masked_turns(msgs, rule)  # a rule of turns needs an assistant turn
            return msgs
        users = [j for j, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            raise ValueError("--generate: the conversation has no user turn to respond to")
        if self.regenerate == "all":  # the target writes every assistant turn: only what it answers is kept
            return [m for m in msgs if m["role"] in ("system", "developer", "user")]
        return msgs[: users[-1] + 1]

    def _plain_spans(self, rule: str | None, n: int,
                     own: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
        """The loss spans of a token_ids or text prompt of n tokens (`own`: its loss_mask's)."""
        if rule == "none":
            return None
        if rule == "all":
            return [(0, n)]
        if rule == "given":
            return own
        # --generate, the default, assistant and last-assistant: the response only (and the record's own mask)
        return own if own is not None else []

    def _encode(self, rec: Record) -> tuple[list[int], list[tuple[int, int]] | None, dict[str, Any] | None,
                                            tuple[tuple[list[int], int], ...]]:
        """(token ids, loss spans, --generate's source, later turns: `Prompt`'s fields)."""
        generate = self.room is not None
        if rec.kind == "token_ids":
            return rec.value, rec.spans, {} if generate else None, ()
        if rec.kind == "text":
            ids = list(self.tokenizer()(rec.value)["input_ids"])
            self._check_vocab(ids)
            return ids, self._plain_spans(rec.rule, len(ids), None), {"text": rec.value} if generate else None, ()
        enc = self._chat_encoder()
        if rec.rule is None:  # a conversation's rule is always set (`check`)
            raise ValueError(f"record {rec.id!r}: a conversation without a loss-mask rule")
        if not generate:
            ids, spans = enc.encode(rec.value, rec.tools, rec.rule)
            self._check_vocab(ids)
            return ids, spans, None, ()
        joints: list[tuple[list[int], int]] = []
        if self.regenerate == "all":
            ids, spans, joints = enc.encode_turns(rec.value, rec.tools, rec.rule)
            for joint, _ in joints:
                self._check_vocab(joint)
        else:
            ids, spans = enc.encode_prompt(rec.value, rec.tools, rec.rule)
        self._check_vocab(ids)
        source = {"messages": rec.value, **({"tools": rec.tools} if rec.tools is not None else {})}
        return ids, spans, source, tuple(joints)

    def _check_ids(self, val: Any) -> list[int]:
        if not isinstance(val, list):
            raise ValueError(f"token_ids must be a list of ints, got {type(val).__name__}")
        if len(val) > self.max_prompt_len:  # before looking at each id: a huge line is refused at once
            raise ValueError(self._too_long(len(val)))
        # the common case at C speed (a bool's type is bool, not int); the loop names what is wrong
        if not val or set(map(type, val)) == {int} and min(val) >= 0 and max(val) < self.vocab_size:
            return val
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
