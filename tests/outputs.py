"""Outputs written without an engine, for tests: a shard writer for given layers and sizes,
random samples, the samples written as shards, and the manifest that finishes an output.

Every vllm_hidden import the tests need for this stays here, at the top, so a module of the
package that moves means this one file to update."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from vllm_hidden.config import ShardConfig
from vllm_hidden.format.quant import FP8
from vllm_hidden.format.shard import ShardInfo
from vllm_hidden.storage.manifest import Manifest
from vllm_hidden.storage.shards import ShardWriter


def row_bytes(num_layers: int, hidden_size: int, *, final_state: bool = False, loss_mask: bool = False,
              fp8: bool = False) -> int:
    """Bytes of one shard row as the writer counts them against max_shard_bytes: the layers'
    values, the final state's, the int64 token id, the mask byte and (fp8) the float32 scales."""
    values = 1 if fp8 else 2
    row = (num_layers + final_state) * hidden_size * values + 8 + loss_mask
    return row + (4 * (num_layers + final_state) if fp8 else 0)


def shard_writer(where: str | Path | ShardConfig, layer_ids: list[int], hidden_size: int, *,
                 rows: int | None = None, dtype: torch.dtype | None = None, **config: Any) -> ShardWriter:
    """A ShardWriter of `layer_ids` x `hidden_size` into directory `where` (or with the
    ShardConfig `where`, e.g. an Output's). `rows`: shards of that many rows (sets
    max_shard_bytes); `config`: other ShardConfig fields; `dtype`: the values' dtype (default
    float8 e4m3 for an fp8 output, else bfloat16)."""
    if rows is not None:
        flags = {k: bool(config.get(k)) for k in ("final_state", "loss_mask", "fp8")}
        config["max_shard_bytes"] = rows * row_bytes(len(layer_ids), hidden_size, **flags)
    if isinstance(where, ShardConfig):
        assert rows is None and not config, "pass the whole ShardConfig, or a directory and its fields"
        cfg = where
    else:
        cfg = ShardConfig(output_dir=str(where), **config)
    return ShardWriter(cfg, layer_ids, hidden_size, dtype or (FP8 if cfg.fp8 else torch.bfloat16))


def random_sample(seed: int | torch.Generator, n: int, num_layers: int, hidden_size: int, *, high: int = 100,
                  final: bool = False) -> tuple[torch.Tensor, ...]:
    """(token ids [n] in [0, high), hidden states [n, num_layers, hidden_size] bf16), drawn in
    that order from a generator seeded with `seed` (or from the generator `seed` itself); with
    `final`, a third: final hidden states [n, hidden_size] bf16, drawn after them."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    tok = torch.randint(0, high, (n,), generator=g)
    hs = torch.randn(n, num_layers, hidden_size, generator=g).to(torch.bfloat16)
    if not final:
        return tok, hs
    return tok, hs, torch.randn(n, hidden_size, generator=g).to(torch.bfloat16)


def write_samples(writer: ShardWriter, samples: Mapping[Any, tuple]) -> list[ShardInfo]:
    """Adds each sample {id: (token ids, hidden states[, final hidden states[, loss spans]])}
    in order, closes the writer (also when an add fails) and returns its shards."""
    try:
        for sid, (tok, hs, *rest) in samples.items():
            final, spans = (*rest, None, None)[:2]
            writer.add(sid, tok, hs, final_hidden_states=final, loss_spans=spans)
    finally:
        shards = writer.close()
    return shards


def manifest_fields(layer_ids: list[int], hidden_size: int, *, num_model_layers: int = 8,
                    **fields: Any) -> dict[str, Any]:
    """A test output's manifest fields (model "m", bf16), `fields` added or overriding; no shards."""
    return {"model": "m", "layer_ids": list(layer_ids), "layer_semantics": "s", "num_model_layers": num_model_layers,
            "hidden_size": hidden_size, "dtype": "bfloat16", **fields}


def write_manifest(root: str | Path, shards: list[ShardInfo], layer_ids: list[int], hidden_size: int,
                   **fields: Any) -> Manifest:
    """Finishes the output in `root` with the manifest of `shards` (fields as manifest_fields)."""
    manifest = Manifest(shards=shards, **manifest_fields(layer_ids, hidden_size, **fields))
    manifest.write(root)
    return manifest


def write_output(root: str | Path, layer_ids: list[int], hidden_size: int, samples: Mapping[Any, tuple], *,
                 rows: int | None = None, dtype: torch.dtype | None = None, manifest: bool | Mapping[str, Any] = True,
                 **config: Any) -> list[ShardInfo]:
    """A whole output in `root`: `samples` (as write_samples) written by shard_writer(root,
    layer_ids, hidden_size, rows=rows, dtype=dtype, **config), then its manifest (False: none,
    as an interrupted run leaves it; a mapping: manifest fields, as write_manifest). Returns the
    shards."""
    shards = write_samples(shard_writer(root, layer_ids, hidden_size, rows=rows, dtype=dtype, **config), samples)
    if manifest is not False:
        write_manifest(root, shards, layer_ids, hidden_size, **(manifest if manifest is not True else {}))
    return shards
