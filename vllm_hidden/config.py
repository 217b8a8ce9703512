"""Validated configuration dataclasses (pure; no vLLM)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import vllm_hidden.envs as envs
from vllm_hidden.envs import get as env_value
from vllm_hidden.layers import to_aux_ids

ADDITIONAL_CONFIG_KEY = "vllm_hidden"


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    """What the model runner captures. Lives in vLLM's `additional_config`, which vLLM
    hashes into its compile-cache key, so a changed layer list never reuses a stale graph."""

    layer_ids: tuple[int, ...]
    ring_slots: int = 2
    layers_run: int | None = None  # the engine runs decoder layers 0 .. layers_run-1 only (None: all)

    def __post_init__(self) -> None:
        if self.layers_run is not None and (isinstance(self.layers_run, bool) or not isinstance(self.layers_run, int)
                                            or self.layers_run < 1):
            raise ValueError(f"layers_run must be a positive int or None, got {self.layers_run!r}")
        ids = tuple(self.layer_ids)
        object.__setattr__(self, "layer_ids", ids)
        if not ids:
            raise ValueError(f"layer_ids must not be empty, got {self.layer_ids!r}")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"layer_ids must be non-negative ints, got {self.layer_ids!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"layer_ids must be unique, got {self.layer_ids!r}")
        if not isinstance(self.ring_slots, int) or self.ring_slots < 2:
            raise ValueError(f"ring_slots must be an int >= 2, got {self.ring_slots!r}")

    @property
    def aux_ids(self) -> tuple[int, ...]:
        """What the model is asked for: sorted, because it emits aux states in layer order."""
        return tuple(sorted(to_aux_ids(self.layer_ids)))

    @property
    def emit_order(self) -> tuple[int, ...]:
        """For each requested layer (in `layer_ids` order), its index among the model's aux outputs."""
        srt = sorted(self.layer_ids)
        return tuple(srt.index(i) for i in self.layer_ids)

    def to_additional_config(self) -> dict[str, Any]:
        raw = {"layer_ids": list(self.layer_ids), "ring_slots": self.ring_slots}
        if self.layers_run is not None:  # hashed by vLLM with the rest: a cut model compiles apart
            raw["layers_run"] = self.layers_run
        return {ADDITIONAL_CONFIG_KEY: raw}

    @classmethod
    def from_additional_config(cls, additional: dict[str, Any] | None) -> "CaptureConfig | None":
        raw = (additional or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a dict, got {raw!r}")
        return cls(layer_ids=tuple(raw["layer_ids"]), ring_slots=int(raw.get("ring_slots", 2)),
                   layers_run=raw.get("layers_run"))


@dataclass(frozen=True, kw_only=True)
class CaptureLayout:
    """What a captured row carries beside the selected layers, which sizes the worker's device
    step buffer and host ring (`capture.ring.StepTransfer`): the model's final normed output
    as one more column (`final_state`), float8 values with float32 scales (`fp8`; `per_token`:
    one scale per token, hs_connectors' layout, else one per token and layer), per-column row
    sums for an output's per-layer statistics (`row_sums`).

    The worker allocates the buffers at model load, inside vLLM's memory profile; the commands
    that start vLLM put the layout their sink will open with in the environment (`ENV`), so
    what the engine keeps is what vLLM profiled. Not in `additional_config`: the compiled model
    is the same for every layout, so a changed layout must not recompile it."""

    final_state: bool = False
    fp8: bool = False
    per_token: bool = False
    row_sums: bool = False

    ENV = envs.CAPTURE_LAYOUT

    def __post_init__(self) -> None:
        for name in ("final_state", "fp8", "per_token", "row_sums"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CaptureLayout.{name} must be a bool, got {getattr(self, name)!r}")
        if self.per_token and not self.fp8:
            raise ValueError("CaptureLayout.per_token (one fp8 scale per token) needs fp8=True")

    @classmethod
    def for_shards(cls, shard: "ShardConfig") -> "CaptureLayout":
        """An extract's (and its warmup's): as its shards store the rows."""
        return cls(final_state=shard.final_state, fp8=shard.fp8, row_sums=shard.layer_stats)

    @classmethod
    def for_server(cls, connector: "ConnectorConfig | None") -> "CaptureLayout":
        """A server's: layers only; hs_connectors' FP8 files quantized on the device."""
        fp8 = connector is not None and connector.fp8
        return cls(fp8=fp8, per_token=fp8)

    def to_env(self) -> dict[str, str]:
        import json

        return {self.ENV: json.dumps(asdict(self), sort_keys=True)}

    @classmethod
    def from_env(cls, env: Any) -> "CaptureLayout | None":
        import json

        raw = env.get(cls.ENV)
        if not raw:
            return None
        try:
            d = json.loads(raw)
            return cls(**{k: d[k] for k in ("final_state", "fp8", "per_token", "row_sums")})
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{cls.ENV} is not a capture layout ({e}): {raw[:300]!r}") from None


DEFAULT_MAX_SHARD_BYTES = 1 << 30
# One 27B GPU emits ~0.6 GB/s; one thread hashes and writes ~1-1.5 GB/s to disk. Four keep
# several GPUs per host fed, and bound host memory at (threads + 1) shards.
DEFAULT_WRITER_THREADS = 4
# S3 output: how long a shard's upload is tried again through errors that pass (connection
# failures, 5xx, throttling) before the run stops naming it
DEFAULT_S3_RETRY_S = 120.0


LAYER_STATS_ENV = envs.LAYER_STATS


def layer_stats_default() -> bool:
    value = env_value(LAYER_STATS_ENV) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{LAYER_STATS_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """Where and how the worker writes shards."""

    output_dir: str
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    prefix: str = "shard"
    writer_threads: int = DEFAULT_WRITER_THREADS
    first_index: int = 0  # the next shard's number (a resumed run continues the numbering)
    upload_uri: str | None = None  # s3://bucket/prefix: upload each shard once durable, then evict it
    s3_endpoint_url: str | None = None
    upload_pending: int = 4  # shards queued or uploading before the writers wait (backpressure)
    upload_retry_s: float = DEFAULT_S3_RETRY_S  # how long a shard's upload is tried again through transient errors
    final_state: bool = False  # also `final_hidden_states` [R, H]: the model's output after its final norm
    loss_mask: bool = False  # also `loss_mask` [R] uint8, from each sample's spans
    generate: bool = False  # samples carry their prompt length and generation record (`generations` [B] uint8)
    fp8: bool = False  # values stored as float8 e4m3 with float32 scales per (token, layer)
    # per-layer statistics of the written rows (format.stats); off only to measure their cost:
    # VHIDDEN_LAYER_STATS=0, read when the config is made (the driver's, handed to workers)
    layer_stats: bool = field(default_factory=layer_stats_default)

    def __post_init__(self) -> None:
        _non_negative("upload_retry_s", self.upload_retry_s)
        if not isinstance(self.layer_stats, bool):
            raise ValueError(f"layer_stats must be a bool, got {self.layer_stats!r}")
        if self.upload_uri is not None and not self.upload_uri.startswith("s3://"):
            raise ValueError(f"upload_uri must be s3://bucket/prefix, got {self.upload_uri!r}")
        if isinstance(self.upload_pending, bool) or not isinstance(self.upload_pending, int) or self.upload_pending < 1:
            raise ValueError(f"upload_pending must be a positive int, got {self.upload_pending!r}")
        if isinstance(self.first_index, bool) or not isinstance(self.first_index, int) or self.first_index < 0:
            raise ValueError(f"first_index must be a non-negative int, got {self.first_index!r}")
        if (isinstance(self.writer_threads, bool) or not isinstance(self.writer_threads, int)
                or not 1 <= self.writer_threads <= 64):
            raise ValueError(f"writer_threads must be an int in 1..64, got {self.writer_threads!r}")
        if not self.output_dir:
            raise ValueError(f"output_dir must be a non-empty path, got {self.output_dir!r}")
        if not isinstance(self.max_shard_bytes, int) or self.max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be a positive int, got {self.max_shard_bytes!r}")
        if not self.prefix or "/" in self.prefix:
            raise ValueError(f"prefix must be a plain file-name prefix, got {self.prefix!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


REGENERATE = ("all", "last")  # --regenerate


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """`extract --generate`: the target writes each response and its rows are captured as it
    does. Sampling follows vLLM's SamplingParams (same names, same defaults)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # run seed: each sample's seed is derived from it and the sample's id
    stop: tuple[str, ...] = ()  # stop strings (kept in the response, as the token that completes them is)
    ignore_eos: bool = False
    # conversations: "all" regenerates every assistant turn in order (each with the target's own
    # earlier turns as context); "last" only the reply to the last user turn
    regenerate: str = "all"

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.regenerate not in REGENERATE:
            raise ValueError(f"--regenerate must be one of {', '.join(REGENERATE)}, got {self.regenerate!r}")
        _positive_int("--max-tokens", self.max_tokens)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(f"--temperature must be a non-negative number, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"--top-k must be a non-negative int (0 or -1: off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"--seed must be a non-negative int, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"--stop must be non-empty strings, got {s!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d


DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")  # what vLLM's --dtype takes
LOSS_MASKS = ("assistant", "last-assistant", "all", "none")  # --loss-mask (None: the default per input kind)
FINAL_STATES = ("none", "post-norm")  # --final-state
STORAGE_DTYPES = ("auto", "fp8")  # --storage-dtype: the model's dtype, or float8 e4m3 + float32 scales


@dataclass(kw_only=True)
class ExtractConfig:
    """Everything `vllm-hidden extract` needs besides the engine's own arguments."""

    model: str
    input_path: str
    output_dir: str
    layers: str | None = None
    aux_layers: str | None = None
    layers_from: str | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    dtype: str = "auto"
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    writer_threads: int = DEFAULT_WRITER_THREADS
    ring_slots: int = 2
    resume: bool = False
    s3_endpoint_url: str | None = None
    staging_dir: str | None = None  # local directory shards are written to before their upload (S3 output)
    s3_retry_s: float = DEFAULT_S3_RETRY_S  # S3 output: how long a shard's upload rides out transient errors
    progress: bool = True
    engine_args: list[str] = field(default_factory=list)
    cache_dir: str | None = None  # compile/kernel caches (default: $VHIDDEN_CACHE_DIR or ~/.cache/vllm-hidden)
    tp: int = 1  # GPUs (CPU: core groups) per engine: vLLM's tensor parallelism
    dp: int = 1  # engines, each writing its own shards under rank-NNN/, fed from one shared input
    ray_address: str | None = None  # run the dp engines as Ray actors on this cluster ("auto": the local one)
    loss_mask: str | None = None  # None: assistant turns for conversations, the line's own mask or all otherwise
    final_state: str = "none"  # "post-norm": also the model's output after its final norm, per token
    input_columns: dict[str, str] = field(default_factory=dict)  # record field -> input column (Parquet/JSONL)
    generate: GenerateConfig | None = None  # --generate: the target writes the responses (None: prefill only)
    # --generate: host memory the in-flight samples' rows may take (each reserves prompt + max
    # tokens rows until its response ends); None: a quarter of the machine's memory, at most 32 GiB
    max_inflight_bytes: int | None = None
    # run every decoder layer; by default a prefill-only extract runs layers 0 .. the deepest
    # captured one (what later layers compute reaches no captured state)
    full_model: bool = False
    storage_dtype: str = "auto"

    @property
    def needs_full_model(self) -> bool:
        """The final normed state and generated responses come from the whole model."""
        return self.full_model or self.final_state != "none" or self.generate is not None

    def __post_init__(self) -> None:
        if self.max_inflight_bytes is not None:
            _positive_int("--max-inflight-bytes", self.max_inflight_bytes)
        if self.loss_mask is not None and self.loss_mask not in LOSS_MASKS:
            raise ValueError(f"--loss-mask must be one of {', '.join(LOSS_MASKS)}, got {self.loss_mask!r}")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"--storage-dtype must be one of {', '.join(STORAGE_DTYPES)}, got {self.storage_dtype!r}")
        if self.final_state not in FINAL_STATES:
            raise ValueError(f"--final-state must be one of {', '.join(FINAL_STATES)}, got {self.final_state!r}")
        for name in ("tp", "dp"):
            _positive_int(f"--{name}", getattr(self, name))
        _non_negative("--s3-retry-seconds", self.s3_retry_s)
        if self.ray_address is not None and not self.ray_address:
            raise ValueError(f"--ray must name a cluster address (or 'auto'), got {self.ray_address!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {v!r}")
        if self.max_shard_bytes < 1:
            raise ValueError(f"--max-shard-bytes must be positive, got {self.max_shard_bytes!r}")
        if self.ring_slots < 2:
            raise ValueError(f"--ring-slots must be >= 2, got {self.ring_slots!r}")
        if not 1 <= self.writer_threads <= 64:
            raise ValueError(f"--writer-threads must be in 1..64, got {self.writer_threads!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def capture_layout(self) -> CaptureLayout:
        """The rows' layout this run's shards open the worker's capture with."""
        return CaptureLayout.for_shards(ShardConfig(output_dir=".", **self.shard_options()))  # (paths: no part)

    def shard_options(self) -> dict[str, Any]:
        """The ShardConfig fields every engine of the run shares (each part's paths aside)."""
        return dict(max_shard_bytes=self.max_shard_bytes, writer_threads=self.writer_threads,
                    upload_retry_s=self.s3_retry_s, final_state=self.final_state == "post-norm",
                    loss_mask=self.loss_mask != "none", generate=self.generate is not None,
                    fp8=self.storage_dtype == "fp8")


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """The shape of a model, from its config (extract.plan.model_info)."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int | None
    moe_layers: tuple[int, ...] = ()  # decoder layers with a sparse-expert MLP


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What an extract is: the model's shape, the layers, the longest prompt, the output's identity."""

    info: ModelInfo
    layer_ids: list[int]
    max_prompt_len: int  # the longest prompt accepted (under --generate: leaving room for --max-tokens)
    layers_run: int = 0  # decoder layers the engine runs (0 .. layers_run-1); 0: all of them
    identity: dict[str, Any]  # run.json: what the output is (checked by --resume)
    layer_source: dict[str, Any] | None = None  # where layer_ids came from (the manifest records it)


def _non_negative(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
        raise ValueError(f"{name} must be a non-negative number of seconds, got {v!r}")
    return float(v)


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Limits of the hidden-states server. Passed to the API server process in the
    environment (`vllm-hidden serve` sets it from its flags), not in `additional_config`,
    which vLLM hashes into its compile-cache key: changing a limit must not recompile."""

    # Rows one response may carry: 8192 tokens x 5 layers of a 27B model is ~420 MB raw,
    # ~560 MB as base64 JSON.
    max_hidden_tokens: int = 8192
    # Largest body of a request with hidden_states (larger ones without it go to vLLM as they are).
    max_request_bytes: int = 32 << 20
    # Hidden-state requests in flight at once; more wait (bounds the memory they hold).
    max_concurrent: int = 64
    # Seconds a finished response waits for its hidden states.
    timeout_s: float = 120.0
    # Fetch form: seconds a response's states wait to be fetched, and the bytes all unfetched
    # states may hold (memory: /dev/shm), split evenly over the API server processes.
    fetch_ttl_s: float = 120.0
    max_unfetched_bytes: int = 8 << 30
    # Connector form (`ConnectorConfig`): the bytes of files in the storage path that no client
    # has deleted yet (split evenly over the API server processes; past it: HTTP 503 with
    # Retry-After), and how long such a file is kept before the server deletes it (a client
    # that died never will).
    max_unread_bytes: int = 32 << 30
    unread_ttl_s: float = 3600.0

    ENV = envs.SERVE_LIMITS

    def __post_init__(self) -> None:
        for name in ("max_hidden_tokens", "max_request_bytes", "max_concurrent", "max_unfetched_bytes",
                     "max_unread_bytes"):
            _positive_int(self._what(name), getattr(self, name))
        for name in ("timeout_s", "fetch_ttl_s", "unread_ttl_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{self._what(name)} must be a positive number, got {v!r}")

    FLAGS = {"max_hidden_tokens": "--max-hidden-tokens", "max_request_bytes": "--max-request-bytes",
             "max_concurrent": "--max-concurrent", "timeout_s": "--hidden-states-timeout",
             "fetch_ttl_s": "--fetch-ttl", "max_unfetched_bytes": "--max-unfetched-bytes",
             "max_unread_bytes": "--max-unread-bytes", "unread_ttl_s": "--unread-ttl"}

    def _what(self, name: str) -> str:
        return f"{self.FLAGS[name]} ({self.ENV[name]})"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "ServeConfig":
        kw: dict[str, Any] = {}
        for name, var in cls.ENV.items():
            raw = env_value(var, env)
            if raw is None:
                continue
            try:
                kw[name] = float(raw) if name.endswith("_s") else int(raw)
            except ValueError:
                raise ValueError(f"{var} must be a number, got {raw!r}") from None
        return cls(**kw)

    def to_env(self) -> dict[str, str]:
        return {var: str(getattr(self, name)) for name, var in self.ENV.items()}


# vLLM's hidden-states connectors a server stands in for (`ConnectorConfig`): name -> FP8 file layout
CONNECTORS = {"ExampleHiddenStatesConnector": False, "FP8HiddenStatesConnector": True,
              "MooncakeHiddenStatesConnector": False}
# ... and those that put the states into a Mooncake store instead of a file (hs_connectors' Mooncake backend)
MOONCAKE_CONNECTORS = frozenset({"MooncakeHiddenStatesConnector"})
# hs_connectors' MooncakeStoreConfig: the `kv_connector_extra_config.mooncake` keys, and their types
MOONCAKE_KEYS = {"local_hostname": str, "metadata_server": str, "master_server_address": str,
                 "global_segment_size": int, "local_buffer_size": int, "protocol": str, "device_name": str,
                 "num_writer_threads": int}
MOONCAKE_DEFAULTS = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                     "master_server_address": "127.0.0.1:50051", "global_segment_size": 4 << 30,
                     "local_buffer_size": 2 << 30, "protocol": "tcp", "device_name": "", "num_writer_threads": 4}


@dataclass(frozen=True, kw_only=True)
class ConnectorConfig:
    """The connector form of `vllm-hidden serve`: started with the arguments speculators' launch
    script gives `vllm serve` (`--speculative-config` with method extract_hidden_states and
    `--kv-transfer-config` naming one of `CONNECTORS`), every completion and chat request gets its
    prompt's states in a safetensors file under `storage_path`, laid out as that connector
    writes it, and `kv_transfer_params.hidden_states_path` in its response. Passed to the API
    server and engine processes in the environment (`ENV`)."""

    connector: str
    storage_path: str | None  # absolute; None for a Mooncake connector
    aux_layer_ids: tuple[int, ...]  # as given (vLLM's aux numbering; the file holds them ascending)
    use_lock: bool = True  # a `.lock` file beside each (vLLM's `use_synchronization_lock`)
    # a Mooncake connector's store (hs_connectors' MooncakeStoreConfig, every key filled in: MOONCAKE_DEFAULTS)
    mooncake: dict[str, Any] | None = None

    ENV = envs.CONNECTOR

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {sorted(CONNECTORS)}, got {self.connector!r}")
        if self.connector in MOONCAKE_CONNECTORS:
            object.__setattr__(self, "mooncake", mooncake_config(self.mooncake))
            if self.storage_path is not None:
                raise ValueError(f"{self.connector} puts the states into a Mooncake store, not files: "
                                 f"shared_storage_path {self.storage_path!r} has no use")
        elif self.mooncake is not None:
            raise ValueError(f"{self.connector} writes files; the mooncake config has no use: {self.mooncake!r}")
        elif not isinstance(self.storage_path, str) or not os.path.isabs(self.storage_path):
            raise ValueError(f"shared_storage_path must be an absolute path, got {self.storage_path!r}")
        ids = tuple(self.aux_layer_ids)
        object.__setattr__(self, "aux_layer_ids", ids)
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids must be a non-empty list of ints, got {list(ids)!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids has a repeated id: {list(ids)!r}")

    @property
    def fp8(self) -> bool:
        return CONNECTORS[self.connector]

    @property
    def transport(self) -> str:
        """Where the states go: "mooncake" (an object in a Mooncake store) or "file"."""
        return "mooncake" if self.connector in MOONCAKE_CONNECTORS else "file"

    @property
    def file_aux_ids(self) -> tuple[int, ...]:
        """The layers in a file's order: ascending, as vLLM's model emits its aux states."""
        return tuple(sorted(self.aux_layer_ids))

    def to_env(self) -> dict[str, str]:
        import json

        return {self.ENV: json.dumps({"connector": self.connector, "storage_path": self.storage_path,
                                      "aux_layer_ids": list(self.aux_layer_ids), "use_lock": self.use_lock,
                                      "mooncake": self.mooncake})}

    @classmethod
    def from_env(cls, env: Any) -> "ConnectorConfig | None":
        import json

        raw = env.get(cls.ENV)
        if not raw:
            return None
        try:
            d = json.loads(raw)
            return cls(connector=d["connector"], storage_path=d["storage_path"],
                       aux_layer_ids=tuple(d["aux_layer_ids"]), use_lock=bool(d.get("use_lock", True)),
                       mooncake=d.get("mooncake"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{cls.ENV} is not a connector config ({e}): {raw[:300]!r}") from None


def mooncake_config(raw: Any) -> dict[str, Any]:
    """`kv_connector_extra_config.mooncake` (hs_connectors' MooncakeStoreConfig as a dict) with its
    defaults filled in; a key of another name or type is refused, naming it."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"kv_connector_extra_config.mooncake must be an object, got {raw!r}")
    unknown = sorted(set(raw) - set(MOONCAKE_KEYS))
    if unknown:
        raise ValueError(f"kv_connector_extra_config.mooncake has unknown keys {unknown}; "
                         f"known: {sorted(MOONCAKE_KEYS)}")
    out = {**MOONCAKE_DEFAULTS, **raw}
    for k, t in MOONCAKE_KEYS.items():
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, t):
            raise ValueError(f"kv_connector_extra_config.mooncake.{k} must be {t.__name__}, got {v!r}")
    for k in ("global_segment_size", "local_buffer_size", "num_writer_threads"):
        if out[k] < 1:
            raise ValueError(f"kv_connector_extra_config.mooncake.{k} must be positive, got {out[k]!r}")
    if out["protocol"] not in ("tcp", "rdma"):
        raise ValueError("kv_connector_extra_config.mooncake.protocol must be 'tcp' or 'rdma', "
                         f"got {out['protocol']!r}")
    host, _, port = out["master_server_address"].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError("kv_connector_extra_config.mooncake.master_server_address must be HOST:PORT, got "
                         f"{out['master_server_address']!r}")
    return out
