"""Input-side throughput on ONE CPU core: conversations -> token ids + loss masks (the model's
chat template, `vllm_hidden.inputs.PromptReader`), in tokens/s, against what the GPUs consume
(Qwen3.6-27B prefill: ~11,800 tok/s per H200, so four GPUs need ~47,000 tok/s; target 60,000).

No tokenizer is downloaded: a byte-level BPE (32k merges, the GPT-2/Qwen pre-tokenizer) is
trained here on English text found on this machine, with a ChatML (Qwen-style) template with
a system prompt and tools. The records: multi-turn conversations, lognormal turn lengths.

    python scripts/bench_inputs.py                     # prints and writes benchmarks/results/cpu-inputs-<time>.json
    python scripts/bench_inputs.py --samples 4000 --turns 4
"""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import benchlib

sys.path.insert(0, str(benchlib.ROOT))  # the package of this checkout

CHATML = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'system' and loop.first %}{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(limit_bytes: int = 30 << 20) -> list[str]:
    """English-ish text from the installed packages' docs and docstrings."""
    import site

    out, n = [], 0
    for base in site.getsitepackages():
        for p in sorted(Path(base).rglob("*")):
            if p.suffix not in (".md", ".rst", ".txt", ".py") or not p.is_file():
                continue
            try:
                t = p.read_text(errors="ignore")
            except OSError:
                continue
            out.append(t)
            n += len(t)
            if n >= limit_bytes:
                return out
    return out


def build_tokenizer(path: Path, texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return fast


def make_records(texts: list[str], n: int, turns: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = " ".join(texts).split()
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [{"type": "function",
              "function": {"name": f"tool_{k}", "description": "looks things up", "parameters": params}}
             for k in range(3)]

    def say(median: int) -> str:
        k = int(min(2000, max(4, rng.lognormvariate(0, 0.8) * median)))
        i = rng.randrange(len(words) - k)
        return " ".join(words[i : i + k])

    recs = []
    for i in range(n):
        msgs = [{"role": "system", "content": say(20)}] if i % 2 == 0 else []
        for _ in range(rng.randint(1, turns)):
            msgs.append({"role": "user", "content": say(40)})
            msgs.append({"role": "assistant", "content": say(100)})
        if i % 3 == 0:
            recs.append({"id": i, "messages": msgs, "tools": tools})
        elif i % 3 == 1:
            sharegpt = {"user": "human", "assistant": "gpt"}
            recs.append({"id": i, "conversations": [{"from": sharegpt.get(m["role"], m["role"]), "value": m["content"]}
                                                    for m in msgs]})
        else:
            recs.append({"id": i, "conversations": msgs})
    return recs


def measure(path: Path, tok, rule: str | None, vocab: int) -> dict:
    from vllm_hidden.inputs import BadLine, PromptReader

    reader = PromptReader(path, vocab_size=vocab, max_prompt_len=1 << 20, tokenizer_loader=lambda: tok, loss_mask=rule)
    t0 = time.perf_counter()
    tokens = samples = bad = 0
    for p in reader:
        if isinstance(p, BadLine):
            bad += 1
            continue
        tokens += len(p.token_ids)
        samples += 1
    dt = time.perf_counter() - t0
    return {"rule": rule or "default (assistant)", "samples": samples, "errors": bad, "tokens": tokens,
            "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1), "samples_per_s": round(samples / dt, 1)}


def main() -> None:
    ap = benchlib.parser(__doc__)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=3, help="most user/assistant turn pairs per conversation")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--work-dir", default=str(benchlib.ROOT / ".bench" / "inputs"))
    ap.add_argument("--result", default=None)
    a = ap.parse_args()
    # one core, and the tokenizer's own thread pool off: a per-core figure
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    t0 = time.perf_counter()
    tok = build_tokenizer(work / "tok", texts, a.vocab)
    train_s = time.perf_counter() - t0
    recs = make_records(texts, a.samples, a.turns)
    inp = work / "conversations.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ids_inp = work / "token_ids.jsonl"
    rows = []
    for rule in (None, "last-assistant", "all", "none"):
        rows.append(measure(inp, tok, rule, len(tok)))
        print(json.dumps(rows[-1]), flush=True)
    # the same tokens as token_ids lines (parse + validate only): the floor of the input path
    from vllm_hidden.inputs import Prompt, PromptReader

    with open(ids_inp, "w") as f:
        for p in PromptReader(inp, vocab_size=len(tok), max_prompt_len=1 << 20, tokenizer_loader=lambda: tok):
            if isinstance(p, Prompt):
                f.write(json.dumps({"id": p.id, "token_ids": p.token_ids}) + "\n")
    rows.append({**measure(ids_inp, tok, None, len(tok)), "rule": "token_ids lines (default mask: all)"})
    print(json.dumps(rows[-1]), flush=True)
    result = {"command": benchlib.command_line(__file__), "cpu_core": core,
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
              "versions": benchlib.versions("python", "tokenizers", "transformers"),
              "tokenizer": f"byte-level BPE trained here, vocab {len(tok)}, ChatML template with tools",
              "tokenizer_train_seconds": round(train_s, 1), "samples": a.samples, "max_turn_pairs": a.turns,
              "mean_tokens_per_sample": round(rows[0]["tokens"] / max(1, rows[0]["samples"]), 1), "runs": rows,
              "target_tokens_per_s": 60000}
    path = benchlib.result_path(a.result, f"cpu-inputs-{benchlib.stamp()}.json")
    benchlib.write_json(path, result, end="\n")
    print(f"bench_inputs: {path}")


if __name__ == "__main__":
    main()
