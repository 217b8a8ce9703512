"""One vLLM engine with the capture path on, for any number of extract runs: its settings
checked and keyed (the cache fingerprint), its start (one cold start compiles while others with
the same settings wait), reconfiguring it for a later run, and its shutdown. Runs in the user's
process (or a data-parallel rank's); the capture itself runs in vLLM's worker. The engine's
arguments are `args`, one run through it is `run`, and the job around it (checks, plan,
output, progress, manifest) is `vllm_hidden.extract`."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from vllm_hidden.config import CaptureConfig, ExtractConfig, Plan, ShardConfig
from vllm_hidden.engine.args import engine_args
from vllm_hidden.engine.caches import CacheDirs, fingerprint, resolve_tp
from vllm_hidden.extract.run import DEFAULT_INFLIGHT_CAP, EngineResult, run_feed

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("vllm_hidden")


class Extractor:
    """One engine with the capture path on; `extract` any number of prompt feeds through it,
    each into its own shards (`extract.job.extract_file` runs a prompt file into an output,
    a data-parallel rank runs its share of a shared queue). The caller checks the paths and
    plans the run (`extract.plan`) first."""

    def __init__(self, cfg: ExtractConfig, plan: Plan, *, start: bool = True) -> None:
        self.engine: Any = None  # vLLM's LLMEngine once started (engine.compat)
        self.t_created = time.perf_counter()
        self.first_sample_at: float | None = None
        self.cache = CacheDirs.resolve(cfg.cache_dir)
        self.cache_dirs = self.cache.apply()  # before vLLM is imported: its processes inherit the cache locations
        os.environ.update(cfg.capture_layout().to_env())  # the buffers the worker allocates inside vLLM's profile
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
                                tp=resolve_tp(cfg.engine_args, cfg.tp), generate_tokens=self.generate_tokens,
                                prefix_cache=cfg.generate is not None)
        written = CaptureConfig.from_additional_config(self.args.additional_config)  # engine_args put it there
        self.layers_run = (written.layers_run if written is not None else None) or plan.info.num_layers
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
        self.start_report: dict[str, Any] = next(
            (r for r in self.engine.collective_rpc("vllm_hidden_start_report") if r), {})
        self.layers_run = int(self.start_report.get("layers_run", self.layers_run))  # what the forward runs

    def _start_engine(self, args):
        """A start with settings no engine has started with before (no stamp) compiles: it
        holds a lock so that engines started at the same time wait and then load what it
        compiled, instead of all compiling the same kernels at once."""
        from vllm_hidden.engine.compat import start_engine

        cache, fp = self.cache, self.fingerprint
        if cache.read_stamp(fp) is None:
            with cache.start_lock(fp):
                if cache.read_stamp(fp) is None:
                    engine = start_engine(args)
                    cache.write_stamp(fp, {"kind": "start", "fingerprint": fp, "settings": self.fingerprint_ident,
                                           "created": time.time()})
                    return engine
        return start_engine(args)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.engine is not None:
            from vllm_hidden.engine import compat

            compat.shutdown_engine(self.engine)
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

    def responses(self):
        """--generate: the responses of a run (extract.generate), with the model's tokenizer
        (loaded once per engine) for stop strings and the response text."""
        from vllm_hidden.extract.generate import Responses, stop_token_ids

        if self._gen_tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._gen_tokenizer = AutoTokenizer.from_pretrained(self.cfg.model)
            except Exception as e:  # noqa: BLE001 - token_ids input can do without: no response text then
                log.warning("vllm-hidden: no tokenizer for %r (%s): generations.jsonl gets no response text",
                            self.cfg.model, e)
                self._gen_tokenizer = False
        tok = self._gen_tokenizer or None
        return Responses(self.cfg.generate, stop_token_ids(self.cfg.model, tok), tok,
                         max_prompt_len=self.max_prompt_len, loss_mask=self.cfg.loss_mask)

    def generate_window(self, final_state: bool) -> int:
        """--generate: rows (prompt + max tokens per request) that may be in flight at once, so
        that what the worker holds for them stays within --max-inflight-bytes."""
        from vllm_hidden.devices import host_memory_bytes

        mc = self.engine.vllm_config.model_config
        row = (len(self.layer_ids) + final_state) * self.info.hidden_size * mc.dtype.itemsize
        budget = self.cfg.max_inflight_bytes or min(DEFAULT_INFLIGHT_CAP, host_memory_bytes() // 4)
        return max(1, budget // row)

    def engine_info(self) -> dict[str, Any]:
        """The engine settings the manifest records (plus its dtype)."""
        from vllm_hidden.engine import quant

        vc = self.engine.vllm_config
        mc, sc = vc.model_config, vc.scheduler_config
        return {"dtype": str(mc.dtype).replace("torch.", ""), "max_model_len": self.max_prompt_len,
                "max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
                "enforce_eager": mc.enforce_eager, "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
                "layers_run": self.layers_run,
                "model_runner": (self.start_report or {}).get("model_runner"),
                "quantization": quant.describe(mc.quantization, mc.hf_config)}

    def extract(self, feed, shard_cfg: ShardConfig, on_progress=None,
                max_inflight_tokens: int | None = None) -> EngineResult:
        """Run every prompt `feed` gives through the engine into shards under `shard_cfg`;
        returns once each of them is durable. At most 2 x max_num_seqs requests (and
        `max_inflight_tokens` rows: prompt tokens, under --generate prompt + max tokens) are in
        the engine at once: enough to fill every step, few enough that engines sharing one feed
        finish together (and, under --generate, that the rows they hold fit in host memory)."""
        return run_feed(self, feed, shard_cfg, on_progress, max_inflight_tokens)
