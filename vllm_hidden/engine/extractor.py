"""One vLLM engine with the capture path on, run prefill-only: prompts from a feed -> engine
-> worker-side capture -> durable shards. Runs in the user's process (or a data-parallel
rank's); the capture itself runs in vLLM's worker. The job around it (checks, plan, output,
progress, manifest) is `vllm_hidden.extract`."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_hidden.config import CaptureConfig, ExtractConfig, Plan, ShardConfig
from vllm_hidden.engine.caches import CacheDirs, fingerprint, resolve_tp
from vllm_hidden.inputs import BadLine
from vllm_hidden.format.shard import ShardInfo

log = logging.getLogger("vllm_hidden")
WORKER_EXTENSION = "vllm_hidden.engine.worker_ext.HiddenStatesWorkerExtension"


def engine_args(model: str, cli_args: list[str], max_prompt_len: int, capture: CaptureConfig | None = None, *,
                dtype: str = "auto", max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                tp: int = 1, generate_tokens: int = 0):
    """vLLM EngineArgs from vLLM's own CLI parser (so every engine flag passes through), set up
    for prefill-only work; with `capture`, the vllm-hidden capture path is switched on (and
    with `capture.layers_run`, the model is cut to that many decoder layers where it can be)."""
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
    # room for the one sampled (discarded) token; --generate: for the response and one token past it
    args.max_model_len = max_prompt_len + 1 + generate_tokens
    if dtype != "auto":
        args.dtype = dtype
    if max_num_batched_tokens is not None:
        args.max_num_batched_tokens = max_num_batched_tokens
    if max_num_seqs is not None:
        args.max_num_seqs = max_num_seqs
    if tp > 1:  # resolved against the arguments' own --tensor-parallel-size (caches.resolve_tp)
        args.tensor_parallel_size = tp
    if capture is not None:
        if args.worker_extension_cls and args.worker_extension_cls != WORKER_EXTENSION:
            raise ValueError(f"--worker-extension-cls {args.worker_extension_cls!r} cannot be combined with capture")
        args.worker_extension_cls = WORKER_EXTENSION
        if capture.layers_run is not None and not _can_truncate(args):
            capture = dataclasses.replace(capture, layers_run=None)
        if capture.layers_run is not None:
            from vllm_hidden.engine.truncate import hf_overrides

            args.hf_overrides = hf_overrides(capture.layers_run)
        args.additional_config = {**(args.additional_config or {}), **capture.to_additional_config()}
        if not generate_tokens:
            _taper_the_end(args)
    return args


def _taper_the_end(args) -> None:
    """Prefill-only: the last steps of a run shrink so that their rows reach disk as the GPU
    finishes (engine.scheduler)."""
    from vllm_hidden.engine import scheduler

    if args.scheduler_cls is not None:
        log.info("vllm-hidden: --scheduler-cls %s given; the end of a run is not tapered", args.scheduler_cls)
        return
    args.scheduler_cls = scheduler.QUALNAME


# load formats read through vLLM's default loader, whose weight iterator drops a cut model's
# extra layers (plugin.py), and random weights (nothing to drop)
TRUNCATABLE_LOAD_FORMATS = frozenset({"auto", "safetensors", "pt", "npcache", "fastsafetensors", "dummy"})


def _can_truncate(args) -> bool:
    if args.hf_overrides:
        log.info("vllm-hidden: --hf-overrides given; running every decoder layer")
        return False
    if str(args.load_format) not in TRUNCATABLE_LOAD_FORMATS:
        log.info("vllm-hidden: --load-format %s cannot drop the cut layers' weights; running every decoder layer",
                 args.load_format)
        return False
    if args.speculative_config:
        log.info("vllm-hidden: a speculative config needs the whole target; running every decoder layer")
        return False
    return True


STATUS_EVERY_S = 1.0  # how often a running extract asks the workers whether capture failed
DEFAULT_INFLIGHT_CAP = 32 << 30  # --generate: host memory for in-flight rows, at most (default)
END_EVERY_S = 0.25  # --generate: how often the ends of finished responses go to the worker (one RPC)


class CaptureFailed(RuntimeError):
    """Capture stopped in the worker: the storage failed (`storage`: disk full, S3 unreachable
    past its retries) or a bug. The engine is still up."""

    def __init__(self, failure: dict[str, Any]) -> None:
        self.storage = bool(failure.get("storage"))
        msg = failure["message"]
        if self.storage:
            msg += "; the shards made durable before it are kept: fix it, then rerun with --resume"
        super().__init__(msg)


def _check_capture(replies: list[Any]) -> None:
    for r in replies:
        if r:
            raise CaptureFailed(r)


class EngineDied(RuntimeError):
    """The engine's core process died under a run (killed, out of memory, a crash in a kernel)."""


@dataclass
class EngineResult:
    """What one engine extracted from its feed (shard paths relative to its part)."""

    samples: int = 0
    tokens: int = 0
    generated_tokens: int = 0  # --generate: response tokens kept (counted in `tokens` too)
    shards: list[ShardInfo] = field(default_factory=list)
    rejected: list[BadLine] = field(default_factory=list)  # prompts the engine's own validation refused
    seconds: float = 0.0  # first prompt added .. every shard durable
    flush_seconds: float = 0.0
    capture_stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "tokens": self.tokens, "generated_tokens": self.generated_tokens,
                "shards": [s.to_dict() for s in self.shards],
                "rejected": [b.to_dict() for b in self.rejected], "seconds": self.seconds,
                "flush_seconds": self.flush_seconds, "capture_stats": self.capture_stats}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineResult":
        return cls(samples=d["samples"], tokens=d["tokens"], generated_tokens=d.get("generated_tokens", 0), shards=[ShardInfo(**s) for s in d["shards"]],
                   rejected=[BadLine(b["line"], b["id"], b["reason"]) for b in d["rejected"]],
                   seconds=d["seconds"], flush_seconds=d["flush_seconds"], capture_stats=d["capture_stats"])


class Extractor:
    """One engine with the capture path on; `extract` any number of prompt feeds through it,
    each into its own shards (`extract.job.extract_file` runs a prompt file into an output,
    a data-parallel rank runs its share of a shared queue). The caller checks the paths and
    plans the run (`extract.plan`) first."""

    def __init__(self, cfg: ExtractConfig, plan: Plan, *, start: bool = True) -> None:
        self.engine = None
        self.t_created = time.perf_counter()
        self.first_sample_at: float | None = None
        self.cache = CacheDirs.resolve(cfg.cache_dir)
        self.cache_dirs = self.cache.apply()  # before vLLM is imported: its processes inherit the cache locations
        self.cfg = cfg
        self.plan = plan
        self.info = plan.info
        self.layer_ids = plan.layer_ids
        self.max_prompt_len = plan.max_prompt_len
        self._gen_tokenizer = None
        cut = plan.layers_run if 0 < plan.layers_run < plan.info.num_layers else None
        capture = CaptureConfig(layer_ids=tuple(self.layer_ids), ring_slots=cfg.ring_slots, layers_run=cut)

        from vllm_hidden.engine import compat

        compat.check_version()
        compat.spawn_on_cuda()
        self.generate_tokens = cfg.generate.max_tokens + 1 if cfg.generate is not None else 0
        if plan.info.max_positions is not None and \
                self.max_prompt_len + 1 + self.generate_tokens > plan.info.max_positions:
            compat.allow_long_max_model_len()
        self.args = engine_args(cfg.model, cfg.engine_args, self.max_prompt_len, capture, dtype=cfg.dtype,
                                max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                                tp=resolve_tp(cfg.engine_args, cfg.tp), generate_tokens=self.generate_tokens)
        self.layers_run = CaptureConfig.from_additional_config(self.args.additional_config).layers_run \
            or plan.info.num_layers
        if cfg.generate is not None and cfg.generate.seed is not None:
            compat.check_seeded_generation(self.args)
        compat.check_parallel(self.args.pipeline_parallel_size)  # before an engine start fails on it less clearly
        compat.bind_cpu_threads(self.args.tensor_parallel_size)
        self.fingerprint, self.fingerprint_ident = fingerprint(
            mode="extract", model=cfg.model, engine_args=cfg.engine_args, device=compat.device_name(),
            cache_dirs=self.cache_dirs, env_digest=compat.compile_env_digest(),
            settings={"layer_ids": list(self.layer_ids), "model_runner": compat.requested_runner(),
                      "ring_slots": cfg.ring_slots, "max_model_len": self.max_prompt_len,
                      "dtype": cfg.dtype, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                      "max_num_seqs": cfg.max_num_seqs, "tp": self.args.tensor_parallel_size,
                      **({"layers_run": self.layers_run} if self.layers_run < plan.info.num_layers else {}),
                      **({"generate_tokens": self.generate_tokens} if self.generate_tokens else {})})
        if start:
            self.start()

    def start(self) -> None:
        from vllm_hidden.engine import compat

        t0 = time.perf_counter()
        self.engine = self._start_engine(self.args)
        compat.watch_engine_death(self.engine)
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

    def reconfigure(self, cfg: ExtractConfig, plan: Plan) -> None:
        """Run later extracts of this engine with `cfg` (other sampling, --generate or prefill
        only, other output options): refused where they would need another engine."""
        same = ("model", "engine_args", "dtype", "max_num_batched_tokens", "max_num_seqs", "tp", "ring_slots")
        if cfg.needs_full_model and self.layers_run < self.info.num_layers:
            raise ValueError(f"this engine runs {self.layers_run} of the model's {self.info.num_layers} layers; "
                             "--final-state and --generate need another engine with all of them")
        for name in same:
            if getattr(cfg, name) != getattr(self.cfg, name):
                raise ValueError(f"{name}={getattr(cfg, name)!r} needs another engine (this one has "
                                 f"{getattr(self.cfg, name)!r})")
        if plan.layer_ids != self.layer_ids:
            raise ValueError(f"layer ids {plan.layer_ids} need another engine (this one captures {self.layer_ids})")
        need = plan.max_prompt_len + 1 + (cfg.generate.max_tokens + 1 if cfg.generate is not None else 0)
        if need > self.args.max_model_len:
            raise ValueError(f"prompts of up to {plan.max_prompt_len} tokens"
                             f"{' + the response' if cfg.generate else ''} need max_model_len {need}; this engine "
                             f"has {self.args.max_model_len}")
        self.cfg, self.plan, self.max_prompt_len = cfg, plan, plan.max_prompt_len

    def _done(self, res: EngineResult, rows: int) -> int:
        if self.first_sample_at is None:
            self.first_sample_at = time.perf_counter() - self.t_created
        res.tokens += rows
        res.samples += 1
        return rows

    def _responses(self):
        from vllm_hidden.engine.generate import Responses, stop_token_ids

        if self._gen_tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._gen_tokenizer = AutoTokenizer.from_pretrained(self.cfg.model)
            except Exception as e:  # noqa: BLE001 - token_ids input can do without: no response text then
                log.warning("vllm-hidden: no tokenizer for %r (%s): generations.jsonl gets no response text",
                            self.cfg.model, e)
                self._gen_tokenizer = False
        tok = self._gen_tokenizer or None
        return Responses(self.cfg.generate, stop_token_ids(self.cfg.model, tok), tok)

    def generate_window(self, final_state: bool) -> int:
        """--generate: rows (prompt + max tokens per request) that may be in flight at once, so
        that what the worker holds for them stays within --max-inflight-bytes."""
        from vllm_hidden.devices import host_memory_bytes

        mc = self.engine.vllm_config.model_config
        row = (len(self.layer_ids) + final_state) * self.info.hidden_size * mc.dtype.itemsize
        budget = self.cfg.max_inflight_bytes or min(DEFAULT_INFLIGHT_CAP, host_memory_bytes() // 4)
        return max(1, budget // row)

    def _send_ends(self, ends: dict[int, dict[str, Any]]) -> None:
        self.engine.collective_rpc("vllm_hidden_generated", args=(dict(ends),))
        ends.clear()

    def engine_info(self) -> dict[str, Any]:
        """The engine settings the manifest records (plus its dtype)."""
        vc = self.engine.vllm_config
        mc, sc = vc.model_config, vc.scheduler_config
        return {"dtype": str(mc.dtype).replace("torch.", ""), "max_model_len": self.max_prompt_len,
                "max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
                "enforce_eager": mc.enforce_eager, "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
                "layers_run": int(mc.hf_text_config.num_hidden_layers),
                "model_runner": (self.start_report or {}).get("model_runner")}

    def extract(self, feed, shard_cfg: ShardConfig, on_progress=None,
                max_inflight_tokens: int | None = None) -> EngineResult:
        """Run every prompt `feed` gives through the engine into shards under `shard_cfg`;
        returns once each of them is durable. At most 2 x max_num_seqs requests (and
        `max_inflight_tokens` rows: prompt tokens, under --generate prompt + max tokens) are in
        the engine at once: enough to fill every step, few enough that engines sharing one feed
        finish together (and, under --generate, that the rows they hold fit in host memory)."""
        from vllm_hidden.engine import compat
        from vllm_hidden.engine.runner import LINE_KEY, LOSS_KEY, REQUEST_KEY
        from vllm_hidden.engine.scheduler import LAST_KEY

        engine = self.engine
        if engine is None:
            raise RuntimeError("the extractor is closed")
        res = EngineResult()
        opened = False
        inflight: dict[str, int] = {}
        tokens_inflight = 0
        responses = self._responses() if self.cfg.generate is not None else None
        if responses is not None:
            # responses hold their rows for hundreds of steps: memory, not step-filling, sets the window
            max_inflight_tokens = self.generate_window(shard_cfg.final_state)
        max_tokens = max_inflight_tokens or float("inf")
        ends: dict[int, dict[str, Any]] = {}  # --generate: input line -> its end, not yet sent to the worker
        try:
            opened = any(engine.collective_rpc("vllm_hidden_open", args=(shard_cfg.to_dict(),)))
            if not opened:
                raise RuntimeError("no worker opened a capture sink")
            max_inflight = 2 * engine.vllm_config.scheduler_config.max_num_seqs
            t1 = time.perf_counter()
            next_check = next_ends = t1 + STATUS_EVERY_S
            while True:
                while not feed.exhausted and len(inflight) < max_inflight and tokens_inflight < max_tokens:
                    item = feed.next(wait=not inflight)
                    if item is None:
                        break
                    rid = str(item.line)
                    extra = {REQUEST_KEY: item.id, LINE_KEY: item.line}
                    if responses is not None:
                        params = responses.params(rid, item, extra)
                        rows = len(item.token_ids) + self.cfg.generate.max_tokens
                    else:
                        if shard_cfg.loss_mask:  # a few [start, end) pairs, not a per-token list
                            spans = item.loss_spans if item.loss_spans is not None else [(0, len(item.token_ids))]
                            extra[LOSS_KEY] = [list(s) for s in spans]  # a prompt without one: every token
                        if feed.exhausted:  # the run's last prompt: its last steps taper (engine.scheduler)
                            extra[LAST_KEY] = True
                        params = compat.prefill_sampling_params(extra)
                        rows = len(item.token_ids)
                    try:
                        engine.add_request(rid, {"prompt_token_ids": item.token_ids}, params)
                    except ValueError as e:  # the engine's own validation
                        res.rejected.append(BadLine(item.line, item.id, f"rejected by the engine: {e}"))
                        if responses is not None:
                            responses.forget(rid)
                        continue
                    inflight[rid] = rows
                    tokens_inflight += rows
                if not inflight:
                    if ends:
                        self._send_ends(ends)
                    if feed.exhausted:
                        break
                    continue
                if responses is None:
                    for o in engine.step():
                        if o.finished and o.request_id in inflight:
                            tokens_inflight -= self._done(res, inflight.pop(o.request_id))
                else:
                    aborts = []
                    for o in engine.step():
                        if o.request_id not in inflight:
                            continue  # aborted a step ago: its last output
                        got = responses.update(o.request_id, list(o.outputs[0].token_ids), o.finished)
                        if got is None:
                            continue
                        tokens_inflight -= inflight.pop(o.request_id)
                        if isinstance(got, BadLine):
                            res.rejected.append(got)
                            ends[got.line] = {"drop": got.reason}  # its rows go
                            continue
                        if got.abort:
                            aborts.append(got.rid)
                        ends[got.line] = got.end
                        self._done(res, got.rows)
                        res.generated_tokens += got.generated
                    if aborts:
                        engine.abort_request(aborts)
                    # one RPC for many samples; the worker writes a sample only once it knows its end
                    if ends and time.perf_counter() >= next_ends:
                        self._send_ends(ends)
                        next_ends = time.perf_counter() + END_EVERY_S
                if on_progress is not None:
                    on_progress(res.samples, res.tokens)
                if time.perf_counter() >= next_check:  # one small RPC a second: stop soon after a failure
                    _check_capture(engine.collective_rpc("vllm_hidden_status"))
                    next_check = time.perf_counter() + STATUS_EVERY_S
            t2 = time.perf_counter()
            opened = False
            result = engine.collective_rpc("vllm_hidden_close")
            _check_capture([r.get("error") for r in result if r])
            res.seconds = time.perf_counter() - t1
            res.flush_seconds = time.perf_counter() - t2
        except Exception as e:
            if not compat.engine_dead(engine):
                raise
            opened = False  # the writer died with it; only what it had made durable counts
            raise EngineDied(f"the vLLM engine process died mid-run ({type(e).__name__}; killed, or out of memory: "
                             "see the log above); the shards made durable before it are kept: rerun with --resume "
                             "to finish") from e
        finally:
            if opened:  # failed mid-run: drop its requests, stop the writer threads, keep the engine usable
                try:
                    if inflight:
                        engine.abort_request(list(inflight))
                    engine.collective_rpc("vllm_hidden_close")  # its error, if any, is the one raised
                except Exception:  # noqa: BLE001 - the original error is what matters
                    log.exception("vllm-hidden: closing the capture sink after a failure")
        out = next(r for r in result if r is not None)
        res.shards = [ShardInfo(**s) for s in out["shards"]]
        res.capture_stats = out.get("stats", {})
        # NaN/Inf samples are not written: each becomes an error record and does not count as done
        bad = [BadLine(line, sid, why) for sid, line, why in out["not_finite"]]
        res.rejected.extend(bad)
        if bad:
            res.samples -= len(bad)
            res.tokens = sum(s.num_tokens for s in res.shards)
            res.generated_tokens = -1 if responses is not None else 0  # not known per sample here
        written = sum(s.num_samples for s in res.shards)
        if written != res.samples or out["incomplete"]:
            raise RuntimeError(f"engine finished {res.samples} samples but {written} were written "
                               f"(incomplete: {out['incomplete'][:5]}, still assembling: {out['in_flight']})")
        return res
