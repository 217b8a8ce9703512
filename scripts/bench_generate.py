"""Responses and their states: the two-pass pipeline every recipe runs today (plain vLLM
generates the responses, then `vllm-hidden extract` prefills prompt + response again) against
one pass (`vllm-hidden extract --generate`), on the same prompts and engine settings.

    # GPU host, Qwen3.6-27B text dims (random weights), the W-chat workload's prompts, 256 tokens each:
    python scripts/bench_generate.py --qwen36-27b --max-tokens 256
    # multi-turn: each W-chat prompt split into 3 user turns, every turn regenerated, 128 tokens each
    python scripts/bench_generate.py --qwen36-27b --turns 3 --max-tokens 128
    # CPU, tiny random Qwen3-Next:
    python scripts/bench_generate.py --workload small --max-tokens 32

Cases, each in its own process (peak RSS of its process tree sampled):
  generate   plain vLLM: greedy, --ignore-eos, max_tokens as given, nothing captured; writes
             prompt + response as token_ids lines for the second pass. --turns N: conversations
             regenerated turn by turn (each turn as soon as its previous one ends, joined as
             extract joins them), the final conversations written for the second pass
  extract    one engine with capture: first `extract --generate` (one pass, same sampling; with
             --turns, --regenerate all over the conversations), then, with the same engine and
             settings, prefill-only `extract` over the generate case's lines (the two-pass
             pipeline's second pass)
Reported: each wall time (first request in .. last sample durable), two-pass = generate +
second pass, the speed-up of one pass over two, the capture cost of one pass against plain
generation alone, the one pass's peak host RSS against its stated bound, and every output
verified (every sample once, token ids, prompt lengths, generations.jsonl, finite, checksums).
Engine starts are not in any wall time (a real two-pass pipeline starts two engines).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import benchlib
from benchlib import RssPeak


def run_generate(spec: dict, save) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    prompts = json.loads(Path(spec["prompts"]).read_text())
    # the max_model_len extract --generate gives its engine: prompt limit + max tokens + 1
    engine, init = benchlib.start_engine([spec["model"], *spec["engine_args"]], spec["max_model_len"] + 1)
    sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    res = {"engine_init_seconds": init}
    try:
        with RssPeak() as rss:
            dt, outs = benchlib.timed_loop(engine, prompts, lambda i: sp)
    finally:
        engine.engine_core.shutdown()
    by_id = {int(o.request_id): list(o.outputs[0].token_ids) for o in outs}
    benchlib.write_prompts(spec["second_pass_input"], [p + by_id[i] for i, p in enumerate(prompts)])
    Path(spec["responses"]).write_text(json.dumps([by_id[i] for i in range(len(prompts))]))
    gen = sum(map(len, by_id.values()))
    res.update(seconds=dt, generated_tokens=gen, samples=len(outs), generated_tokens_per_s=round(gen / dt, 1),
               peak_rss_bytes_during_run=rss.peak)
    save(res)
    return res


def generations(out: Path) -> dict:
    """An output's generations.jsonl lines by sample id."""
    return {g["id"]: g for g in map(json.loads, (out / "generations.jsonl").read_text().splitlines())}


def chat_workload(model: str, ps: list[list[int]], turns: int, path: Path) -> None:
    """Conversations of `turns` user turns each: prompt i's length in words, split evenly, the
    words drawn from the model's tokenizer (one token each; one is written, with the markers of
    vllm_hidden.demo's chat template as special tokens, if the model has none)."""
    import random

    from transformers import AutoTokenizer

    from vllm_hidden.demo import write_tokenizer

    if not (Path(model) / "tokenizer.json").exists():
        from transformers import AutoConfig

        write_tokenizer(Path(model), AutoConfig.from_pretrained(model).get_text_config().vocab_size, 0)
    tok = AutoTokenizer.from_pretrained(model)
    markers = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    if not set(markers) <= set(tok.all_special_tokens):
        tok.add_special_tokens({"additional_special_tokens": markers})
        tok.save_pretrained(model)
    words = sorted(w for w in tok.get_vocab() if w.isalpha())
    rng = random.Random(0)
    with open(path, "w") as f:
        for i, p in enumerate(ps):
            n = max(1, len(p) // turns)
            msgs = []
            for _ in range(turns):
                msgs += [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(n))},
                         {"role": "assistant", "content": "a written reply"}]  # regenerated, so never read
            f.write(json.dumps({"id": i, "messages": msgs}) + "\n")


def conversations_of(spec: dict) -> list:
    """The conversations' first prompts and joints, as extract reads them (--regenerate all)."""
    from transformers import AutoTokenizer

    from vllm_hidden.inputs import PromptReader

    tok = AutoTokenizer.from_pretrained(spec["model"])
    reader = PromptReader(spec["input"], vocab_size=1 << 30, max_prompt_len=spec["max_model_len"] - spec["max_tokens"],
                          tokenizer_loader=lambda: tok, room=spec["max_tokens"], regenerate="all")
    return list(reader)


def run_generate_turns(spec: dict, save) -> dict:
    """Plain vLLM, conversation by conversation turn by turn: each next turn goes in as soon as
    its previous one ends (at most 2 x max_num_seqs conversations at once, as extract)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    convs = conversations_of(spec)
    engine, init = benchlib.start_engine([spec["model"], *spec["engine_args"]], spec["max_model_len"] + 1,
                                         generate=True)
    sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    res = {"engine_init_seconds": init}
    final: dict[int, list[int]] = {}
    state = {}  # conversation -> (its token ids so far, its turn)
    pending = list(range(len(convs)))[::-1]
    max_inflight = 2 * engine.vllm_config.scheduler_config.max_num_seqs
    room = spec["max_model_len"] - spec["max_tokens"]  # the longest prompt of a turn
    gen = 0
    try:
        with RssPeak() as rss:
            t0 = time.perf_counter()
            while pending or state:
                while pending and len(state) < max_inflight:
                    i = pending.pop()
                    state[i] = (convs[i].token_ids, 0)
                    engine.add_request(f"{i}.0", {"prompt_token_ids": convs[i].token_ids}, sp)
                for o in engine.step():
                    if not o.finished:
                        continue
                    i = int(o.request_id.split(".")[0])
                    ids, k = state.pop(i)
                    r = list(o.outputs[0].token_ids)
                    gen += len(r)
                    if k == len(convs[i].turns):
                        final[i] = ids + r
                        continue
                    joint, closing = convs[i].turns[k]
                    nxt = ids + r + joint[int(closing > 0 and r[-1] == joint[0]):]
                    if len(nxt) > room:  # outgrew --max-model-len: it keeps its completed turns, as extract
                        final[i] = ids + r
                        continue
                    state[i] = (nxt, k + 1)
                    engine.add_request(f"{i}.{k + 1}", {"prompt_token_ids": nxt}, sp)
            dt = time.perf_counter() - t0
    finally:
        engine.engine_core.shutdown()
    finals = [final[i] for i in range(len(convs))]
    benchlib.write_prompts(spec["second_pass_input"], finals)
    Path(spec["responses"]).write_text(json.dumps(finals))
    res.update(seconds=dt, generated_tokens=gen, samples=len(finals), generated_tokens_per_s=round(gen / dt, 1),
               peak_rss_bytes_during_run=rss.peak)
    save(res)
    return res


def verify_turns(out: Path, spec: dict) -> tuple[dict, dict]:
    """Every conversation once, every turn regenerated with max_tokens tokens, its first prompt as
    extract reads it, its rows as many as its tokens, generations.jsonl agreeing; checksums, finite."""
    from vllm_hidden.data import HiddenStatesDataset

    convs = conversations_of(spec)
    ds = HiddenStatesDataset(out)
    gens = generations(out)
    seen, ok, finals = set(), True, {}
    for i in range(len(ds)):
        s = ds[i]
        sid, ids, p = s["id"], s["token_ids"].tolist(), s["num_prompt_tokens"]
        c, g = convs[sid], gens[sid]
        turns = g.get("turns") or [{"token_ids": g["response_token_ids"]}]
        ok = ok and sid not in seen and p == len(c.token_ids) and ids[:p] == c.token_ids
        ok = ok and (len(turns) == len(c.turns) + 1 or "stopped" in g and len(turns) <= len(c.turns))
        ok = ok and all(len(t["token_ids"]) == spec["max_tokens"] for t in turns)
        ok = ok and ids[-spec["max_tokens"]:] == turns[-1]["token_ids"] and s["hidden_states"].shape[0] == len(ids)
        seen.add(sid)
        finals[sid] = ids
    v = benchlib.verify_extract(out, [[]] * len(convs))
    v.pop("token_ids_match")
    v.update(all_samples_present_once=seen == set(range(len(convs))) and len(gens) == len(convs),
             prompts_turns_and_generations_match=ok)
    return v, finals


def verify_generated(out: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every sample once, its prompt then max_tokens generated tokens (--ignore-eos), its
    prompt length in the index, generations.jsonl agreeing with the shards; plus the prefill
    checks (checksums, finite)."""
    from vllm_hidden.data import HiddenStatesDataset

    ds = HiddenStatesDataset(out)
    gens = generations(out)
    seen, ok, responses = set(), True, {}
    for i in range(len(ds)):
        s = ds[i]
        sid, ids, p = s["id"], s["token_ids"].tolist(), s["num_prompt_tokens"]
        ok = ok and sid not in seen and p == len(prompts[sid]) and ids[:p] == prompts[sid]
        ok = ok and len(ids) == p + max_tokens and gens[sid]["response_token_ids"] == ids[p:]
        ok = ok and gens[sid]["num_prompt_tokens"] == p and s["hidden_states"].shape[0] == len(ids)
        seen.add(sid)
        responses[sid] = ids[p:]
    v = benchlib.verify_extract(out, [[]] * len(prompts))  # checksums, finite, bytes (token ids checked above)
    v.pop("token_ids_match")
    v.update(all_samples_present_once=seen == set(range(len(prompts))) and len(gens) == len(prompts),
             prompts_responses_and_generations_match=ok)
    return v, responses


def run_extract(spec: dict, save) -> dict:
    from vllm_hidden.config import ExtractConfig, GenerateConfig
    from vllm_hidden.extract.job import extract_file, start_extractor
    from vllm_hidden.extract.plan import plan_extract

    out = Path(spec["out_dir"])
    shutil.rmtree(out, ignore_errors=True)
    prompts = json.loads(Path(spec["prompts"]).read_text())
    gen = GenerateConfig(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True,
                         regenerate="all" if spec["turns"] > 1 else "last")
    cfg = ExtractConfig(model=spec["model"], input_path=spec["input"], output_dir=str(out / "one-pass"),
                        layers=spec["layers"], max_model_len=spec["max_model_len"], progress=False,
                        engine_args=spec["engine_args"], generate=gen)
    res = {}
    with start_extractor(cfg) as ex:
        res["engine_init_seconds"] = ex.engine_init_seconds
        res["layer_ids"] = ex.layer_ids
        window = ex.generate_window(False)
        res["inflight_window_rows"] = window
        res["inflight_bound_bytes"] = window * len(ex.layer_ids) * ex.info.hidden_size * 2
        with RssPeak() as rss:
            s = extract_file(ex, spec["input"], str(out / "one-pass")).to_dict()
        if spec["turns"] > 1:
            v, finals = verify_turns(out / "one-pass", spec)
            responses = [finals.get(i) for i in range(len(prompts))]
        else:
            v, responses = verify_generated(out / "one-pass", prompts, spec["max_tokens"])
        plain = json.loads(Path(spec["responses"]).read_text()) if Path(spec["responses"]).exists() else None
        res["one_pass"] = {"seconds": s["seconds"], "tokens": s["tokens"], "generated_tokens": s["generated_tokens"],
                           "flush_seconds": s["flush_seconds"], "peak_rss_bytes_during_run": rss.peak,
                           "capture_stats": s["capture_stats"], "verified": v,
                           # greedy on both sides; bf16 numerics differ with the batch, so this is
                           # informational (parity with HF is the GPU test's job)
                           "responses_equal_to_plain": (sum(responses[i] == plain[i] for i in range(len(plain)))
                                                        if plain else None)}
        save(res)
        shutil.rmtree(out / "one-pass")
        if not Path(spec["second_pass_input"]).exists():
            return res
        # the two-pass pipeline's second pass: the same engine and settings, prefill only
        second = replace(cfg, generate=None, input_path=spec["second_pass_input"], output_dir=str(out / "second"))
        ex.reconfigure(second, plan_extract(second))
        two = [json.loads(line)["token_ids"] for line in Path(spec["second_pass_input"]).read_text().splitlines()]
        with RssPeak() as rss:
            s = extract_file(ex, spec["second_pass_input"], str(out / "second")).to_dict()
        res["second_pass"] = {"seconds": s["seconds"], "tokens": s["tokens"], "flush_seconds": s["flush_seconds"],
                              "peak_rss_bytes_during_run": rss.peak,
                              "verified": benchlib.verify_extract(out / "second", two)}
        save(res)
        shutil.rmtree(out / "second")
    return res


def child(spec_path: str) -> None:
    spec, save = benchlib.child_spec(spec_path)
    if spec["case"] == "generate" and spec["turns"] > 1:
        run_generate_turns(spec, save)
        return
    {"generate": run_generate, "extract": run_extract}[spec["case"]](spec, save)


def main() -> None:
    ap = benchlib.model_parser(__doc__)
    ap.add_argument("--workload", default="w-chat", help=f"one of {sorted(benchlib.WORKLOADS)}")
    ap.add_argument("--max-tokens", type=int, default=256, help="per response (per turn with --turns)")
    ap.add_argument("--turns", type=int, default=1, help="user turns per conversation (>1: conversations, "
                    "every turn regenerated)")
    ap.add_argument("--cases", default="generate,extract")
    ap.add_argument("--layers", default=None, help="layer ids (default: the DFlash default for the model)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="prompt + response (as extract --generate)")
    ap.add_argument("--work-dir", default=str(benchlib.ROOT / ".bench"))
    ap.add_argument("--engine-arg", action="append", default=[], help="passed to vLLM for every case (repeat)")
    ap.add_argument("--result", default=None,
                    help="result JSON (default benchmarks/results/<kind>-generate-<time>.json)")
    ap.add_argument("--append", action="store_true", help="add these cases to an existing --result (a case per call)")
    a = ap.parse_args()
    benchlib.exit_on_sigterm()
    if a.child:
        child(a.child)
        return
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    from transformers import AutoConfig

    from vllm_hidden.layers import resolve_layer_ids

    model, engine, model_desc = benchlib.pick_model(a, work)
    text = AutoConfig.from_pretrained(model).get_text_config()
    layer_ids = resolve_layer_ids(text.num_hidden_layers, a.layers, None, None)
    ps = benchlib.make_prompts(benchlib.WORKLOADS[a.workload], text.vocab_size)
    prompts, inp = work / f"gen-{a.workload}.prompts.json", work / f"gen-{a.workload}.jsonl"
    prompts.write_text(json.dumps(ps))
    if a.turns > 1:
        inp = work / f"gen-{a.workload}-{a.turns}-turns.jsonl"
        chat_workload(model, ps, a.turns, inp)
    else:
        benchlib.write_prompts(inp, ps)
    common = {"model": model, "engine_args": engine, "max_model_len": a.max_model_len,  # prompt + response
              "max_tokens": a.max_tokens, "turns": a.turns, "layers": ",".join(map(str, layer_ids)),
              "prompts": str(prompts),
              "input": str(inp), "second_pass_input": str(work / "gen-second-pass.jsonl"),
              "responses": str(work / "gen-responses.json"), "out_dir": str(work / "gen-out")}
    path = benchlib.result_path(a.result, f"{'gpu' if a.qwen36_27b else 'cpu'}-generate-{benchlib.stamp()}.json")
    result = {"command": benchlib.command_line(__file__), **benchlib.engine_provenance(__file__),
              "model": model_desc, "layer_ids": layer_ids, "engine_args": engine, "max_model_len": a.max_model_len,
              "max_tokens": a.max_tokens, "turns": a.turns, "sampling": "greedy, ignore_eos",
              "workload": {**benchlib.WORKLOADS[a.workload], "name": a.workload, "seed": 0,
                           "prompt_tokens": sum(map(len, ps))},
              "cases": {}}
    if a.append and path.exists():  # earlier calls' cases (and commands) kept
        prev = json.loads(path.read_text())
        result["cases"] = prev["cases"]
        result["command"] = prev["command"] + " ; " + result["command"]
    for case in [c for c in a.cases.split(",") if c]:
        if case == "generate":  # the second pass reads this run's responses, never an older one's
            for stale in ("second_pass_input", "responses"):
                Path(common[stale]).unlink(missing_ok=True)
        spec = {**common, "case": case, "result": str(work / f"gen-result-{case}.json")}
        print(f"bench_generate: case {case} ...", flush=True)
        result["cases"][case] = benchlib.run_case(spec, work, __file__)
        summarize(result)
        benchlib.write_json(path, result)
        print(f"bench_generate: {case}: {json.dumps(result.get('summary', {}))}", flush=True)
        if result["cases"][case].pop("interrupted", False):
            sys.exit(143)
    print(f"wrote {path}")


def summarize(result: dict) -> None:
    g, e = result["cases"].get("generate", {}), result["cases"].get("extract", {})
    one, second = e.get("one_pass"), e.get("second_pass")
    s = {}
    if one:
        s["one_pass_seconds"] = round(one["seconds"], 2)
        s["one_pass_tokens_per_s"] = round(one["tokens"] / one["seconds"], 1)
        s["one_pass_generated_tokens_per_s"] = round(one["generated_tokens"] / one["seconds"], 1)
        s["one_pass_peak_rss_bytes"] = one["peak_rss_bytes_during_run"]
        s["one_pass_inflight_bound_bytes"] = e.get("inflight_bound_bytes")
    if g.get("seconds"):
        s["generate_seconds"] = round(g["seconds"], 2)
        s["generate_tokens_per_s"] = g["generated_tokens_per_s"]
        if one:
            s["capture_cost_ratio"] = round(g["seconds"] / one["seconds"], 4)  # plain generation / one pass
    if second:
        s["second_pass_seconds"] = round(second["seconds"], 2)
        s["second_pass_tokens_per_s"] = round(second["tokens"] / second["seconds"], 1)
        if g.get("seconds"):
            s["two_pass_seconds"] = round(g["seconds"] + second["seconds"], 2)
            if one:
                s["one_pass_speedup"] = round((g["seconds"] + second["seconds"]) / one["seconds"], 3)
    result["summary"] = s


if __name__ == "__main__":
    main()
