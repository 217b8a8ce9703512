"""`extract --generate`, the driver's side: each prompt's response is sampled by the engine
while the worker captures every row; here it is decided where each response ends.

A normal generation never runs its last sampled token through the model, so that token
would have no row. Instead the engine never stops at EOS (ignore_eos) and is asked for one
token more than --max-tokens; the response is cut here, at the first stop token (or stop
string) or at --max-tokens, once one token more has been sampled (so the model has run the
last kept token), and the request is then aborted. Every kept token has its row, the same
rows a prefill of prompt + response would give; the one token sampled past the end is
dropped. The worker gets each end (rows to keep, token ids, mask spans, the generation
record) in one RPC for many samples and only then writes the sample.

--regenerate all: a conversation's responses are written turn by turn, each a request whose
prompt is the conversation so far as token ids (the earlier responses exactly as sampled, then
the template's end of turn, the next user turn and the generation prompt: `Prompt.turns`).
Only the last turn's request is captured: its prefill computes every earlier row again (the
states of the final token ids), so the earlier turns are plain generation, free to read the
prefix cache. A turn is captured early when the next one might not fit --max-model-len; if
the next one then fits after all, that turn's rows are dropped and the next is captured.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from vllm_hidden.capture.records import ResponseEnd
from vllm_hidden.config import GenerateConfig
from vllm_hidden.inputs import BadLine, Prompt

STOP_WINDOW = 8  # tokens decoded beyond a stop string's length when looking for it


def sample_seed(run_seed: int, sample_id: Any, turn: int = 0) -> int:
    """A response's sampling seed: the same for the same run seed, sample id and turn, whenever
    and wherever (which engine, which batch) it runs, so a sample redone after a crash is the same."""
    key = [run_seed, sample_id] if turn == 0 else [run_seed, sample_id, turn]
    h = hashlib.blake2b(json.dumps(key).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2  # < 2**62: fits every seed field vLLM passes it through


def stop_token_ids(model: str, tokenizer: Any | None) -> set[int]:
    """What ends a response: the tokenizer's EOS and every EOS id of the model's generation
    config (as vLLM stops on them), else the model config's."""
    from transformers import AutoConfig, GenerationConfig

    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(x for x in v if isinstance(x, int))

    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    try:
        add(GenerationConfig.from_pretrained(model).eos_token_id)
    except Exception:  # noqa: BLE001 - no generation_config.json
        pass
    if not ids:
        try:
            add(AutoConfig.from_pretrained(model).get_text_config().eos_token_id)
        except Exception:  # noqa: BLE001
            pass
    return ids


@dataclass(slots=True)
class _Conversation:
    """A sample's responses so far. Without `Prompt.turns` it has one turn (the prompt's reply)."""

    item: Prompt
    ids: list[int]  # the current turn's prompt: every token so far
    turn: int = 0
    spans: list[list[int]] = field(default_factory=list)  # each finished turn's loss span (its end of turn in it)
    done: list[dict[str, Any]] = field(default_factory=list)  # each finished turn: text, token_ids, finish_reason

    @property
    def last(self) -> bool:
        return self.turn == len(self.item.turns)


@dataclass(slots=True)
class _Response:
    conv: _Conversation
    captured: bool
    tokens: list[int] = field(default_factory=list)
    keep: int | None = None  # tokens kept, once known
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """A response's request, for the engine."""

    rid: str
    item: Prompt  # its sample
    token_ids: list[int]
    params: Any
    rows: int  # what it holds in flight: prompt + max tokens


@dataclass(frozen=True, slots=True)
class Ended:
    """A response whose end is known: the worker's word about it (`end`: where its sample ends,
    or that its rows go; None if it was not captured), and the conversation's next turn."""

    rid: str
    line: int  # its input line (how the worker knows it)
    end: ResponseEnd | None
    abort: bool  # still running in the engine (one token past its end): abort it
    rows: int  # the sample's rows once it is complete (0 while its conversation goes on)
    generated: int
    next: Request | None = None
    bad: BadLine | None = None  # the sample failed: its error record


class Responses:
    """The responses in flight: sampling parameters for each turn, and where each ends."""

    def __init__(self, gen: GenerateConfig, stop_ids: set[int], tokenizer: Any | None, *,
                 max_prompt_len: int | None = None, loss_mask: str | None = None) -> None:
        self.gen = gen
        self.stop_ids = set() if gen.ignore_eos else set(stop_ids)
        self.tok = tokenizer
        if gen.stop and tokenizer is None:
            raise ValueError("--stop needs the model's tokenizer, and none could be loaded")
        self._stop_len = max((len(s) for s in gen.stop), default=0)
        self._live: dict[str, _Response] = {}
        self.max_prompt_len = max_prompt_len if max_prompt_len is not None else float("inf")
        self.rule = loss_mask or "assistant"  # a conversation's (the only input with turns)

    def first(self, item: Prompt) -> Request:
        """The request of a sample's first (or only) response."""
        return self._request(_Conversation(item, list(item.token_ids)))

    def _request(self, conv: _Conversation) -> Request:
        from vllm_hidden.engine import compat
        from vllm_hidden.engine.runner import GEN_KEY, LINE_KEY, REQUEST_KEY, TURN_KEY

        g, item, p = self.gen, conv.item, len(conv.ids)
        # captured: the last turn, or one after which the next might not fit (then it may be the last)
        captured = conv.last or p + g.max_tokens + len(item.turns[conv.turn][0]) > self.max_prompt_len
        extra = None
        if captured:
            extra = {REQUEST_KEY: item.id, LINE_KEY: item.line, GEN_KEY: p + g.max_tokens}
            if conv.turn:
                extra[TURN_KEY] = conv.turn
        rid = str(item.line) if conv.turn == 0 else f"{item.line}.{conv.turn}"
        self._live[rid] = _Response(conv, captured)
        params = compat.generate_sampling_params(
            extra, max_tokens=g.max_tokens + captured, temperature=g.temperature,
            top_p=g.top_p, top_k=g.top_k, seed=sample_seed(g.seed, item.id, conv.turn) if g.seed is not None else None)
        return Request(rid, item, conv.ids, params, p + g.max_tokens)

    def forget(self, rid: str) -> None:
        self._live.pop(rid, None)

    def captured(self, rid: str) -> bool:
        r = self._live.get(rid)
        return r is not None and r.captured

    def update(self, rid: str, new: list[int], finished: bool) -> Ended | None:
        """New tokens of request `rid` (and whether the engine finished it): its end once known."""
        r = self._live[rid]
        before = len(r.tokens)
        r.tokens.extend(new)
        m = self.gen.max_tokens
        if r.keep is None:
            for i in range(before, min(len(r.tokens), m)):
                if r.tokens[i] in self.stop_ids or (self.gen.stop and self._stops_at(r.tokens, i)):
                    r.keep, r.reason = i + 1, "stop"
                    break
            else:
                if len(r.tokens) >= m:
                    r.keep, r.reason = m, "length"
        # a captured response ends once its last kept token went through the model; another at once
        if r.keep is not None and (len(r.tokens) > r.keep or not r.captured):
            del self._live[rid]
            return self._ended(rid, r, abort=not finished)
        if finished:  # the engine stopped it before that (it should not): what has rows is kept
            del self._live[rid]
            if len(r.tokens) < 2:
                item, why = r.conv.item, f"the engine ended the response after {len(r.tokens)} tokens"
                drop = ResponseEnd(item.line, r.conv.turn, drop=why) if r.captured else None
                return Ended(rid, item.line, drop, False, 0, 0, bad=BadLine(item.line, item.id, why))
            r.keep, r.reason = len(r.tokens) - 1, "length"
            return self._ended(rid, r, abort=False)
        return None

    def _stops_at(self, tokens: list[int], i: int) -> bool:
        """Whether a stop string ends within token i (it was not complete before it)."""
        lo = max(0, i + 1 - self._stop_len - STOP_WINDOW)
        if self.tok is None:  # stop strings need the tokenizer (GenerateConfig asks for one with them)
            raise RuntimeError("stop strings without a tokenizer to decode the response")
        text = self.tok.decode(tokens[lo : i + 1])
        prev = self.tok.decode(tokens[lo:i])
        return any(s in text and s not in prev for s in self.gen.stop)

    def _text(self, tokens: list[int]) -> str | None:
        return self.tok.decode(tokens, skip_special_tokens=True) if self.tok is not None else None

    def _ended(self, rid: str, r: _Response, abort: bool) -> Ended:
        if r.keep is None or r.reason is None:
            raise RuntimeError(f"request {rid!r} ended before its end was known")
        conv, keep, reason = r.conv, r.keep, r.reason
        item, p = conv.item, len(conv.ids)
        response = r.tokens[:keep]
        conv.done.append({"text": self._text(response), "token_ids": response, "finish_reason": reason})
        stopped = None
        if not conv.last:  # the conversation goes on: the end of this turn and the next user turn, as tokens
            joint, closing = item.turns[conv.turn]
            skip = int(closing > 0 and response[-1] == joint[0])  # the sampled end of turn is the template's
            ids = conv.ids + response + joint[skip:]
            conv.spans.append([p, p + keep + closing - skip])
            if len(ids) <= self.max_prompt_len:
                conv.ids, conv.turn = ids, conv.turn + 1
                nxt = self._request(conv)
                drop = ResponseEnd(item.line, conv.turn - 1, drop="continued") if r.captured else None
                return Ended(rid, item.line, drop, abort, 0, 0, nxt)
            conv.spans.pop()  # the conversation ends here: its last turn has the end it was sampled with
            stopped = (f"user turn {conv.turn + 2}: the conversation would have {len(ids)} tokens before its "
                       f"response, more than max_model_len {self.max_prompt_len + self.gen.max_tokens} leaves "
                       f"room for with --max-tokens {self.gen.max_tokens}")
            if not r.captured:
                raise RuntimeError(f"sample {item.id!r}: turn {conv.turn} was not captured but ends the conversation")
        conv.spans.append([p, p + keep])
        rows, generated = p + keep, sum(len(t["token_ids"]) for t in conv.done)
        return Ended(rid, item.line, self._end(conv, response, rows, generated, reason, stopped), abort, rows,
                     generated)

    def _end(self, conv: _Conversation, response: list[int], rows: int, generated: int, reason: str,
             stopped: str | None) -> ResponseEnd:
        """The worker's word on a finished sample: what it keeps, and its generations.jsonl record."""
        item, p0 = conv.item, len(conv.item.token_ids)
        spans = None
        if item.loss_spans is not None:
            if not item.turns:
                spans = [list(s) for s in item.loss_spans] + conv.spans
            else:
                spans = {"all": [[0, rows]], "last-assistant": conv.spans[-1:]}.get(self.rule, conv.spans)
        src = dict(item.source or {})
        text = conv.done[-1]["text"]
        if "messages" in src:
            src["messages"] = _with_responses(src["messages"], conv.done, bool(item.turns))
        record = {"id": item.id, **src, "response": text, "finish_reason": reason, "num_prompt_tokens": p0,
                  "num_generated_tokens": generated, "response_token_ids": response}
        if item.turns:
            record["turns"] = conv.done
            if stopped is not None:
                record["stopped"] = stopped
        return ResponseEnd(item.line, conv.turn, rows=rows, token_ids=conv.ids + response, loss_spans=spans,
                           num_prompt=p0, record=json.dumps(record, ensure_ascii=False) + "\n")


def _with_responses(messages: list[dict[str, Any]], done: list[dict[str, Any]], turns: bool) -> list[dict[str, Any]]:
    """The conversation as the target wrote it: the response after the prompt's last message,
    or (`turns`) each response right after the user turn it answers, up to the last one."""
    if not turns:
        return [*messages, {"role": "assistant", "content": done[0]["text"]}]
    out: list[dict[str, Any]] = []
    k = end = 0
    for m in messages:
        if m["role"] == "user" and k == len(done):
            break
        out.append(m)
        if m["role"] == "user":
            out.append({"role": "assistant", "content": done[k]["text"]})
            k, end = k + 1, len(out)
    return out[:end]
