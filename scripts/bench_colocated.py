"""Drafter training steps per second on one GPU, fed three ways, same drafter, same batches:

  colocated  the target in the trainer's process (`HiddenStatesStream`), each batch made when the
             trainer asks for it, its states handed over on the GPU
  colocated-ahead  the same with lookahead=1: the next batch made (a thread of its own stepping the
             engine) while the trainer trains on this one
  offline    the states extracted first (`vllm-hidden extract` to local disk, untimed, reported
             apart), then read back (`HiddenStatesDataset`), packed and copied to the GPU
  online     `vllm-hidden serve` with speculators' launch arguments on the same GPU (its own
             process, the same share of the GPU), the trainer asking for each batch's prompts
             through speculators' own client and reading the files it writes

    # GPU host: Qwen3.6-27B text dims, random weights, FP8 weights, DFlash's 5 layers
    python scripts/bench_colocated.py --qwen36-27b --cases colocated,offline,online --result R.json
    # CPU smoke test: tiny random Qwen3-Next
    VLLM_CPU_KVCACHE_SPACE=1 python scripts/bench_colocated.py --samples 48 --token-budget 1024

Each case runs in a process of its own (the GPU's memory freed between). The batches are the
same in all three: the prompts in order, cut greedily under --token-budget. The drafter is the
same in all (seeded): with --qwen36-27b `--drafter qwen3`, a stack of Qwen3 decoder layers at the
dims of the 27B's DFlash drafter (SpecForge's qwen3.5-27b-dflash config: 5 layers, hidden 5,120,
MLP 17,408, 24 heads of 256, 4 KV heads; ~1.8B parameters) behind a projection of the captured
layers and a head over the first --drafter-vocab token ids, causal attention over the packed batch
(not DFlash's anchored blocks: the same matmuls, its own attention pattern); else
`colocated_train.TinyDrafter`. bf16 weights, AdamW, the next-token loss. The first batch of each
case is trained but untimed (kernels and allocator warm). Per case: batches, tokens, seconds,
steps/s, tokens/s, the time spent waiting for data against training (the target's share of each
step, colocated), and the GPU's peak memory (torch's, this process; nvidia-smi's, the whole card).
offline also reports its steps/s with the extraction's run time counted (`with_extract_*`: the
states made on this card first, the run's time prorated by tokens), the fair figure beside
colocated and online, which make their states inside the timed loop."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib

DFLASH_LAYERS = "1,16,31,46,61"  # of the 27B's 64 (vllm_hidden's default for it)
SCRIPTS = Path(__file__).resolve().parent


def batches_of(path: Path, vocab: int, max_len: int, budget: int) -> list[list[int]]:
    """The input's lines as HiddenStatesStream batches them (its own batcher, one rank)."""
    from vllm_hidden.colocate.batcher import PromptBatcher
    from vllm_hidden.inputs import PromptReader

    batcher = PromptBatcher(PromptReader(path, vocab_size=vocab, max_prompt_len=max_len), 0, 1, budget)
    out = []
    while batch := batcher.next_batch():
        out.append([p.line for p in batch])
        batcher.done(batch)
    return out


# the 27B's DFlash drafter's decoder dims (SpecForge configs/qwen3.5-27b-dflash.json)
DFLASH_27B = {"num_hidden_layers": 5, "hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 24,
              "num_key_value_heads": 4, "head_dim": 256}


def qwen3_drafter(k: int, hidden: int, vocab: int, dims: dict) -> Any:
    """A Qwen3 decoder stack as the drafter: projection of the K captured layers -> the stack ->
    a head over `vocab` ids (the shape of a DFlash drafter's compute, causal attention). Built
    here, not at import: the parent process never imports torch's CUDA side."""
    import torch
    from torch import nn
    from transformers import Qwen3Config, Qwen3Model

    class Qwen3Drafter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cfg = Qwen3Config(**dims, vocab_size=1, max_position_embeddings=65536, attn_implementation="sdpa")
            self.proj = nn.Linear(k * hidden, cfg.hidden_size, bias=False)
            self.stack = Qwen3Model(cfg)
            self.head = nn.Linear(cfg.hidden_size, vocab, bias=False)

        def forward(self, states: torch.Tensor) -> torch.Tensor:
            x = self.proj(states.flatten(1).to(self.proj.weight.dtype))[None]
            pos = torch.arange(x.shape[1], device=x.device)[None]
            return self.head(self.stack(inputs_embeds=x, position_ids=pos).last_hidden_state[0])

    return Qwen3Drafter()


class Trainer:
    """The drafter, its optimizer and the timing of data against training. The first step is
    untimed: every case's clock starts when it ends."""

    def __init__(self, k: int, hidden: int, a: argparse.Namespace, device: Any) -> None:
        import torch

        sys.path.insert(0, str(SCRIPTS))
        from colocated_train import TinyDrafter

        torch.manual_seed(0)
        self.torch, self.device = torch, device
        self.vocab = a.drafter_vocab
        self.cuda = device.type == "cuda"
        if a.drafter == "qwen3":
            dims = dict(DFLASH_27B) if a.qwen36_27b else {
                "num_hidden_layers": a.drafter_blocks, "hidden_size": a.drafter_width or 64, "intermediate_size": 224,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
            self.model = qwen3_drafter(k, hidden, self.vocab, dims).to(device)
            if self.cuda:  # bf16 weights and optimizer state (the bench's drafter fits beside the target)
                self.model = self.model.to(torch.bfloat16)
            self.drafter = {"kind": "qwen3", **dims}
        else:
            width = a.drafter_width or hidden
            self.model = TinyDrafter(k, hidden, self.vocab, width=width, blocks=a.drafter_blocks).to(device)
            self.drafter = {"kind": "tiny", "width": width, "blocks": a.drafter_blocks}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.data_s = self.train_s = 0.0
        self.steps = self.tokens = 0
        self.t0: float | None = None  # the clock: from the end of the first (untimed) step

    def waited(self, seconds: float) -> None:
        if self.t0 is not None:
            self.data_s += seconds

    def step(self, batch: dict) -> None:
        torch = self.torch
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            logits = self.model(batch["hidden_states"])
        ids = batch["token_ids"] % self.vocab
        loss = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the step's time is its own, not the next wait's
        if self.t0 is None:
            self.t0 = time.perf_counter()
            return
        self.train_s += time.perf_counter() - t0
        self.steps += 1
        self.tokens += batch["token_ids"].numel()

    def result(self) -> dict:
        torch = self.torch
        seconds = time.perf_counter() - (self.t0 or time.perf_counter())
        r = {"batches": self.steps, "tokens": self.tokens, "seconds": round(seconds, 3),
             "steps_per_s": round(self.steps / seconds, 3), "tokens_per_s": round(self.tokens / seconds, 1),
             "data_wait_s": round(self.data_s, 3), "train_s": round(self.train_s, 3),
             "data_share": round(self.data_s / max(seconds, 1e-9), 3), "drafter_params": self.params,
             "drafter": self.drafter, "untimed_first_batch": True}
        if self.cuda:
            r["torch_peak_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
            used = gpu_used_mib()
            r["card_used_gib_at_end"] = round(used / 1024, 2) if used is not None else None
        return r


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


# -- the cases, each in its own process -------------------------------------------------------
def case_colocated(a: argparse.Namespace, spec: dict) -> dict:
    from vllm_hidden.colocate import HiddenStatesStream

    t0 = time.perf_counter()
    stream = HiddenStatesStream(spec["model"], spec["input"], layers=spec["layers"], token_budget=a.token_budget,
                                gpu_memory_utilization=a.target_share, max_model_len=spec["max_len"],
                                engine_args=spec["engine"], lookahead=int(spec["case"] == "colocated-ahead"))
    start_s = time.perf_counter() - t0
    tr = Trainer(len(stream.layer_ids), stream.hidden_size, a, stream.device)
    it = iter(stream)
    while True:
        t = time.perf_counter()
        batch = next(it, None)
        tr.waited(time.perf_counter() - t)
        if batch is None:
            break
        tr.step(batch)
    res = tr.result()
    res["memory"] = stream.memory()
    res["capture"] = stream.close()
    res["target_start_s"] = round(start_s, 1)
    return res


def _packed(samples: list[dict], device: Any) -> dict:
    import torch

    hs = torch.cat([s["hidden_states"] for s in samples]).pin_memory() if device.type == "cuda" else \
        torch.cat([s["hidden_states"] for s in samples])
    ids = torch.cat([s["token_ids"] for s in samples])
    return {"hidden_states": hs.to(device, non_blocking=True), "token_ids": ids.to(device, non_blocking=True)}


def case_offline(a: argparse.Namespace, spec: dict) -> dict:
    import torch

    from vllm_hidden.data import HiddenStatesDataset

    ds = HiddenStatesDataset(spec["out"])
    by_id = {sid: i for i, sid in enumerate(ds.sample_ids())}  # the input's ids: 0, 1, ... (its lines)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    first = ds[0]["hidden_states"]
    tr = Trainer(first.shape[1], first.shape[2], a, device)
    for b in spec["batches"]:
        t = time.perf_counter()
        batch = _packed([ds[by_id[i]] for i in b], device)
        tr.waited(time.perf_counter() - t)
        tr.step(batch)
    res = tr.result()
    extract = spec["extract"]  # the states were made on this card first: that run's time, by tokens
    share = res["tokens"] / max(extract["tokens"], 1)
    made_s = res["seconds"] + extract["seconds"] * share
    res.update(with_extract_seconds=round(made_s, 3), with_extract_steps_per_s=round(res["batches"] / made_s, 3),
               with_extract_tokens_per_s=round(res["tokens"] / made_s, 1))
    return res


def case_online(a: argparse.Namespace, spec: dict) -> dict:
    import asyncio

    import openai
    import torch
    from bench_online import Server, capture_args, speculators_client
    from safetensors.torch import load_file

    from vllm_hidden.layers import to_aux_ids

    layers = [int(x) for x in spec["layers"].split(",")]
    k = len(layers)
    hs_dir = Path(spec["work"]) / "hs"
    hs_dir.mkdir(parents=True, exist_ok=True)
    cap, _ = capture_args(to_aux_ids(layers), hs_dir, "file")
    engine = [x for x in spec["engine"]] + ["--max-model-len", str(spec["max_len"])]
    if a.target_share is not None:
        engine += ["--gpu-memory-utilization", str(a.target_share)]
    server = Server([sys.executable, "-m", "vllm_hidden.cli", "serve", spec["model"], *cap, *engine], {},
                    Path(spec["work"]) / "online-server.log")
    start_s = server.start(1200)
    # this process shares the card with the server's: an allocator that returns what it frees
    # (the drafter's fragmentation otherwise took the server's headroom; set before CUDA starts here)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    prompts = [json.loads(line)["token_ids"] for line in open(spec["input"])]
    client_mod, _ = speculators_client()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model_id = server.model_id()

        async def fetch(client, ids: list[int]) -> dict:
            path, _ = await client_mod.generate_hidden_states_async(client, model_id, {"input_ids": ids},
                                                                    timeout=600, max_retries=3)
            if os.path.exists(path + ".lock"):
                await client_mod.wait_for_lock_async(path + ".lock")
            d = await asyncio.to_thread(load_file, path)
            os.remove(path)
            return d

        async def run() -> dict:
            tr = None
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0,
                                          timeout=600) as client:
                for b in spec["batches"]:
                    t = time.perf_counter()
                    got = await asyncio.gather(*(fetch(client, prompts[i]) for i in b))
                    # the files hold the aux layers and the model's last: the drafter takes the same K as the others
                    batch = _packed([{**g, "hidden_states": g["hidden_states"][:, :k]} for g in got], device)
                    if tr is None:
                        tr = Trainer(batch["hidden_states"].shape[1], batch["hidden_states"].shape[2], a, device)
                    tr.waited(time.perf_counter() - t)
                    tr.step(batch)
                return tr.result()

        res = asyncio.run(run())
    finally:
        server.stop()
    res["target_start_s"] = round(start_s, 1)
    return res


CASES = {"colocated": case_colocated, "colocated-ahead": case_colocated, "offline": case_offline,
         "online": case_online}


def extract_first(spec: dict, a: argparse.Namespace, work: Path) -> dict:
    """offline's states, extracted before its timed run (reported apart): extract's own summary
    (its run's `seconds` exclude the engine's start) and the whole command's wall time."""
    out = work / "offline-out"
    engine = [*spec["engine"], *(["--gpu-memory-utilization", str(a.extract_share)] if a.extract_share else [])]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "vllm_hidden.cli", "extract", "-m", spec["model"], "-i", spec["input"],
                        "-o", str(out), "--layers", spec["layers"], "--max-model-len", str(spec["max_len"]),
                        "--no-progress", *engine], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"offline: extract failed ({r.returncode}):\n{r.stderr[-3000:]}")
    spec["out"] = str(out)
    summary = benchlib.last_json(r.stdout)
    keep = ("samples", "tokens", "seconds", "engine_init_seconds", "flush_seconds", "tokens_per_s", "engine_start")
    return {**{k: summary.get(k) for k in keep}, "command_wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = benchlib.parser(__doc__)
    ap.add_argument("--qwen36-27b", action="store_true", help="Qwen3.6-27B text dims, random weights")
    ap.add_argument("--cases", default="colocated,colocated-ahead,offline,online")
    ap.add_argument("--samples", type=int, default=512, help="W-chat prompts")
    ap.add_argument("--token-budget", type=int, default=None, help="default: 8192 with --qwen36-27b, else 16384")
    ap.add_argument("--target-share", type=float, default=None, help="the target's gpu_memory_utilization")
    ap.add_argument("--extract-share", type=float, default=None, help="offline's extract: gpu_memory_utilization")
    ap.add_argument("--bf16", action="store_true", help="bf16 target weights (default with --qwen36-27b: FP8)")
    ap.add_argument("--drafter", choices=("qwen3", "tiny"), default=None,
                    help="qwen3: a Qwen3 decoder stack (--qwen36-27b: the 27B DFlash drafter's dims; the default "
                         "there), tiny: colocated_train.TinyDrafter (the default elsewhere)")
    ap.add_argument("--drafter-width", type=int, default=0, help="0: the target's hidden size")
    ap.add_argument("--drafter-blocks", type=int, default=2)
    ap.add_argument("--drafter-vocab", type=int, default=32768)
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--work", default=None)
    ap.add_argument("--result", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    # defaults that hang on --qwen36-27b, resolved here: a case's process parses the same flags
    a.drafter = a.drafter or ("qwen3" if a.qwen36_27b else "tiny")
    a.token_budget = a.token_budget or (8192 if a.qwen36_27b else 16384)  # 27B: the drafter's activations fit
    if a.qwen36_27b:
        a.target_share = a.target_share or 0.55
    if a.child:  # one case, in this process: its spec from the parent
        spec = json.loads(Path(a.child).read_text())
        print(json.dumps(CASES[spec["case"]](a, spec)))
        return

    import tempfile

    work = Path(a.work or tempfile.mkdtemp(prefix="bench-colocated-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.qwen36_27b:
        model, engine = benchlib.qwen36_27b(work)
        layers, max_len, vocab = DFLASH_LAYERS, 4096, 248320
        if not a.bf16:
            engine += ["--quantization", "fp8"]
        # the target's share is --target-share; 128 sequences at most: that share's Mamba cache
        # blocks are fewer than the reference's 256 (a batch of --token-budget holds ~16 prompts)
        dropped = ("--gpu-memory-utilization", "--max-num-seqs")
        engine = [x for i, x in enumerate(engine) if not (x in dropped or (i and engine[i - 1] in dropped))]
        engine += ["--max-num-seqs", "128"]
    else:
        model, engine = benchlib.tiny_model(work), ["--dtype", "bfloat16", "--enforce-eager"]
        layers, max_len, vocab = "1,3,5", 2048, 1000
        import torch

        if torch.cuda.is_available():
            engine += ["--gdn-prefill-backend", "triton"]
    engine += [x for e in a.engine_arg for x in e.split()]
    benchlib.w_chat_input(work / "in.jsonl", a.samples, min(max_len - 1, a.token_budget), vocab)
    spec = {"model": model, "input": str(work / "in.jsonl"), "layers": layers, "max_len": max_len,
            "engine": engine, "batches": batches_of(work / "in.jsonl", vocab, max_len, a.token_budget),
            "work": str(work)}
    result = {"command": benchlib.command_line(__file__), "git_revision": benchlib.git_revision(),
              "versions": benchlib.versions("vllm", "torch"), "gpus": benchlib.gpu_names(),
              "model": "Qwen3.6-27B text dims, random weights" if a.qwen36_27b else "tiny random Qwen3-Next",
              "engine_args": engine, "layers": layers, "samples": a.samples, "token_budget": a.token_budget,
              "batches": len(spec["batches"]), "target_share": a.target_share, "cases": {}}
    for case in a.cases.split(","):
        if case not in CASES:
            sys.exit(f"unknown case {case!r}: one of {', '.join(CASES)}")
        if case == "offline":
            result["offline_extract"] = spec["extract"] = extract_first(spec, a, work)
        path = work / f"spec-{case}.json"
        path.write_text(json.dumps({**spec, "case": case}))
        r = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", str(path)], capture_output=True,
                           text=True)
        (work / f"{case}.log").write_text(r.stdout + r.stderr)
        if r.returncode:
            result["cases"][case] = {"error": f"exit {r.returncode}", "tail": r.stderr[-2000:]}
        else:
            result["cases"][case] = benchlib.last_json(r.stdout)
        print(f"{case}: {json.dumps(result['cases'][case])[:400]}", file=sys.stderr, flush=True)
        if a.result:  # what ran so far, should a later case not finish
            benchlib.write_json_atomic(a.result, result)
    base = result["cases"].get("colocated", {}).get("steps_per_s")
    for c in result["cases"].values():
        if base and c.get("steps_per_s"):
            c["colocated_over_this"] = round(base / c["steps_per_s"], 3)
    print(json.dumps(result))
    if a.result:
        benchlib.write_json_atomic(a.result, result)


if __name__ == "__main__":
    main()
