"""The options `vllm-hidden`'s commands share, as typer annotations (cli.py holds the commands):
those of `extract` and `warmup` (a warmup must see the settings its extract will use), and the
server's limits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vllm_hidden.config import DTYPES

# Options shared by `extract` and `warmup` (a warmup must see the settings its extract will use).
Model = Annotated[str, typer.Option("--model", "-m", help="HF model directory or id.")]
Layers = Annotated[Optional[str], typer.Option(help="Layer ids, output of decoder layer i (0-based), e.g. 1,16,31.")]
AuxLayers = Annotated[Optional[str], typer.Option(help="vLLM/EAGLE-3 aux ids (input of layer j = layer id j-1).")]
LayersFrom = Annotated[Optional[Path], typer.Option(
    help="Drafter config.json (or its directory): DFlash, SpecForge/SGLang, vLLM or speculators EAGLE-3, each "
         "read as its project means its ids.")]
MaxModelLen = Annotated[Optional[int], typer.Option(
    help="Longest prompt accepted (tokens); longer lines become error records.")]
MaxBatched = Annotated[Optional[int], typer.Option(
    help="Tokens per scheduler step (also the capture buffer's rows).")]
MaxSeqs = Annotated[Optional[int], typer.Option(help="Sequences per scheduler step.")]
Dtype = Annotated[str, typer.Option(help=f"Model dtype ({', '.join(DTYPES)}).")]
RingSlots = Annotated[int, typer.Option(help="Host ring depth (steps in flight between GPU and writer).")]
FullModel = Annotated[bool, typer.Option(
    "--full-model",
    help="Run every decoder layer. By default the engine runs layers 0 .. the deepest captured one only (the "
         "states are the same; --final-state and --generate always run the whole model).")]
FinalState = Annotated[str, typer.Option(
    help="none, or post-norm: also store the model's final normed state per token (final_hidden_states [T, "
         "H]).")]
Tp = Annotated[int, typer.Option("--tp", help="GPUs per engine (vLLM tensor parallelism; on CPU, core groups).")]
CacheDir = Annotated[Optional[Path], typer.Option(
    help="Compile and kernel caches (vLLM, Inductor, Triton) (default: $VHIDDEN_CACHE_DIR or "
         "~/.cache/vllm-hidden).")]
CacheFrom = Annotated[Optional[str], typer.Option(
    help="A cache archive (`warmup --pack`; a file or s3://bucket/key) to unpack into the cache dir before the"
         " engine starts; refused (exit 2) if made for other vLLM/torch/Triton versions or another GPU "
         "architecture.")]

# `serve`'s limits (their defaults are ServeConfig's)
MaxHiddenTokens = Annotated[int, typer.Option(
    help="Most hidden-state rows (tokens) one response may carry; more is HTTP 400.")]
MaxRequestBytes = Annotated[int, typer.Option(help="Largest body of a request with hidden_states; more is HTTP 413.")]
MaxConcurrent = Annotated[int, typer.Option(
    help="Hidden-state requests in flight at once (more wait); bounds the memory they hold.")]
HiddenStatesTimeout = Annotated[float, typer.Option(help="Seconds a finished response waits for its hidden states.")]
FetchTtl = Annotated[float, typer.Option(
    help="Fetch form: seconds a response's states wait for their GET, then they are deleted.")]
MaxUnfetchedBytes = Annotated[int, typer.Option(
    help="Fetch form: bytes all unfetched states may hold, split over the API server processes; a request that"
         " does not fit is HTTP 503.")]
FetchDir = Annotated[Optional[Path], typer.Option(
    help="Fetch form: where unfetched states are kept (default /dev/shm, memory).")]
MaxUnreadBytes = Annotated[int, typer.Option(
    help="Connector form: bytes the files in shared_storage_path that no client has deleted may hold, split "
         "over the API server processes; past it, HTTP 503 with Retry-After.")]
UnreadTtl = Annotated[float, typer.Option(
    help="Connector form: seconds a file nobody deleted is kept, then the server deletes it.")]

# `extract --generate`'s sampling and memory
Generate = Annotated[bool, typer.Option(
    "--generate",
    help="The target writes each response (a conversation's assistant turns, see --regenerate; text/token_ids "
         "continued) and the states of prompt + responses are captured in the same pass; see "
         "generations.jsonl.")]
Regenerate = Annotated[Optional[str], typer.Option(
    help="--generate, conversations: all (every assistant turn, in order, each with the target's own earlier "
         "turns as context; written assistant turns and tool results are dropped) or last (only the reply to "
         "the last user turn; earlier turns as written). Default: all.")]
MaxTokens = Annotated[Optional[int], typer.Option(
    help="--generate: most tokens per response (default 256); prompt + response must fit --max-model-len.")]
Temperature = Annotated[Optional[float], typer.Option(help="--generate: sampling temperature (0: greedy; default 1).")]
TopP = Annotated[Optional[float], typer.Option(help="--generate: nucleus sampling (default 1: off).")]
TopK = Annotated[Optional[int], typer.Option(help="--generate: top-k sampling (default 0: off).")]
Seed = Annotated[Optional[int], typer.Option(
    help="--generate: the run seed of the responses; each sample's sampling seed is derived from it and the "
         "sample's id, so a sample is the same in any batch, engine or --resume. Not vLLM's --seed: that is "
         "--engine-seed.")]
EngineSeed = Annotated[Optional[int], typer.Option(
    help="vLLM's own --seed (default vLLM's, 0): seeds each engine's random generators at start, which sample "
         "the responses of --generate without --seed; the stored states do not depend on it.")]
Stop = Annotated[Optional[list[str]], typer.Option(
    help="--generate: a stop string (repeatable); the response ends with the token that completes it.")]
IgnoreEos = Annotated[bool, typer.Option(
    "--ignore-eos", help="--generate: EOS does not end a response (every response gets --max-tokens; benchmarks).")]
MaxInflightBytes = Annotated[Optional[int], typer.Option(
    help="--generate: host memory the in-flight samples' rows may take (default: a quarter of the machine's, "
         "at most 32 GiB).")]

# outputs, as `inspect`, `check` and `export` read them
OutputArg = Annotated[str, typer.Argument(help="Extract output directory or s3://bucket/prefix.")]
S3Endpoint = Annotated[Optional[str], typer.Option(help="S3 endpoint (default: boto3's chain).")]
ShowProgress = Annotated[bool, typer.Option(help="Show a progress bar.")]
GdnKernels = Annotated[Optional[str], typer.Option(
    help="With --reference hf: what runs HF's Gated-DeltaNet layers (Qwen3-Next, Qwen3.5/3.6): auto (default: "
         "flash-linear-attention's kernels with --device cuda where fla imports, else transformers' torch code), "
         "fla (required: fails without it) or torch (the slow fallback, for comparison). The report says which ran.")]
