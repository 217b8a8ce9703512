"""Conversations -> token ids and loss-mask spans, with the model's own chat template.

The assistant spans are found without relying on generation markers in the template: for
each assistant turn j the conversation is rendered up to it with the generation prompt
(`before`) and up to and including it (`after`); both renderings must be prefixes of the
whole conversation's rendering, and the turn's tokens are those whose characters lie between
the two ends. The whole rendering is tokenized once (with character offsets), so the mask is
of the sample's own tokens.

Thinking templates render a turn differently once later turns exist (only the last
assistant turn gets an empty think block; earlier turns lose their reasoning), which fails
the prefix test at the turn's end. The end is then found from the conversation through the
turn followed by a user turn (a marker as its content), which renders the turn as within
the whole and must be a prefix of the whole up to that user turn's header. Failing that, the
turn is located by rendering the whole conversation with its content replaced by a marker:
outside the marker's place that rendering must equal the real one, so what stands there is
the turn's content as written, followed by what the template writes after a turn's content
(`_by_slot`; a turn placed this way starts at its content: text the template writes between
the role header and the content, such as an empty think block, is left out). Either way the
sample's own rendering decides; anything else (a token across
a turn's boundary, a turn no method can place) makes the sample an error record naming the
turn, never a silently wrong mask. What a template dropped (earlier reasoning) is not in the
sample, so it is not in the mask either.

A turn's span is everything the template writes for it after the generation prompt (or its
role header): its content, its end-of-turn token and whatever follows that (for Qwen's
ChatML `<|im_end|>` and its newline), as SpecForge and vllm-project/speculators mark it.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
MASK_RULES = ("assistant", "last-assistant", "all", "none")
_SLOT = "\ue000vllm-hidden-turn\ue000"  # stands in for a turn's content (private-use characters)


def normalize_conversations(turns: Any) -> list[dict[str, Any]]:
    """`conversations`: turns of {role, content} or ShareGPT {from, value} -> messages."""
    if not isinstance(turns, list):
        raise ValueError(f"conversations must be a list of turns, got {type(turns).__name__}")
    out = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict):
            raise ValueError(f"conversations turn {j} must be an object, got {type(t).__name__}")
        if "from" in t:
            who = t["from"]
            role = SHAREGPT_ROLES.get(who) if isinstance(who, str) else None
            if role is None:
                raise ValueError(f"conversations turn {j}: unknown ShareGPT 'from' {who!r} "
                                 f"(expected one of {', '.join(SHAREGPT_ROLES)})")
            if "value" not in t:
                raise ValueError(f"conversations turn {j}: a ShareGPT turn needs 'value', got keys {sorted(t)}")
            out.append({"role": role, "content": t["value"]})
        else:
            out.append(t)
    return check_messages(out, "conversations")


def check_messages(messages: Any, key: str = "messages") -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise ValueError(f"{key} must be a list of {{role, content}} objects, got {type(messages).__name__}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"{key} turn {j} must be a {{role, content}} object, got {str(m)[:80]!r}")
        if m["role"] not in ROLES:
            raise ValueError(f"{key} turn {j}: unknown role {m['role']!r} (expected one of {', '.join(ROLES)})")
        c = m.get("content")
        if not isinstance(c, str) and not (c is None and m["role"] == "assistant" and m.get("tool_calls")):
            raise ValueError(f"{key} turn {j} ({m['role']}): content must be a string, got {type(c).__name__}")
    return messages


def check_tools(tools: Any) -> None:
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"tools must be a list of objects, got {str(tools)[:80]!r}")


def masked_turns(messages: list[dict[str, Any]], rule: str) -> list[int] | None:
    """The assistant turns loss-mask `rule` marks (None: the rule marks all tokens or none, not
    turns); a rule of turns on a conversation without an assistant turn is an error."""
    if rule in ("all", "none"):
        return None
    turns = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError(f"loss mask {rule!r}: the conversation has no assistant turn")
    return turns[-1:] if rule == "last-assistant" else turns


def template_hash(tokenizer: Any) -> str | None:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # several named templates
        t = "\n".join(f"{k}\n{v}" for k, v in sorted(t.items()))
    return hashlib.sha256(t.encode()).hexdigest() if isinstance(t, str) else None


class ChatEncoder:
    """Renders and tokenizes conversations with `tokenizer`'s chat template (tokens as
    `apply_chat_template(..., tokenize=True)` gives them: the template writes the special
    tokens, none are added)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._header: str | None = None
        self._header_known = False
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the model's tokenizer has no chat template; messages/conversations input needs one")

    def render(self, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - the template's own message names the problem
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from None

    def encode(self, messages: list[dict[str, Any]], tools: Any,
               rule: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """-> (token ids, loss spans [start, end) in tokens, or None under rule 'none')."""
        if not messages:
            raise ValueError("conversation is empty")
        check_tools(tools)
        turns = masked_turns(messages, rule)
        full = self.render(messages, tools, False)
        if turns is None:
            ids = self._ids(full, offsets=False)[0]
            return ids, ([(0, len(ids))] if rule == "all" and ids else None)
        return self._with_spans(messages, tools, turns, full, False)

    def encode_prompt(self, messages: list[dict[str, Any]], tools: Any,
                      rule: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """The prompt of a response to be generated: `messages` rendered with the generation
        prompt; spans of its assistant turns under 'assistant', none under 'last-assistant'
        (the response is the last one), all of it under 'all', None under 'none'."""
        if not messages:
            raise ValueError("conversation is empty")
        check_tools(tools)
        full = self.render(messages, tools, True)
        turns = [j for j, m in enumerate(messages) if m["role"] == "assistant"] if rule == "assistant" else []
        if rule in ("all", "none") or not turns:
            ids = self._ids(full, offsets=False)[0]
            return ids, (None if rule == "none" else [(0, len(ids))] if rule == "all" and ids else [])
        return self._with_spans(messages, tools, turns, full, True)

    def encode_turns(self, messages: list[dict[str, Any]], tools: Any,
                     rule: str) -> tuple[list[int], list[tuple[int, int]] | None, list[tuple[list[int], int]]]:
        """--regenerate all: `messages` (system and user turns only, at least one user turn) as
        the first response's prompt (rendered up to the first user turn with the generation
        prompt; spans as `encode_prompt`), and for each later user turn the tokens that go
        between the previous response and the next one: the template's end of an assistant turn
        (its first `closing` tokens), the turns up to that user turn and the generation prompt.
        Both are read off renderings where each response is a marker, so they are what the
        template writes after a response within the conversation."""
        users = [j for j, m in enumerate(messages) if m["role"] == "user"]
        ids, spans = self.encode_prompt(messages[: users[0] + 1], tools, rule)
        joints = []
        conv: list[dict[str, Any]] = list(messages[: users[0] + 1])
        for a, b in zip(users, users[1:]):
            conv += [{"role": "assistant", "content": _SLOT}]
            ended = self.render(conv, tools, False)
            conv += messages[a + 1 : b + 1]
            text = self.render(conv, tools, True)
            closing = ended[ended.rindex(_SLOT) + len(_SLOT):] if _SLOT in ended else None
            after = text[text.rindex(_SLOT) + len(_SLOT):] if _SLOT in text else None
            if closing is None or after is None or not after.startswith(closing):
                raise ValueError(f"--regenerate all: the chat template does not write the end of an assistant turn "
                                 f"before user turn {b} as it ends a conversation's last turn, so the turns cannot "
                                 "be joined as tokens; use --regenerate last")
            head = self._ids(closing, offsets=False)[0] if closing else []
            joints.append((head + self._ids(after[len(closing):], offsets=False)[0], len(head)))
        return ids, spans, joints

    def _with_spans(self, messages: list[dict[str, Any]], tools: Any, turns: list[int], full: str,
                    generation_prompt: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """`full` (the conversation's rendering, with the generation prompt or not) tokenized, and
        the token spans of assistant turns `turns` in it."""
        ids, offsets = self._ids(full, offsets=True)
        ends = [e for _, e in offsets]
        starts = [s for s, _ in offsets]
        spans = []
        for j in turns:
            lo_char, hi_char = self._by_prefix(messages, tools, j, full)
            if lo_char is not None and hi_char is None:
                hi_char = self._end_by_follow(messages, tools, j, full)
            if lo_char is None or hi_char is None:
                lo_char, hi_char = self._by_slot(messages, tools, j, full, generation_prompt)
            lo = _token_at(starts, ends, lo_char, j, "start")
            hi = _token_at(starts, ends, hi_char, j, "end")
            if hi <= lo:
                raise ValueError(f"assistant turn {j} has no tokens")
            spans.append((lo, hi))
        return ids, spans

    def _by_prefix(self, messages: list[dict[str, Any]], tools: Any, j: int,
                   full: str) -> tuple[int | None, int | None]:
        """Turn j's characters in `full`: from the end of the conversation rendered up to it with
        the generation prompt to the end of the conversation rendered through it; each end None
        unless its rendering is a prefix of the whole."""
        before = self.render(messages[:j], tools, True) if j else self._generation_prompt_only(tools)
        after = self.render(messages[: j + 1], tools, False)
        start = len(before) if before is not None and full.startswith(before) else None
        return start, (len(after) if full.startswith(after) else None)

    def _end_by_follow(self, messages: list[dict[str, Any]], tools: Any, j: int, full: str) -> int | None:
        """Where turn j ends in `full` when the conversation through it is not a prefix of the
        whole because the template treats a last turn differently: the conversation through
        turn j and then a user turn (a marker as its content) must be a prefix of the whole up
        to that user turn's header, so turn j is rendered there as within the whole."""
        header = self._user_header()
        if header is None:
            return None
        text = self.render([*messages[: j + 1], {"role": "user", "content": _SLOT}], tools, False)
        if text.count(_SLOT) != 1:
            return None
        end = text.index(_SLOT) - len(header)
        if end < 0 or text[end : end + len(header)] != header or not full.startswith(text[:end]):
            return None
        return end

    def _user_header(self) -> str | None:
        """What the template writes before a later user turn's content (e.g. `<|im_start|>user\\n`),
        from a one- and a two-user-turn conversation; None if that cannot be told."""
        if not self._header_known:
            self._header_known = True
            try:
                one = self.render([{"role": "user", "content": "x"}], None, False)
                two = self.render([{"role": "user", "content": "x"}, {"role": "user", "content": _SLOT}], None, False)
            except ValueError:  # e.g. a template that insists on alternating roles
                return None
            if two.startswith(one) and two.count(_SLOT) == 1:
                self._header = two[len(one) : two.index(_SLOT)]
        return self._header

    def _by_slot(self, messages: list[dict[str, Any]], tools: Any, j: int, full: str,
                 generation_prompt: bool = False) -> tuple[int, int]:
        """For templates that render a turn differently once later turns exist (thinking
        templates add an empty think block to the last assistant turn only): the whole
        conversation rendered with turn j's content replaced by a marker must equal `full`
        outside the marker's place, so what stands there in `full` is the turn's content as the
        template wrote it; the turn ends with what the template writes after its content (as
        the conversation through it, rendered with the marker, shows), which must follow."""
        slot = [*messages[:j], {**messages[j], "content": _SLOT}, *messages[j + 1:]]
        marked = self.render(slot, tools, generation_prompt)
        through = self.render(slot[: j + 1], tools, False)
        if marked.count(_SLOT) == 1 and through.count(_SLOT) == 1:
            k = marked.index(_SLOT)
            head, tail = marked[:k], marked[k + len(_SLOT):]
            closing = through[through.index(_SLOT) + len(_SLOT):]
            end = len(full) - len(tail)
            if len(head) <= end and full.startswith(head) and full.endswith(tail) and \
                    full.startswith(closing, end):
                return len(head), end + len(closing)
        raise ValueError(f"assistant turn {j}: the chat template renders this turn differently within the whole "
                         "conversation than up to it, and not as its content in one place, so its tokens cannot be "
                         "located")

    def _generation_prompt_only(self, tools: Any) -> str | None:
        """A conversation that begins with an assistant turn: what comes before it is the empty
        conversation's rendering with the generation prompt, if the template renders one (many
        read messages[0]); None (unknown, so the turn is placed by its content) otherwise."""
        try:
            text = self.render([], tools, True)
        except ValueError:
            return None
        return text or None

    def _ids(self, text: str, offsets: bool) -> tuple[list[int], list[tuple[int, int]]]:
        try:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=offsets)
        except NotImplementedError:
            raise ValueError(f"the tokenizer ({type(self.tok).__name__}) gives no character offsets, which loss masks "
                             "from a chat template need; use --loss-mask all or none") from None
        ids = list(enc["input_ids"])
        if not offsets:
            return ids, []
        offs = [tuple(o) for o in enc["offset_mapping"]]
        return ids, offs


def _token_at(starts: list[int], ends: list[int], char: int, turn: int, which: str) -> int:
    """The index of the first token at or after character `char`, which must fall on a token
    boundary (no token both before and after it)."""
    k = bisect.bisect_left(starts, char)
    if k > 0 and ends[k - 1] > char:
        raise ValueError(f"assistant turn {turn}: a token spans the turn's {which} (character {char}); "
                         "the tokenizer merges across the template's boundary, so no exact mask exists")
    return k


def spans_from_mask(mask: Any, n: int) -> list[tuple[int, int]]:
    """A per-token 0/1 mask (a line's `loss_mask`) -> spans [start, end) of ones."""
    if not isinstance(mask, list):
        raise ValueError(f"loss_mask must be a list of 0/1, got {type(mask).__name__}")
    if len(mask) != n:
        raise ValueError(f"loss_mask has {len(mask)} values for {n} token_ids")
    spans = []
    start = None
    for t, v in enumerate(mask):
        if v not in (0, 1) or isinstance(v, float):
            raise ValueError(f"loss_mask values must be 0/1 or booleans, got {v!r} at {t}")
        if v and start is None:
            start = t
        elif not v and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, n))
    return spans
