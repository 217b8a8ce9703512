"""Plain vLLM (no vllm-hidden plugin loaded): a new request whose first chunk is ONE token runs
as a Gated-DeltaNet decode from a recycled state slot, so its answer depends on what the
slot's previous owner left. Seen on vLLM 0.26 (vLLM issue 51562, fixed upstream by PR 51565).

    python scripts/repro_one_token.py                  # a 4-layer random Qwen3.5 at Qwen3.6-27B widths
    python scripts/repro_one_token.py --model DIR      # any GDN hybrid (Qwen3.5/3.6, Qwen3-Next)

Each probe is sent alone, then again after other requests have used (and freed) the state
slots; it prints the largest difference of the first generated token's top-20 logprobs between
the two sends. Probes: a one-token prompt, a two-token and a 17-token prompt (controls: they
prefill, and should not move), and a 300-token prompt sent beside a 511-token one under a
512-token step budget (its first chunk is one token). The KV cache is kept to a few blocks so
slots are reused at once (a big cache hides it until the pool wraps around)."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

os.environ["VLLM_PLUGINS"] = "none"  # plain vLLM: no general plugin (vllm-hidden's included) is loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: write a 4-layer random Qwen3.5)")
    ap.add_argument("--work-dir", default="/tmp/repro-one-token")
    ap.add_argument("--blocks", type=int, default=24, help="--num-gpu-blocks-override")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--gdn-prefill-backend", default=None, help="e.g. triton where FlashInfer is not installed")
    ap.add_argument("--result", default=None, help="write the findings as JSON here")
    args = ap.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from vllm_hidden.demo import make_qwen35_model  # only to write the checkpoint; vLLM runs without it

        model = str(make_qwen35_model(os.path.join(args.work_dir, "qwen3_5-4"), num_layers=4, vocab_size=4096))
    import vllm
    from vllm import LLM, SamplingParams

    # a Qwen3.5/3.6 checkpoint is multimodal: its text model alone (as vllm-hidden serves it)
    text_only = {"language_model_only": True} if "ConditionalGeneration" in json.dumps(
        json.load(open(os.path.join(model, "config.json"))).get("architectures")) else {}
    llm = LLM(model=model, dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=4,
              num_gpu_blocks_override=args.blocks, gpu_memory_utilization=0.5, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False, seed=0, **text_only,
              **({"gdn_prefill_backend": args.gdn_prefill_backend} if args.gdn_prefill_backend else {}))
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size if args.model else 4096
    others = [[rng.randrange(10, vocab) for _ in range(rng.randint(50, 400))] for _ in range(8)]

    def top(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    def diff(a, b):
        keys = set(a) & set(b)
        return {"max_abs_logprob_diff": max(abs(a[k] - b[k]) for k in keys) if keys else None,
                "top1_same": max(a, key=a.get) == max(b, key=b.get), "top20_overlap": len(keys)}

    found = {"vllm": vllm.__version__, "model": model, "blocks": args.blocks, "enforce_eager": args.enforce_eager}
    for name, probe in (("1 token", [7]), ("2 tokens", [7, 8]), ("17 tokens", list(range(7, 24)))):
        first = top([probe])[0]
        top(others)  # other requests take and free the slots
        found[name] = diff(first, top([probe])[0])
    b = [rng.randrange(10, vocab) for _ in range(300)]
    alone = top([b])[0]
    top(others)
    paired = top([[rng.randrange(10, vocab) for _ in range(511)], b])[1]  # b's first chunk: 1 token
    found["300 tokens, first chunk of 1"] = diff(alone, paired)
    for k, v in found.items():
        print(f"{k}: {v}")
    if args.result:
        with open(args.result, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
