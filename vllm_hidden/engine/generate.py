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
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from vllm_hidden.config import GenerateConfig
from vllm_hidden.inputs import BadLine, Prompt

STOP_WINDOW = 8  # tokens decoded beyond a stop string's length when looking for it


def sample_seed(run_seed: int, sample_id: Any) -> int:
    """A sample's sampling seed: the same for the same run seed and id, whenever and wherever
    (which engine, which batch) the sample runs, so a sample redone after a crash is the same."""
    h = hashlib.blake2b(json.dumps([run_seed, sample_id]).encode(), digest_size=8).digest()
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
class _Response:
    item: Prompt
    tokens: list[int] = field(default_factory=list)
    keep: int | None = None  # tokens kept, once known
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Ended:
    """A response whose end is known: its sample, ready for the worker (`end`)."""

    rid: str
    line: int  # its input line (how the worker knows it)
    end: dict[str, Any]
    abort: bool  # still running in the engine (one token past its end): abort it
    rows: int
    generated: int


class Responses:
    """The responses in flight: sampling parameters for each prompt, and where each ends."""

    def __init__(self, gen: GenerateConfig, stop_ids: set[int], tokenizer: Any | None) -> None:
        self.gen = gen
        self.stop_ids = set() if gen.ignore_eos else set(stop_ids)
        self.tok = tokenizer
        if gen.stop and tokenizer is None:
            raise ValueError("--stop needs the model's tokenizer, and none could be loaded")
        self._stop_len = max((len(s) for s in gen.stop), default=0)
        self._live: dict[str, _Response] = {}

    def params(self, rid: str, item: Prompt, extra: dict[str, Any]):
        from vllm_hidden.engine import compat
        from vllm_hidden.engine.runner import GEN_KEY

        g = self.gen
        self._live[rid] = _Response(item)
        extra = {**extra, GEN_KEY: len(item.token_ids) + g.max_tokens}
        return compat.generate_sampling_params(
            extra, max_tokens=g.max_tokens + 1, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
            seed=sample_seed(g.seed, item.id) if g.seed is not None else None)

    def forget(self, rid: str) -> None:
        self._live.pop(rid, None)

    def update(self, rid: str, new: list[int], finished: bool) -> Ended | BadLine | None:
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
        if r.keep is not None and len(r.tokens) > r.keep:  # the last kept token went through the model
            del self._live[rid]
            return self._ended(rid, r, abort=not finished)
        if finished:  # the engine stopped it before that (it should not): what has rows is kept
            del self._live[rid]
            if len(r.tokens) < 2:
                return BadLine(r.item.line, r.item.id, f"the engine ended the response after {len(r.tokens)} tokens")
            r.keep, r.reason = len(r.tokens) - 1, "length"
            return self._ended(rid, r, abort=False)
        return None

    def _stops_at(self, tokens: list[int], i: int) -> bool:
        """Whether a stop string ends within token i (it was not complete before it)."""
        lo = max(0, i + 1 - self._stop_len - STOP_WINDOW)
        text = self.tok.decode(tokens[lo : i + 1])
        prev = self.tok.decode(tokens[lo:i])
        return any(s in text and s not in prev for s in self.gen.stop)

    def _ended(self, rid: str, r: _Response, abort: bool) -> Ended:
        item, keep = r.item, r.keep
        p = len(item.token_ids)
        response = r.tokens[:keep]
        spans = None
        if item.loss_spans is not None:
            spans = [list(s) for s in item.loss_spans] + [[p, p + keep]]
        text = self.tok.decode(response, skip_special_tokens=True) if self.tok is not None else None
        src = dict(item.source or {})
        if "messages" in src:
            src["messages"] = [*src["messages"], {"role": "assistant", "content": text}]
        record = {"id": item.id, **src, "response": text, "finish_reason": r.reason, "num_prompt_tokens": p,
                  "num_generated_tokens": keep, "response_token_ids": response}
        end = {"rows": p + keep, "token_ids": item.token_ids + response, "loss_spans": spans, "num_prompt": p,
               "record": json.dumps(record, ensure_ascii=False) + "\n"}
        return Ended(rid, item.line, end, abort, p + keep, keep)
