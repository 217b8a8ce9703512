"""Extraction driver: prompts -> vLLM engine (prefill only) -> worker-side capture -> shards
-> manifest. Runs in the user's process; the capture itself runs in vLLM's worker."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hidden import __version__
from vllm_hidden.config import CaptureConfig, ExtractConfig, ShardConfig
from vllm_hidden.engine.caches import CacheDirs, fingerprint
from vllm_hidden.inputs import BadLine, PromptReader, count_lines
from vllm_hidden.layers import SEMANTICS, resolve_layer_ids
from vllm_hidden.storage.journal import RUN, ResumeState, prepare_resume, write_json_atomic
from vllm_hidden.storage.manifest import ERRORS, MANIFEST, Manifest
from vllm_hidden.storage.s3 import S3Location, is_s3, read_done_ids
from vllm_hidden.storage.shards import FORMAT, ShardInfo, shard_number

log = logging.getLogger("vllm_hidden")
WORKER_EXTENSION = "vllm_hidden.engine.worker_ext.HiddenStatesWorkerExtension"


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int | None


def model_info(model: str) -> ModelInfo:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model)
    except Exception as e:  # noqa: BLE001 - re-raised with the model named
        raise ValueError(f"cannot read the model config of {model!r}: {e}") from None
    text = cfg.get_text_config()
    return ModelInfo(
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        max_positions=getattr(text, "max_position_embeddings", None),
    )


def check_paths(model: str, input_path: str, output_dir: str, resume: bool = False,
                s3_endpoint_url: str | None = None) -> None:
    """Fail before the (slow) engine start on anything we can check up front."""
    if not Path(input_path).is_file():
        raise ValueError(f"--input: no such file {input_path!r}")
    if (model.startswith((".", "/", "~")) or Path(model).exists()) and not Path(model).expanduser().is_dir():
        raise ValueError(f"--model: no such model directory {model!r}")
    if is_s3(output_dir):
        loc = S3Location(output_dir, s3_endpoint_url)
        try:
            names = loc.names()
        except Exception as e:  # noqa: BLE001 - re-raised with the location named
            raise ValueError(f"--output: cannot list {loc.uri!r}: {e}") from None
        if names and not resume:
            raise ValueError(f"--output: {loc.uri!r} is not empty; pass --resume to continue the run that wrote it, "
                             "or choose a new prefix")
        if names and RUN not in names:
            raise ValueError(f"--resume: {loc.uri!r} is not empty and has no {RUN}; it is not a vllm-hidden output")
        return
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output: {output_dir!r} is not a directory")
    if out.exists() and any(out.iterdir()):
        if not resume:
            raise ValueError(f"--output: {output_dir!r} exists and is not empty; pass --resume to continue the "
                             "run that wrote it, or choose a new directory")
        if not (out / RUN).is_file():
            raise ValueError(f"--resume: {output_dir!r} is not empty and has no {RUN}; it is not a vllm-hidden output")


def engine_args(model: str, cli_args: list[str], max_prompt_len: int, capture: CaptureConfig | None = None, *,
                dtype: str = "auto", max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None):
    """vLLM EngineArgs from vLLM's own CLI parser (so every engine flag passes through), set up
    for prefill-only work; with `capture`, the vllm-hidden capture path is switched on."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm-hidden extract"))
    try:
        ns = parser.parse_args(["--model", model, *cli_args])
    except SystemExit:
        raise ValueError(f"invalid engine arguments: {' '.join(cli_args)!r}") from None
    args = EngineArgs.from_cli_args(ns)
    if args.enable_prefix_caching:
        raise ValueError("--enable-prefix-caching: cached prompt tokens are not recomputed, so their "
                         "hidden states would be missing; extract runs with prefix caching off")
    args.enable_prefix_caching = False
    args.skip_tokenizer_init = True  # we tokenize (and validate) before the engine
    args.max_model_len = max_prompt_len + 1  # room for the one sampled (discarded) token
    if dtype != "auto":
        args.dtype = dtype
    if max_num_batched_tokens is not None:
        args.max_num_batched_tokens = max_num_batched_tokens
    if max_num_seqs is not None:
        args.max_num_seqs = max_num_seqs
    if capture is not None:
        if args.worker_extension_cls and args.worker_extension_cls != WORKER_EXTENSION:
            raise ValueError(f"--worker-extension-cls {args.worker_extension_cls!r} cannot be combined with capture")
        args.worker_extension_cls = WORKER_EXTENSION
        args.additional_config = {**(args.additional_config or {}), **capture.to_additional_config()}
    return args


@dataclass
class Summary:
    samples: int = 0
    tokens: int = 0
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples, "tokens": self.tokens, "errors": self.errors, "resumed": self.resumed,
            "shards": len(self.shards), "bytes": sum(s.bytes for s in self.shards),
            "seconds": round(self.seconds, 3), "engine_init_seconds": round(self.engine_init_seconds, 3),
            "flush_seconds": round(self.flush_seconds, 3),
            "first_sample_seconds": round(self.first_sample_seconds, 3), "engine_start": self.engine_start,
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else 0.0,
            "samples_per_s": round(self.samples / self.seconds, 2) if self.seconds else 0.0,
            "output_dir": self.output_dir,
            "capture_stats": self.capture_stats,
        }


class _Progress:
    """rich progress bar with tokens/s, samples/s and ETA (or nothing when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.p = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.p = Progress(
            TextColumn("extract"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[tps]:>9,.0f} tok/s {task.fields[sps]:>7,.1f} samples/s err {task.fields[err]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
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


class Extractor:
    """One engine with the capture path on; `run` any number of prompt files through it
    (each into its own output directory). `run_extract` is one Extractor, one run."""

    def __init__(self, cfg: ExtractConfig, *, start: bool = True) -> None:
        self.engine = None
        self.t_created = time.perf_counter()
        self.first_sample_at: float | None = None
        self.cache = CacheDirs.resolve(cfg.cache_dir)
        self.cache_dirs = self.cache.apply()  # before vLLM is imported: its processes inherit the cache locations
        check_paths(cfg.model, cfg.input_path, cfg.output_dir, cfg.resume, cfg.s3_endpoint_url)
        self.cfg = cfg
        self.info = info = model_info(cfg.model)
        self.layer_ids = resolve_layer_ids(info.num_layers, cfg.layers, cfg.aux_layers, cfg.layers_from)
        if cfg.max_model_len and info.max_positions and cfg.max_model_len > info.max_positions:
            raise ValueError(f"--max-model-len {cfg.max_model_len} is above the model's limit of {info.max_positions} positions")
        self.max_prompt_len = cfg.max_model_len or info.max_positions
        if not self.max_prompt_len:
            raise ValueError(f"--max-model-len is required: {cfg.model!r} does not state max_position_embeddings")
        capture = CaptureConfig(layer_ids=tuple(self.layer_ids), ring_slots=cfg.ring_slots)

        from vllm_hidden.engine import compat

        compat.check_version()
        compat.pin_v1_runner()
        compat.spawn_on_cuda()
        if info.max_positions is not None and self.max_prompt_len + 1 > info.max_positions:
            compat.allow_long_max_model_len()
        self.args = engine_args(cfg.model, cfg.engine_args, self.max_prompt_len, capture, dtype=cfg.dtype,
                                max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs)
        self.fingerprint, self.fingerprint_ident = fingerprint(
            mode="extract", model=cfg.model, engine_args=cfg.engine_args, device=compat.device_name(),
            cache_dirs=self.cache_dirs, env_digest=compat.compile_env_digest(),
            settings={"layer_ids": list(self.layer_ids), "ring_slots": cfg.ring_slots, "max_model_len": self.max_prompt_len,
                      "dtype": cfg.dtype, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                      "max_num_seqs": cfg.max_num_seqs})
        if start:
            self.start()

    def start(self) -> None:
        t0 = time.perf_counter()
        self.engine = self._start_engine(self.args)
        self.engine_init_seconds = time.perf_counter() - t0
        self.start_report = next((r for r in self.engine.collective_rpc("vllm_hidden_start_report") if r), {})

    def _start_engine(self, args):
        """A start with settings no engine has started with before (no stamp) compiles: it
        holds a lock so that engines started at the same time wait and then load what it
        compiled, instead of all compiling the same kernels at once."""
        from vllm.v1.engine.llm_engine import LLMEngine

        cache, fp = self.cache, self.fingerprint
        if cache.read_stamp(fp) is None:
            with cache.start_lock(fp):
                if cache.read_stamp(fp) is None:
                    engine = LLMEngine.from_engine_args(args)
                    cache.write_stamp(fp, {"kind": "start", "fingerprint": fp, "settings": self.fingerprint_ident,
                                           "created": time.time()})
                    return engine
        return LLMEngine.from_engine_args(args)

    def __enter__(self) -> "Extractor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.engine_core.shutdown()
            self.engine = None

    def _tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.cfg.model)

    def _identity(self) -> dict[str, Any]:
        m = self.cfg.model
        model = str(Path(m).expanduser().resolve()) if Path(m).expanduser().is_dir() else m
        return {"format": FORMAT, "model": model, "layer_ids": list(self.layer_ids),
                "hidden_size": self.info.hidden_size}

    def _start_output(self, out: Path, resume: bool):
        """A new output gets run.json first; a resumed one is checked against it and cleaned
        of what the interrupted attempt left half-done. Returns the resume state or None."""
        if resume and (out / RUN).is_file():
            self._check_identity(json.loads((out / RUN).read_text()), str(out))
            state = prepare_resume(out)
            if state.removed:
                log.info("vllm-hidden: resume removed %d unfinished files: %s", len(state.removed), state.removed[:5])
            return state
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / RUN, self._identity())
        return None

    def _check_identity(self, prev: dict[str, Any], where: str) -> None:
        ident = self._identity()
        for k in ("format", "model", "layer_ids", "hidden_size"):
            if prev.get(k) != ident[k]:
                raise ValueError(f"--resume: {where!r} was written with {k}={prev.get(k)!r}, this run has {k}={ident[k]!r}")

    def _start_s3_output(self, loc: S3Location, staging: Path, resume: bool) -> ResumeState | None:
        """S3 twin of _start_output: the shard objects under the prefix are what is done (an
        object exists only once its upload completed); the staging directory starts empty."""
        import shutil

        names = loc.names()
        state = None
        if names and resume:
            self._check_identity(loc.get_json(RUN), loc.uri)
            aborted = loc.abort_stale_uploads()
            shards = loc.shard_infos()
            state = ResumeState(shards=shards, done_ids=read_done_ids(loc, shards))
            state.next_index = max((shard_number(s.file) for s in shards), default=-1) + 1
            for name in (MANIFEST, ERRORS):  # rewritten by this run
                if name in names:
                    loc.client.delete_object(Bucket=loc.bucket, Key=loc.key(name))
            if aborted:
                log.info("vllm-hidden: resume aborted %d unfinished multipart uploads under %s", aborted, loc.uri)
        elif not names:
            loc.put_json(RUN, self._identity())
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return state

    def _staging(self, loc: S3Location) -> Path:
        import tempfile

        if self.cfg.staging_dir:
            return Path(self.cfg.staging_dir)
        return Path(tempfile.gettempdir()) / "vllm-hidden-staging" / loc.bucket / (loc.prefix or "_")

    def run(self, input_path: str, output_dir: str, progress: bool | None = None,
            resume: bool | None = None) -> Summary:
        from vllm_hidden.engine import compat
        from vllm_hidden.engine.runner import REQUEST_KEY

        cfg, engine = self.cfg, self.engine
        resume = cfg.resume if resume is None else resume
        if engine is None:
            raise RuntimeError("the extractor is closed")
        check_paths(cfg.model, input_path, output_dir, resume, cfg.s3_endpoint_url)
        loc = S3Location(output_dir, cfg.s3_endpoint_url) if is_s3(output_dir) else None
        if loc is not None:
            out = self._staging(loc)  # shards are written here, then uploaded and evicted
            state = self._start_s3_output(loc, out, resume)
        else:
            out = Path(output_dir)
            state = self._start_output(out, resume)
        done_ids = state.done_ids if state else set()
        shard_cfg = ShardConfig(output_dir=str(out), max_shard_bytes=cfg.max_shard_bytes,
                                writer_threads=cfg.writer_threads, first_index=state.next_index if state else 0,
                                upload_uri=loc.uri if loc else None, s3_endpoint_url=cfg.s3_endpoint_url)
        reader = PromptReader(input_path, vocab_size=self.info.vocab_size, max_prompt_len=self.max_prompt_len,
                              tokenizer_loader=self._tokenizer)
        total = count_lines(input_path)
        summary = Summary(engine_init_seconds=self.engine_init_seconds, output_dir=loc.uri if loc else str(out),
                          engine_start=self.start_report)
        errors_f = None

        def record_error(bad: BadLine) -> None:
            nonlocal errors_f
            if errors_f is None:
                errors_f = open(out / ERRORS, "w")
            errors_f.write(json.dumps(bad.to_dict()) + "\n")
            summary.errors += 1

        bar = _Progress(total, cfg.progress if progress is None else progress)
        opened = False
        inflight: dict[str, int] = {}
        try:
            opened = any(engine.collective_rpc("vllm_hidden_open", args=(shard_cfg.to_dict(),)))
            if not opened:
                raise RuntimeError("no worker opened a capture sink")
            max_inflight = 2 * engine.vllm_config.scheduler_config.max_num_seqs
            prompts = iter(reader)
            exhausted = False
            t1 = time.perf_counter()
            while True:
                while not exhausted and len(inflight) < max_inflight:
                    item = next(prompts, None)
                    if item is None:
                        exhausted = True
                        break
                    if isinstance(item, BadLine):
                        record_error(item)
                        continue
                    if item.id in done_ids:  # in a durable shard of an earlier attempt
                        summary.resumed += 1
                        continue
                    rid = str(item.line)
                    params = compat.prefill_sampling_params({REQUEST_KEY: item.id})
                    try:
                        engine.add_request(rid, {"prompt_token_ids": item.token_ids}, params)
                    except ValueError as e:  # the engine's own validation
                        record_error(BadLine(item.line, item.id, f"rejected by the engine: {e}"))
                        continue
                    inflight[rid] = len(item.token_ids)
                if not inflight:
                    if exhausted:
                        break
                    continue
                for o in engine.step():
                    if o.finished and o.request_id in inflight:
                        if self.first_sample_at is None:
                            self.first_sample_at = time.perf_counter() - self.t_created
                        summary.tokens += inflight.pop(o.request_id)
                        summary.samples += 1
                bar.update(summary.samples + summary.resumed, summary.tokens, summary.errors)
            t2 = time.perf_counter()
            summary.first_sample_seconds = self.first_sample_at or 0.0
            opened = False
            result = engine.collective_rpc("vllm_hidden_close")
            summary.seconds = time.perf_counter() - t1
            summary.flush_seconds = time.perf_counter() - t2
        finally:
            bar.close()
            if errors_f is not None:
                errors_f.close()
            if opened:  # failed mid-run: drop its requests, stop the writer threads, keep the engine usable
                try:
                    if inflight:
                        engine.abort_request(list(inflight))
                    engine.collective_rpc("vllm_hidden_close")
                except Exception:  # noqa: BLE001 - the original error is what matters
                    log.exception("vllm-hidden: closing the capture sink after a failure")
        res = next(r for r in result if r is not None)
        summary.shards = [ShardInfo(**s) for s in res["shards"]]
        summary.capture_stats = res.get("stats", {})
        written = sum(s.num_samples for s in summary.shards)
        if written != summary.samples or res["incomplete"]:
            raise RuntimeError(f"engine finished {summary.samples} samples but {written} were written "
                               f"(incomplete: {res['incomplete'][:5]}, still assembling: {res['in_flight']})")
        mc = engine.vllm_config.model_config
        info = self.info
        shards = sorted([*(state.shards if state else []), *summary.shards], key=lambda s: s.file)
        Manifest(
            model=cfg.model, layer_ids=self.layer_ids, layer_semantics=SEMANTICS, num_model_layers=info.num_layers,
            hidden_size=info.hidden_size, dtype=str(mc.dtype).replace("torch.", ""), shards=shards,
            num_errors=summary.errors, errors_file=ERRORS if summary.errors else None,
            versions={"vllm": compat.VLLM_VERSION, "vllm_hidden": __version__},
            engine={"max_model_len": self.max_prompt_len,
                    "max_num_batched_tokens": engine.vllm_config.scheduler_config.max_num_batched_tokens,
                    "max_num_seqs": engine.vllm_config.scheduler_config.max_num_seqs, "enforce_eager": mc.enforce_eager},
        ).write(out)
        if loc is not None:  # errors, then the manifest last; then the staging directory goes
            import shutil

            if summary.errors:
                loc.put_file(out / ERRORS, ERRORS)
            loc.put_file(out / MANIFEST, MANIFEST)
            shutil.rmtree(out, ignore_errors=True)
        return summary


def run_extract(cfg: ExtractConfig) -> Summary:
    with Extractor(cfg) as ex:
        return ex.run(cfg.input_path, cfg.output_dir)
