"""A multi-turn chat template (system prompt, tools, tool calls and results, several assistant
turns) written here, a tokenizer that has it, and the loss mask it implies, worked out
independently of vllm-hidden: the conversation is rendered here segment by segment (the
template's logic in Python) and each segment tokenized alone, so the assistant segments'
tokens are known without any prefix comparison. The tokenizer splits on whitespace and has
its role and end-of-turn markers as single tokens, so segments tokenize independently."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

MARKERS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
TEMPLATE = (
    "{%- if messages[0].role == 'system' or tools %}<|system|>"
    "{%- if messages[0].role == 'system' %} {{ messages[0].content }}{% endif %}"
    "{%- if tools %} tools :{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %} <|end|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{% if not loop.first %} <|system|> {{ m.content }} <|end|>{% endif %}"
    "{%- elif m.role == 'assistant' %} <|assistant|> {{ m.content }}"
    "{%- if m.tool_calls %} call{% for c in m.tool_calls %} {{ c.function.name }}{% endfor %}{% endif %} <|end|>"
    "{%- elif m.role == 'tool' %} <|user|> result {{ m.content }} <|end|>"
    "{%- else %} <|user|> {{ m.content }} <|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %} <|assistant|>{% endif %}"
)


def add_chat_template(path: str | Path, template: str = TEMPLATE) -> Path:
    """Give the tokenizer saved in `path` the markers as tokens of their own and `template`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = template
    tok.save_pretrained(str(path))
    return Path(path)


def chat_model(src: str | Path, dst: str | Path, template: str = TEMPLATE) -> Path:
    """A copy of the tiny model `src` whose tokenizer has the chat template."""
    dst = Path(dst)
    if not dst.exists():
        shutil.copytree(src, dst)
        add_chat_template(dst, template)
    return dst


def tokenizer(tmp_path: Path, template: str = TEMPLATE):
    """A tokenizer alone (no model), for unit tests."""
    from transformers import AutoTokenizer

    from vllm_hidden.demo import write_tokenizer

    path = tmp_path / "tok"
    path.mkdir(exist_ok=True)
    write_tokenizer(path, 512, 0)
    add_chat_template(path, template)
    return AutoTokenizer.from_pretrained(str(path))


def _segments(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[tuple[str, bool]]:
    """(text, is an assistant turn's own tokens), in order: the template above, in Python."""
    out: list[tuple[str, bool]] = []
    sys_first = messages and messages[0]["role"] == "system"
    if sys_first or tools:
        head = "<|system|>"
        if sys_first:
            head += " " + messages[0]["content"]
        if tools:
            head += " tools :" + "".join(" " + t["function"]["name"] for t in tools)
        out.append((head + " <|end|>", False))
    for j, m in enumerate(messages):
        if m["role"] == "system":
            if j:
                out.append((f" <|system|> {m['content']} <|end|>", False))
        elif m["role"] == "assistant":
            calls = "".join(" " + c["function"]["name"] for c in m.get("tool_calls") or [])
            out.append((" <|assistant|>", False))
            out.append((f" {m['content']}" + (f" call{calls}" if calls else "") + " <|end|>", True))
        elif m["role"] == "tool":
            out.append((f" <|user|> result {m['content']} <|end|>", False))
        else:
            out.append((f" <|user|> {m['content']} <|end|>", False))
    return out


def expected(tok, messages: list[dict[str, Any]], tools=None, rule: str = "assistant") -> tuple[list[int], list[int]]:
    """(token ids, loss mask 0/1 per token) under `rule` (assistant | last-assistant | all)."""
    ids: list[int] = []
    mask: list[int] = []
    segs = _segments(messages, tools)
    last = max((k for k, (_, a) in enumerate(segs) if a), default=-1)
    for k, (text, is_assistant) in enumerate(segs):
        seg = tok(text, add_special_tokens=False)["input_ids"]
        on = rule == "all" or (is_assistant and (rule == "assistant" or k == last))
        ids += seg
        mask += [int(on)] * len(seg)
    return ids, mask


def to_sharegpt(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    who = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": who[m["role"]], "value": m["content"]} for m in messages]


TOOLS = [{"type": "function", "function": {"name": "lookup",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` records: multi-turn conversations (some with a system prompt, some with tools, tool
    calls and results), as messages, ShareGPT and role/content conversations."""
    import random

    rng = random.Random(seed)
    words = list("abcdefghijklmnopqrstuvwxyz")  # in the tiny tokenizer's vocabulary (most other words are <unk>)

    def say(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    out = []
    for i in range(n):
        msgs: list[dict[str, Any]] = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": say(rng.randint(2, 6))})
        tools = TOOLS if i % 4 == 1 else None
        for t in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": say(rng.randint(3, 12))})
            if tools and t == 0:
                msgs.append({"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": "{}"}}]})
                msgs.append({"role": "tool", "content": say(3)})
            msgs.append({"role": "assistant", "content": say(rng.randint(3, 20))})
        rec: dict[str, Any] = {"id": f"c{i}"}
        if tools:
            rec.update(messages=msgs, tools=tools)
        elif i % 3 == 2:
            rec["conversations"] = to_sharegpt(msgs)
        elif i % 3 == 1:
            rec["conversations"] = msgs
        else:
            rec["messages"] = msgs
        out.append(rec)
    return out


def messages_of(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's turns as messages (ShareGPT mapped back)."""
    turns = rec.get("messages") or rec["conversations"]
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": role[t["from"]], "content": t["value"]} if "from" in t else t for t in turns]
