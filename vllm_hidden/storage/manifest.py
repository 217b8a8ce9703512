"""manifest.json: written LAST, after every shard it lists is durable."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_hidden.format.shard import FORMAT, SAMPLE_CHECKSUM, ShardInfo
from vllm_hidden.format.stats import aggregate
from vllm_hidden.layers import to_aux_ids

MANIFEST = "manifest.json"
ERRORS = "errors.jsonl"
GENERATIONS = "generations.jsonl"


@dataclass(kw_only=True)
class Manifest:
    model: str
    layer_ids: list[int]
    layer_semantics: str
    # where layer_ids came from: {"option": "--layers-from", "path", "kind", "key", "config_ids",
    # "meaning"} for a drafter config, or the option given ("--layers", "--aux-layers", "default")
    layer_source: dict[str, Any] | None = None
    num_model_layers: int
    hidden_size: int
    # decoder layers the engine ran; fewer than num_model_layers: the model was cut after the
    # deepest captured layer (the captured states are the whole model's)
    layers_run: int | None = None
    dtype: str
    shards: list[ShardInfo]
    num_errors: int = 0
    errors_file: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    # what the input was and how it was tokenized and masked (format, kinds, tokenizer,
    # chat template hash, special tokens, loss-mask rule); rows are unshifted: row t is token t
    input: dict[str, Any] = field(default_factory=dict)
    final_state: str = "none"  # "post-norm": shards hold final_hidden_states [R, H]
    # extract --generate: its sampling settings; shards then hold each sample's prompt length
    # and generation record, gathered (in shard order) into generations_file
    generate: dict[str, Any] | None = None
    generations_file: str | None = None
    # the target's weights: None unquantized; else {"method", "source": "online" | "checkpoint",
    # and a checkpoint's "weight_block_size", "activation_scheme"} (engine.quant). The states
    # are still the model's activations in `dtype`: only its GEMMs read quantized weights
    quantization: dict[str, Any] | None = None
    # None: the states are stored in `dtype`; else how they are quantized (--storage-dtype fp8:
    # float8 e4m3 values, one float32 scale per token and layer, in *_scale tensors)
    storage: dict[str, Any] | None = None
    # how each shard's per-sample checksums are made (files.SAMPLE_CHECKSUM); None: an older
    # output without them (the reader then checks whole shards, as it did then)
    sample_checksum: str | None = SAMPLE_CHECKSUM
    # per stored column (layer id as a string, then "final" with --final-state): rows, mean,
    # std, absmax, zero_rows, nonfinite_rows over every shard's statistics (format.stats).
    # Left None, it is summed from the shards' records; None after that: no shard has any
    layer_stats: dict[str, dict[str, Any]] | None = None
    # shards the statistics cover, when some have none (an output resumed across versions, or
    # written with VHIDDEN_LAYER_STATS=0 for part of it); None: all of them
    layer_stats_shards: int | None = None
    format: str = FORMAT

    def __post_init__(self) -> None:
        if self.layer_stats is None:
            self.layer_stats, covered = aggregate([s.stats for s in self.shards], self.hidden_size)
            self.layer_stats_shards = covered if 0 < covered < len(self.shards) else None

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def aux_layer_ids(self) -> list[int]:
        return to_aux_ids(self.layer_ids)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shards"] = [s.to_dict() for s in self.shards]
        d["aux_layer_ids"] = self.aux_layer_ids
        d["num_samples"] = self.num_samples
        d["num_tokens"] = self.num_tokens
        return d

    def write(self, out_dir: str | Path) -> Path:
        path = Path(out_dir) / MANIFEST
        tmp = path.with_name(f".{MANIFEST}.tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        if d.get("format") != FORMAT:
            raise ValueError(f"unsupported manifest format {d.get('format')!r}; expected {FORMAT!r}")
        names = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in names}
        shards = []
        for s in d["shards"]:
            if "blake3" not in s:
                raise ValueError(f"shard entry {s.get('file')!r} has no blake3 checksum (written by an older "
                                 f"vllm-hidden, keys {sorted(s)}); re-run the extract with this version")
            shards.append(ShardInfo.from_dict(s))
        kw["shards"] = shards
        kw.setdefault("sample_checksum", None)  # written before there were any
        return cls(**kw)

    @classmethod
    def read(cls, out_dir: str | Path) -> "Manifest":
        path = Path(out_dir) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"no {MANIFEST} in {str(out_dir)!r} "
                                    "(not an extract output, or the run did not finish)")
        return cls.from_dict(json.loads(path.read_text()))
