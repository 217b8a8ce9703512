#!/usr/bin/env python
"""Train a small drafter colocated with its target: the target runs in this process
(`vllm_hidden.colocate.HiddenStatesStream`), and each batch's hidden states arrive as tensors
on this process's device. The drafter is a few torch layers (a projection of the captured
layers, two MLP blocks, a head predicting the next token), enough to show the loop, or with
`--drafter speculators-eagle3` speculators' own EAGLE-3 model, fed through
`vllm_hidden.colocate.to_speculators` (its training batch layout).

    python scripts/colocated_train.py --model M --input prompts.jsonl --layers 1,16,31 \\
        --checkpoint ckpt.pt            # again with the same flags after a crash: goes on exactly

The checkpoint holds the drafter, its optimizer and the stream's position (`state_dict`), saved
after every batch. Under torchrun each process takes its rank's share of the input.
`--dump DIR` writes each batch's tensors (for checks); `--die-after N` kills this process with
SIGKILL after N batches (for the resume test); `--max-tokens N` has the target write each
response (its states captured in the same pass, the loss on the response): a resumed run gets
the same responses with `--seed` or `--temperature 0`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn


class TinyDrafter(nn.Module):
    """K captured layers [N, K, H] -> next-token logits [N, V]."""

    def __init__(self, k: int, hidden: int, vocab: int, width: int = 64, blocks: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(k * hidden, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        x = self.proj(states.flatten(1).float())
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def next_token_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Row t predicts token t + 1 of the same sample, where token t + 1 has loss."""
    ids, mask, cu = batch["token_ids"], batch["loss_mask"], batch["cu_seqlens"]
    last = torch.zeros_like(mask)
    last[(cu[1:] - 1).long()] = True  # a sample's last row has no next token in it
    target = torch.roll(ids, -1)
    keep = torch.roll(mask, -1) & ~last
    if not bool(keep.any()):
        return logits.sum() * 0.0
    return nn.functional.cross_entropy(logits[keep], target[keep])


def speculators_eagle3(model: str, layer_ids: list[int], device: torch.device):
    """speculators' own EAGLE-3 drafter (one llama decoder layer shaped from the target, the
    target's embedding, final norm and LM head loaded from its checkpoint) and its loss on a
    stream batch (`to_speculators`: the last captured layer is the verifier's last)."""
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    from vllm_hidden.colocate import to_speculators
    from vllm_hidden.layers import to_aux_ids

    cfg = create_transformer_layer_config(model, num_layers=1, draft_arch="llama", hidden_act=None, sliding_window=0,
                                          full_attention_indices=[0])
    # the aux states in vLLM's numbering; eager attention: any device
    drafter = Eagle3DraftModel.from_training_args(
        verifier_config=cfg, draft_vocab_size=cfg.vocab_size, norm_before_residual=False, ttt_steps=2,
        verifier_name_or_path=model, target_layer_ids=to_aux_ids(layer_ids[:-1]), draft_attn_impl="eager")
    drafter = drafter.to(device)
    loss_config = resolve_loss_config("kl_div", "fused" if device.type == "cuda" else "eager")  # (fused: Triton)
    dtype = next(drafter.parameters()).dtype

    def loss(batch: dict) -> torch.Tensor:
        kw = to_speculators(batch)
        for k in ("hidden_states", "verifier_last_hidden_states"):
            kw[k] = kw[k].to(dtype)
        return drafter(**kw, ttt_steps=2, loss_config=loss_config)[1]

    return drafter, loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--layers", default=None, help="layer ids as extract takes them (default: DFlash's 5)")
    ap.add_argument("--final-state", action="store_true", help="also the model's final normed state")
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="the target's share of the GPU")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--engine-arg", action="append", default=[], help="a vLLM engine option (repeat)")
    ap.add_argument("--lookahead", type=int, default=0, help="1: the next batch made while this one trains")
    ap.add_argument("--rank", type=int, default=None, help="this process's rank (default: torchrun's RANK, else 0)")
    ap.add_argument("--world-size", type=int, default=None, help="default: torchrun's WORLD_SIZE, else 1")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="the target writes each response (at most this many tokens), as extract --generate")
    ap.add_argument("--temperature", type=float, default=1.0, help="with --max-tokens")
    ap.add_argument("--seed", type=int, default=None,
                    help="with --max-tokens: each response's seed comes from it and the sample's id, so a resumed run "
                         "samples the same responses (without it, only --temperature 0 does)")
    ap.add_argument("--drafter", choices=("tiny", "speculators-eagle3"), default="tiny",
                    help="a few torch layers, or speculators' own EAGLE-3 model (--layers: aux layers, then the last)")
    ap.add_argument("--steps-per-batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--result", default=None, help="a JSON file for the run's figures")
    a = ap.parse_args()

    from transformers import AutoConfig

    from vllm_hidden.colocate import HiddenStatesStream
    from vllm_hidden.layers import resolve_layer_ids

    text_config = AutoConfig.from_pretrained(a.model).get_text_config()
    vocab = text_config.vocab_size
    if a.drafter == "speculators-eagle3":  # refused before the engine starts
        last = text_config.num_hidden_layers - 1
        ids = resolve_layer_ids(text_config.num_hidden_layers, layers=a.layers)
        if ids[-1] != last:
            sys.exit(f"--drafter speculators-eagle3: the last of --layers must be the model's last layer, {last} "
                     f"(speculators' verifier state), got {ids}")
    engine_args = [x for arg in a.engine_arg for x in arg.split()]
    stream = HiddenStatesStream(a.model, a.input, layers=a.layers, final_state=a.final_state,
                                token_budget=a.token_budget, gpu_memory_utilization=a.gpu_memory_utilization,
                                max_model_len=a.max_model_len, engine_args=engine_args, lookahead=a.lookahead,
                                rank=a.rank, world_size=a.world_size,
                                generate=None if a.max_tokens is None else {"max_tokens": a.max_tokens,
                                                                            "temperature": a.temperature,
                                                                            "seed": a.seed})
    dev = stream.device
    torch.manual_seed(0)
    if a.drafter == "speculators-eagle3":
        drafter, loss_of = speculators_eagle3(a.model, stream.layer_ids, dev)
    else:
        drafter = TinyDrafter(len(stream.layer_ids), stream.hidden_size, vocab).to(dev)

        def loss_of(batch: dict) -> torch.Tensor:
            return next_token_loss(drafter(batch["hidden_states"]), batch)
    opt = torch.optim.AdamW(drafter.parameters(), lr=a.lr)
    ckpt = Path(a.checkpoint) if a.checkpoint else None
    if ckpt is not None and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        stream.load_state_dict(saved["stream"])
        print(f"resumed after batch {saved['stream']['batches']}", file=sys.stderr)
    dump = Path(a.dump) if a.dump else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    losses, t0, tokens = [], time.perf_counter(), 0
    for batch in stream:
        for _ in range(a.steps_per_batch):
            loss = loss_of(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        n = stream.state_dict()["batches"]
        tokens += batch["token_ids"].numel()
        if dump is not None:
            host = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
            torch.save(host, dump / f"batch-{n:05d}.pt")
        if ckpt is not None:  # written whole, then renamed: a crash leaves the last good one
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "stream": stream.state_dict()},
                       tmp)
            os.replace(tmp, ckpt)
        print(f"batch {n}: {len(batch['ids'])} samples, {batch['token_ids'].numel()} tokens, loss "
              f"{losses[-a.steps_per_batch]:.4f} -> {losses[-1]:.4f}", file=sys.stderr, flush=True)
        if a.die_after is not None and n >= a.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
    seconds = time.perf_counter() - t0
    counters = stream.close()
    res = {"batches": stream.state_dict()["batches"], "tokens": tokens, "seconds": round(seconds, 3),
           "losses": losses, "errors": [e.to_dict() for e in stream.errors], "capture": counters,
           "device": str(dev)}
    print(json.dumps(res))
    if a.result:
        Path(a.result).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
