"""Demo: tiny local model + prompts (token ids, text, chat messages, ShareGPT conversations)
-> `vllm-hidden extract` (loss masks, the final normed state) -> inspect -> read samples back
and collate an EAGLE-3 batch."""

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

from vllm_hidden.demo import make_tiny_model

if __name__ == "__main__":
    root = Path(".demo")
    model = make_tiny_model(root / "model")
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(200):
            n = int(min(1024, max(8, rng.lognormvariate(4.8, 0.8))))
            f.write(json.dumps({"id": f"tok-{i}", "token_ids": [rng.randrange(1024) for _ in range(n)]}) + "\n")
        f.write(json.dumps({"id": "text-0", "text": "hello world , this is vllm hidden ."}) + "\n")
        f.write(json.dumps({"id": "chat-0", "messages": [{"role": "user", "content": "abc de"},
                                                         {"role": "assistant", "content": "fg hij"}]}) + "\n")
        for i in range(20):  # ShareGPT turns; the loss mask covers the assistant ("gpt") turns
            turns = [{"from": "system", "value": "be brief ."}]
            for _ in range(rng.randint(1, 3)):
                for who, most in (("human", 9), ("gpt", 30)):
                    words = (rng.choice("abcdefgh") for _ in range(rng.randint(3, most)))
                    turns.append({"from": who, "value": " ".join(words)})
            f.write(json.dumps({"id": f"conv-{i}", "conversations": turns}) + "\n")
    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["vllm-hidden", "extract", "--model", str(model), "--input", str(prompts), "--output", str(out),
           "--max-model-len", "2048", "--dtype", "bfloat16", "--layers", "1,3,6", "--final-state", "post-norm",
           *(["--enforce-eager"] if "--no-enforce-eager" not in sys.argv[1:] else []), *sys.argv[1:]]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)

    subprocess.run(["vllm-hidden", "inspect", str(out)], check=True)  # every shard's size, BLAKE3, index

    from vllm_hidden.data import Eagle3Collator, HiddenStatesDataset

    ds = HiddenStatesDataset(out)
    s = ds[0]
    print(f"read back: {len(ds)} samples, layer_ids {ds.layer_ids}; ds[0]: id={s['id']!r} "
          f"token_ids {tuple(s['token_ids'].shape)} hidden_states {tuple(s['hidden_states'].shape)} "
          f"{s['hidden_states'].dtype}"
          f" final_hidden_states {tuple(s['final_hidden_states'].shape)}")
    conv = next(ds[i] for i in range(len(ds)) if str(ds[i]["id"]).startswith("conv-"))
    print(f"{conv['id']}: {int(conv['loss_mask'].sum())} of {conv['loss_mask'].numel()} tokens in the loss mask "
          "(the assistant turns, each through its end-of-turn token)")
    batch = Eagle3Collator(ds.layer_ids)([ds[i] for i in range(4)])
    print("EAGLE-3 batch:", {k: tuple(v.shape) for k, v in batch.items()})
