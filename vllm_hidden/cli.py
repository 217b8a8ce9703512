"""`vllm-hidden` command line (typer). No logic here: parse, hand to the library, report."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer

from vllm_hidden import cli_options as opt
from vllm_hidden import versions_line
from vllm_hidden.config import DEFAULT_MAX_SHARD_BYTES, DEFAULT_S3_RETRY_S, DEFAULT_WRITER_THREADS, ServeConfig
from vllm_hidden.errors import VllmHiddenError

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Extract hidden states from vLLM for drafter training.")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(versions_line())
        raise typer.Exit(0)


@app.callback()
def _app(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print vllm-hidden's version and the installed vLLM's, "
                                          "then exit.")] = False,
) -> None:
    """Extract hidden states from vLLM for drafter training."""


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@contextmanager
def _failures(*also: type[BaseException]) -> Iterator[None]:
    """What a user can fix, reported in one line with its exit code: this package's own errors
    (errors.VllmHiddenError; one whose exit_code is None is a bug and keeps its traceback), bad
    input (ValueError), a missing package (ImportError), storage (OSError), and `also`."""
    try:
        yield
    except typer.Exit:  # click's Exit is a RuntimeError: an exit asked for is not a failure
        raise
    except VllmHiddenError as e:
        if e.exit_code is None:
            raise
        _fail(str(e), e.exit_code)
    except (ValueError, ImportError, OSError) + also as e:
        _fail(str(e))


def _log_info() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def _str(path: Path | None) -> str | None:
    return str(path) if path else None


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    help="Run prefill over a prompt file (JSONL, a JSON array of records, or Parquet by extension) and write the "
    "selected layers' hidden states, per-token loss masks (and with --final-state the final normed state) as "
    "safetensors shards plus manifest.json. Unknown options are passed to vLLM's engine "
    "(e.g. --enforce-eager, --tensor-parallel-size 2, --gdn-prefill-backend triton). The prompt file, the options "
    "and the output are checked before the engine starts. Exit codes: 0 done (bad records are skipped and listed in "
    "errors.jsonl); 2 refused before the engine started, nothing written (a bad option, path or engine option, a "
    "prompt file without records or whose first 100 records are all bad), or the run failed (engine, storage; "
    "--resume finishes it); 3 the run ended but the output holds no sample (every record was bad).",
)
def extract(
    ctx: typer.Context,
    model: opt.Model,
    input: Annotated[Path, typer.Option("--input", "-i", help="JSONL, a JSON array or .parquet; per record one "
                                        "of token_ids (optional loss_mask) | text | messages | conversations "
                                        "(optional tools), optional id.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output directory or s3://bucket/prefix "
                                        "(new or empty, or --resume).")],
    layers: opt.Layers = None,
    aux_layers: opt.AuxLayers = None,
    layers_from: opt.LayersFrom = None,
    max_model_len: opt.MaxModelLen = None,
    max_num_batched_tokens: opt.MaxBatched = None,
    max_num_seqs: opt.MaxSeqs = None,
    dtype: opt.Dtype = "auto",
    max_shard_bytes: Annotated[int, typer.Option(help="Largest shard (a longer sample "
                                                 "gets a shard of its own).")] = DEFAULT_MAX_SHARD_BYTES,
    writer_threads: Annotated[int, typer.Option(help="Threads writing shards; "
                                                "host memory holds up to threads+1 shards.")] = DEFAULT_WRITER_THREADS,
    ring_slots: opt.RingSlots = 2,
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
    progress: opt.ShowProgress = True,
    cache_dir: opt.CacheDir = None,
    cache_from: opt.CacheFrom = None,
    tp: opt.Tp = 1,
    dp: Annotated[int, typer.Option("--dp", help="Engines (data parallel), each on its own --tp GPUs, fed from one "
                                    "shared queue; rank r writes under rank-NNN/, one manifest for all.")] = 1,
    ray: Annotated[Optional[str], typer.Option("--ray", help="Run the --dp engines as actors of this Ray cluster "
                                               "('auto': the one this machine joined); output on S3 or a shared "
                                               "file system.")] = None,
    loss_mask: Annotated[Optional[str], typer.Option(help="Per-token loss mask: assistant (every assistant turn, "
                                                     "through its end-of-turn token), last-assistant, all, none (no "
                                                     "mask stored). Default: assistant for messages/conversations; the "
                                                     "record's own loss_mask, else all, for token_ids/text.")] = None,
    final_state: opt.FinalState = "none",
    full_model: opt.FullModel = False,
    storage_dtype: Annotated[str, typer.Option(help="auto (the model's dtype) or fp8: float8 e4m3 values with one "
                                               "float32 scale per token and layer, quantized on the GPU: half the "
                                               "bytes; the reader returns bf16.")] = "auto",
    input_columns: Annotated[Optional[str], typer.Option(help="Fields from differently named columns (keys), e.g. "
                                                         "'conversations=conv,id=uid'.")] = None,
    generate: opt.Generate = False,
    regenerate: opt.Regenerate = None,
    max_tokens: opt.MaxTokens = None,
    temperature: opt.Temperature = None,
    top_p: opt.TopP = None,
    top_k: opt.TopK = None,
    seed: opt.Seed = None,
    engine_seed: opt.EngineSeed = None,
    stop: opt.Stop = None,
    ignore_eos: opt.IgnoreEos = False,
    max_inflight_bytes: opt.MaxInflightBytes = None,
) -> None:
    _log_info()
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                "stop": stop or None, "ignore_eos": ignore_eos or None, "regenerate": regenerate,
                "max_inflight_bytes": max_inflight_bytes}
    with _failures():  # a dead engine or failed storage too: what was made durable is kept, --resume finishes
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
    layers_from: opt.LayersFrom = None,
    max_hidden_tokens: opt.MaxHiddenTokens = ServeConfig.max_hidden_tokens,
    max_request_bytes: opt.MaxRequestBytes = ServeConfig.max_request_bytes,
    max_concurrent: opt.MaxConcurrent = ServeConfig.max_concurrent,
    hidden_states_timeout: opt.HiddenStatesTimeout = ServeConfig.timeout_s,
    fetch_ttl: opt.FetchTtl = ServeConfig.fetch_ttl_s,
    max_unfetched_bytes: opt.MaxUnfetchedBytes = ServeConfig.max_unfetched_bytes,
    fetch_dir: opt.FetchDir = None,
    max_unread_bytes: opt.MaxUnreadBytes = ServeConfig.max_unread_bytes,
    unread_ttl: opt.UnreadTtl = ServeConfig.unread_ttl_s,
    cache_dir: opt.CacheDir = None,
    cache_from: opt.CacheFrom = None,
    tp: opt.Tp = 1,
) -> None:
    _log_info()
    with _failures():
        from vllm_hidden.cache_archive import prepare

        prepare(_str(cache_dir), cache_from)  # before vLLM starts
        limits = ServeConfig(max_hidden_tokens=max_hidden_tokens, max_request_bytes=max_request_bytes,
                             max_concurrent=max_concurrent, timeout_s=hidden_states_timeout, fetch_ttl_s=fetch_ttl,
                             max_unfetched_bytes=max_unfetched_bytes, max_unread_bytes=max_unread_bytes,
                             unread_ttl_s=unread_ttl)
        from vllm_hidden.extract.plan import model_info
        from vllm_hidden.server.launch import prepare_serve, run_vllm_serve

        argv = prepare_serve(model, model_info(model).num_layers, list(ctx.args), limits, layers, aux_layers,
                             _str(layers_from), _str(fetch_dir), tp)
    with _failures():
        run_vllm_serve(argv)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    help="Compile and tune everything an `extract` with the same model, layers and engine arguments "
    "would compile at start or on its first prompts (torch.compile graphs, Inductor and Triton kernels, "
    "Triton autotune results) into the cache directory, so that later starts, and several engines "
    "started at once, are warm. A no-op when these settings are warm already (--force redoes it).",
)
def warmup(
    ctx: typer.Context,
    model: opt.Model,
    layers: opt.Layers = None,
    aux_layers: opt.AuxLayers = None,
    layers_from: opt.LayersFrom = None,
    max_model_len: opt.MaxModelLen = None,
    max_num_batched_tokens: opt.MaxBatched = None,
    max_num_seqs: opt.MaxSeqs = None,
    dtype: opt.Dtype = "auto",
    ring_slots: opt.RingSlots = 2,
    cache_dir: opt.CacheDir = None,
    cache_from: opt.CacheFrom = None,
    tp: opt.Tp = 1,
    force: Annotated[bool, typer.Option("--force", help="Warm up even if a stamp "
                                        "says these settings are warm.")] = False,
    serve: Annotated[bool, typer.Option("--serve", help="Warm up for `vllm-hidden serve MODEL` with these layers and "
                                        "vLLM arguments instead (starts that server on a local port, "
                                        "sends requests, stops it).")] = False,
    generate: Annotated[bool, typer.Option("--generate", help="Warm up for `extract --generate` with this --max-tokens "
                                           "(its engine differs; the workload then also runs decode steps).")] = False,
    max_tokens: Annotated[Optional[int], typer.Option(help="--generate: as the extract's (default 256).")] = None,
    final_state: opt.FinalState = "none",
    full_model: opt.FullModel = False,
    pack: Annotated[Optional[Path], typer.Option(help="Then write the cache dir's compile and kernel caches as one "
                                                 ".tar.gz with a manifest of the versions and GPU it was made on, "
                                                 "for --cache-from on other machines.")] = None,
) -> None:
    _log_info()
    # with --serve, a RuntimeError: the warmup server failed to start or to answer
    with _failures(*((RuntimeError,) if serve else ())):
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
    typer.echo(r.describe())
    typer.echo(json.dumps(r.to_dict()))


@app.command(help="Summarize an extract output and verify every shard (size, BLAKE3, header, index); show its "
             "per-layer statistics and flag a layer that is all zero, constant, has NaN/Inf rows, or whose std jumps "
             "10x against every stored layer within 4 ids. Exits 1 if anything is wrong or the run is incomplete "
             "(flags are warnings unless --strict), 2 if OUTPUT is not an extract output (no such directory, or "
             "neither manifest.json nor run.json in it).")
def inspect(
    output: opt.OutputArg,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    s3_endpoint_url: opt.S3Endpoint = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when a layer's statistics are flagged, "
                                         "too.")] = False,
) -> None:
    from vllm_hidden.storage.verify import stats_table, verify_output

    with _failures():
        r = verify_output(output, s3_endpoint_url=s3_endpoint_url)
    if json_out:
        typer.echo(json.dumps(r.to_dict()))
    else:
        typer.echo(r.headline())
        for line in stats_table(r):
            typer.echo(line)
        for line in r.flag_lines():
            typer.secho(line, fg=typer.colors.YELLOW, err=True)
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
    output: opt.OutputArg,
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
    s3_endpoint_url: opt.S3Endpoint = None,
    gdn_kernels: opt.GdnKernels = None,
) -> None:
    import sys

    progress = not json_out and sys.stderr.isatty()
    with _failures():
        from vllm_hidden.check import run_check

        r = run_check(output, model, reference, samples=samples, seed=seed, device=device, max_rel_l2=max_rel_l2,
                      engine_args=list(ctx.args), s3_endpoint_url=s3_endpoint_url, progress=progress,
                      gdn_kernels=gdn_kernels)
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
    output: opt.OutputArg,
    to: Annotated[str, typer.Option("--to", help="Layout: speculators, specforge-eagle3 or specforge-dflash.")],
    dest: Annotated[Path, typer.Argument(help="Directory to write (new or empty, or an unfinished export "
                                         "of the same to finish).")],
    layers: Annotated[Optional[str], typer.Option(help="Layer ids to export, in order (default: all of the "
                                                  "output's; specforge-eagle3: its three, low to high).")] = None,
    s3_endpoint_url: opt.S3Endpoint = None,
    progress: opt.ShowProgress = True,
) -> None:
    from vllm_hidden.export import export_output, settings_lines
    from vllm_hidden.layers import parse_id_list

    with _failures():
        ids = None if layers is None else parse_id_list(layers, "--layers")
        record = export_output(output, to, dest, layers=ids, s3_endpoint_url=s3_endpoint_url, progress=progress)
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

    with _failures():
        typer.echo(str(make_tiny_model(path, arch=arch, num_layers=num_layers)))


def _about_vllm(e: ImportError) -> bool:
    """A missing vLLM (or a module of it) or one outside the supported versions (engine.compat)."""
    return type(e).__name__ == "UnsupportedVllm" or (e.name or "").split(".")[0] == "vllm" \
        or str(e).startswith("vLLM is not installed")


def _quiet_teardown() -> None:
    """Triton's bindings (nanobind) list every object they still hold as the interpreter is torn
    down ("nanobind: leaked N instances!", a hundred lines) on every run that imported vLLM with
    Triton installed: noise, not a fault of the run. Registered first, this exit handler runs
    after every other (vLLM's engine shutdown included, whose messages stay): what is left of
    the teardown writes its stderr to /dev/null."""
    import os
    import sys

    if "triton._C.libtriton" not in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def main() -> None:
    """The console script: the typer app, with a missing or unsupported vLLM reported in one line
    wherever it is first imported (exit 2), not as a traceback."""
    import atexit
    import sys

    atexit.register(_quiet_teardown)
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
