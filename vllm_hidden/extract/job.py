"""One engine's extract job: its config from `extract`'s options, check, plan, start the
engine, run a prompt file through it into an output, report (Summary, progress bar), manifest
last. The data-parallel coordinator reports with the same pieces."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm_hidden import __version__
from vllm_hidden.config import ExtractConfig, GenerateConfig, Plan
from vllm_hidden.engine.caches import warmth
from vllm_hidden.extract.extractor import Extractor
from vllm_hidden.extract.feed import ReaderFeed
from vllm_hidden.extract.plan import check_paths, check_prompts, plan_extract, prompt_reader
from vllm_hidden.format.shard import FP8_STORAGE, ShardInfo
from vllm_hidden.inputs import InputScan, parse_columns
from vllm_hidden.layers import SEMANTICS
from vllm_hidden.storage.output import Output


@dataclass
class Summary:
    samples: int = 0
    tokens: int = 0
    generated_tokens: int = 0  # --generate: response tokens (in `tokens` too)
    errors: int = 0
    resumed: int = 0  # samples already done by an earlier attempt (--resume), skipped
    shards: list[ShardInfo] = field(default_factory=list)
    seconds: float = 0.0
    engine_init_seconds: float = 0.0
    first_sample_seconds: float = 0.0  # from the extractor's creation to the first finished sample
    engine_start: dict[str, Any] = field(default_factory=dict)  # warm or cold, what was compiled (caches.StartProbe)
    flush_seconds: float = 0.0  # from the last finished request to every shard durable
    output_dir: str = ""
    capture_stats: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # a data-parallel run: each engine's share

    def to_dict(self) -> dict[str, Any]:
        return {**({"dp": len(self.ranks), "ranks": self.ranks} if self.ranks else {}),
            "samples": self.samples, "tokens": self.tokens, "generated_tokens": self.generated_tokens,
            "errors": self.errors, "resumed": self.resumed,
            "shards": len(self.shards), "bytes": sum(s.bytes for s in self.shards),
            "seconds": round(self.seconds, 3), "engine_init_seconds": round(self.engine_init_seconds, 3),
            "flush_seconds": round(self.flush_seconds, 3),
            "first_sample_seconds": round(self.first_sample_seconds, 3), "engine_start": self.engine_start,
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else 0.0,
            "samples_per_s": round(self.samples / self.seconds, 2) if self.seconds else 0.0,
            "output_dir": self.output_dir,
            "capture_stats": self.capture_stats,
        }

    @property
    def wrote_nothing(self) -> bool:
        """No sample is in the output: neither this run nor an earlier one (--resume) wrote any."""
        return self.samples == 0 and self.resumed == 0

    def describe(self, generated: bool = False) -> str:
        """One line for a person (`generated`: a --generate run, whose response tokens are named)."""
        d = self.to_dict()
        return ((f"resumed: {d['resumed']} samples were already done; " if d["resumed"] else "")
                + f"done: {d['samples']} samples, {d['tokens']} tokens"
                + (f" ({d['generated_tokens']} generated)" if generated else "")
                + f", {d['errors']} errors -> {d['shards']} shards "
                f"({d['bytes'] / 1e6:.1f} MB) in {d['seconds']:.1f} s ({d['tokens_per_s']:,.0f} tok/s, "
                f"{d['samples_per_s']:,.1f} samples/s; engine start {d['engine_init_seconds']:.1f} s"
                + (f", {warmth(d['engine_start'])}" if d["engine_start"] else "")
                + f"; first sample {d['first_sample_seconds']:.1f} s after start)")


class ProgressBar:
    """rich progress bar with tokens/s, samples/s and ETA (or nothing when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.p = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.p = Progress(
            TextColumn("extract"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[tps]:>9,.0f} tok/s {task.fields[sps]:>7,.1f} samples/s err {task.fields[err]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=Console(stderr=True),  # stdout stays the summary's, also when piped
        )
        self.task = self.p.add_task("extract", total=total, tps=0.0, sps=0.0, err=0)
        self.t0 = time.perf_counter()
        self.p.start()

    def update(self, done: int, tokens: int, errors: int) -> None:
        if self.p is None:
            return
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.p.update(self.task, completed=done + errors, tps=tokens / dt, sps=done / dt, err=errors)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()


def extract_config(*, generate: bool, sampling: dict[str, Any], input_columns: str | None,
                   engine_seed: int | None = None, **fields: Any) -> ExtractConfig:
    """`vllm-hidden extract`'s config: `fields` are ExtractConfig's; `sampling` holds the options
    that go with --generate only (None: not given), in the order their error names the first;
    `input_columns` is the option's text; `engine_seed` (--engine-seed) is vLLM's own --seed,
    which extract's --seed (the run seed of --generate) hides."""
    given = {k: v for k, v in sampling.items() if v is not None}
    if given and not generate:
        first = next(iter(given))
        hint = " (vLLM's engine seed is --engine-seed)" if first == "seed" else ""
        raise ValueError(f"--{first.replace('_', '-')} goes with --generate{hint}")
    inflight = given.pop("max_inflight_bytes", None)
    if engine_seed is not None:
        fields["engine_args"] = [*fields.get("engine_args", []), "--seed", str(engine_seed)]
    return ExtractConfig(generate=GenerateConfig(**given) if generate else None, max_inflight_bytes=inflight,
                         input_columns=parse_columns(input_columns), **fields)


def manifest_fields(cfg: ExtractConfig, plan: Plan, engine: dict[str, Any], reader: Any) -> dict[str, Any]:
    """The manifest's description of the run (everything but shards and errors)."""
    from vllm_hidden.engine import compat

    return dict(model=cfg.model, layer_ids=plan.layer_ids, layer_semantics=SEMANTICS, layer_source=plan.layer_source,
                num_model_layers=plan.info.num_layers, hidden_size=plan.info.hidden_size,
                # decoder layers the engine ran (< num_model_layers: cut after the deepest captured one)
                layers_run=engine.get("layers_run", plan.info.num_layers),
                dtype=engine.pop("dtype"), versions={"vllm": compat.VLLM_VERSION, "vllm_hidden": __version__},
                engine=engine, input=reader.describe(), final_state=cfg.final_state,
                generate=cfg.generate.to_dict() if cfg.generate is not None else None,
                storage=FP8_STORAGE if cfg.storage_dtype == "fp8" else None,
                quantization=engine.pop("quantization", None))


def extract_file(ex: Extractor, input_path: str, output_dir: str, progress: bool | None = None,
                 resume: bool | None = None, scan: InputScan | None = None) -> Summary:
    """Run a prompt file through an engine into an output (new, or `resume`d), manifest last.
    The file is checked first (`scan`: its up-front pass, if the caller made it already)."""
    cfg = ex.cfg
    resume = cfg.resume if resume is None else resume
    if ex.engine is None:
        raise RuntimeError("the extractor is closed")
    check_paths(cfg.model, input_path, output_dir, resume, cfg.s3_endpoint_url, cfg.input_columns)
    if scan is None:
        scan = check_prompts(cfg, ex.plan, input_path)
    output = Output(output_dir, ex.plan.identity, s3_endpoint_url=cfg.s3_endpoint_url, staging_dir=cfg.staging_dir,
                    s3_retry_s=cfg.s3_retry_s)
    state = output.begin(resume)
    reader = prompt_reader(cfg, ex.plan, input_path)
    feed = ReaderFeed(reader, state.done_ids, output.record_error)
    summary = Summary(engine_init_seconds=ex.engine_init_seconds, output_dir=output.where,
                      engine_start=ex.start_report)
    bar = ProgressBar(scan.records, cfg.progress if progress is None else progress)
    try:
        res = ex.extract(feed, output.shard_config(None, **cfg.shard_options()),
                         on_progress=lambda n, t: bar.update(n + feed.resumed, t, output.num_errors))
    finally:
        bar.close()
        output.close_errors()
    for bad in res.rejected:
        output.record_error(bad)
    summary.samples, summary.tokens, summary.resumed = res.samples, res.tokens, feed.resumed
    summary.generated_tokens = res.generated_tokens
    summary.errors = output.num_errors
    summary.shards, summary.capture_stats = res.shards, res.capture_stats
    summary.seconds, summary.flush_seconds = res.seconds, res.flush_seconds
    summary.first_sample_seconds = ex.first_sample_at or 0.0
    output.finish(res.shards, **manifest_fields(cfg, ex.plan, ex.engine_info(), reader))
    return summary


def run_one(cfg: ExtractConfig) -> Summary:
    """`vllm-hidden extract` with one engine: everything checked before the engine starts (the
    paths, the plan, the engine's options through vLLM's parser, every record of the input),
    then the run."""
    check_paths(cfg.model, cfg.input_path, cfg.output_dir, cfg.resume, cfg.s3_endpoint_url, cfg.input_columns)
    plan = plan_extract(cfg)
    with Extractor(cfg, plan, start=False) as ex:  # its engine arguments built (and checked), nothing started
        scan = check_prompts(cfg, plan)
        ex.start()
        return extract_file(ex, cfg.input_path, cfg.output_dir, scan=scan)


def start_extractor(cfg: ExtractConfig, *, start: bool = True, check_io: bool = True) -> Extractor:
    """Check what can be checked before the (slow) engine start, plan the run, then build its
    engine (input and output unchecked for a data-parallel rank: its coordinator did that)."""
    check_paths(cfg.model, cfg.input_path if check_io else None, cfg.output_dir if check_io else None,
                cfg.resume, cfg.s3_endpoint_url, cfg.input_columns)
    return Extractor(cfg, plan_extract(cfg), start=start)

