"""The shard schema: a safetensors file holding many samples' rows, and what describes it.

A shard holds `hidden_states` [R, K, H], then (--final-state) `final_hidden_states` [R, H],
(fp8 storage) `hidden_states_scale` [R, K] and `final_hidden_states_scale` [R] float32,
`token_ids` [R] int64, (a loss mask) `loss_mask` [R] uint8, (--generate) `generations` [B]
uint8: its samples' generations.jsonl lines, in index order. Its metadata holds the format
tag, the layer ids, the per-sample index (`samples`: [id, first row, tokens(, prompt
tokens)] each), the per-sample checksums and (`format.stats`) the per-layer statistics of
its rows. Rows the index does not list are zeros.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3

from vllm_hidden.format.header import Header, Tensor, parse_header
from vllm_hidden.format.quant import FP8_MAX
from vllm_hidden.format.stats import STATS, check_record

FORMAT = "vllm-hidden/1"

HIDDEN, FINAL = "hidden_states", "final_hidden_states"
HIDDEN_SCALE, FINAL_SCALE = "hidden_states_scale", "final_hidden_states_scale"
TOKENS, LOSS_MASK, GENERATIONS = "token_ids", "loss_mask", "generations"
# the tensors with one row per token, in file order (and the order a sample's checksum covers them)
ROW_TENSORS = (HIDDEN, FINAL, HIDDEN_SCALE, FINAL_SCALE, TOKENS, LOSS_MASK)
# fp8 storage: each value tensor and its float32 scales (value = fp8 * scale)
SCALES = {HIDDEN: HIDDEN_SCALE, FINAL: FINAL_SCALE}
# the manifest's `storage` for an fp8 output
FP8_STORAGE = {"dtype": "float8_e4m3fn",
               "scale": f"float32 per (token, layer): amax / {FP8_MAX:g}; value = fp8 * scale",
               "tensors": dict(SCALES)}

INDEX, LAYER_IDS = "samples", "layer_ids"
# Per-sample checksums, so a reader verifies exactly the bytes it returns (once, however many
# processes read): a shard's metadata holds, under SAMPLE_CHECKSUMS, one digest per index entry,
# in index order: BLAKE3 (16 bytes, hex) of the entry as compact JSON, then of the sample's rows
# of each ROW_TENSORS tensor the shard has, in that order. Covering the entry covers the header
# fields a read relies on: a damaged id, offset or count reads as a mismatch. The manifest names
# the rule (SAMPLE_CHECKSUM); older outputs have none.
SAMPLE_CHECKSUMS = "sample_blake3"
SAMPLE_CHECKSUM = "blake3-128(entry, rows)"


def sample_digest(entry: list[Any], parts: Iterable[Any]) -> str:
    """The SAMPLE_CHECKSUMS digest of an index entry and its rows' bytes (buffers, in ROW_TENSORS order)."""
    h = blake3.blake3(json.dumps(entry, separators=(",", ":")).encode())
    for p in parts:
        h.update(p)
    return h.hexdigest(length=16)


def index_entry(sample_id: Any, row: int, count: int, num_prompt: int | None = None) -> list[Any]:
    """A sample's index entry: [id, first row, tokens], and its prompt's tokens with --generate."""
    return [sample_id, row, count] if num_prompt is None else [sample_id, row, count, num_prompt]


def entry_header_bytes(entry: list[Any]) -> int:
    """Bytes an index entry takes in the header: the index is a JSON string inside the JSON
    header (quotes and backslashes escaped), + a comma, + its checksum in the
    SAMPLE_CHECKSUMS list (32 hex digits, escaped quotes, a comma)."""
    return len(json.dumps(json.dumps(entry))) + 1 + 37


HEADER_FIXED = 4096  # header bytes besides the sample index (tensor entries, format, layer ids)
MAX_HEADER_ROOM = 1 << 20


def header_room(rows_per_shard: int, stats_bytes: int = 0) -> int:
    """The room a writer reserves for a shard's header before its rows, so rows can be written
    at their final offsets before the index is known (~32 B of index and 37 of checksum per
    sample, for up to one sample per row, + `stats_bytes` for its statistics); a shard rolls
    early if its index would overflow."""
    room = HEADER_FIXED + stats_bytes + (32 + 37) * min(rows_per_shard, 1 << 15)
    return min(room + (-room % 8), MAX_HEADER_ROOM + stats_bytes)


def shard_metadata(layer_ids: list[int], index: list[list[Any]], digests: list[str],
                   stats: dict[str, Any] | None = None) -> dict[str, str]:
    meta = {"format": FORMAT, LAYER_IDS: json.dumps(layer_ids), INDEX: json.dumps(index),
            SAMPLE_CHECKSUMS: json.dumps(digests)}
    if stats is not None:
        meta[STATS] = json.dumps(stats, separators=(",", ":"))
    return meta


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """A durable shard as the journal, the manifest and S3 object metadata record it."""

    file: str
    bytes: int
    blake3: str
    num_samples: int
    num_tokens: int
    # its per-layer statistics (format.stats); None: written without them. Derived from the
    # rows, so not part of what makes two records equal (S3 object metadata has no room for it)
    stats: dict[str, dict[str, Any]] | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardInfo":
        """A record as to_dict wrote it; one written before statistics has none."""
        return cls(file=d["file"], bytes=d["bytes"], blake3=d["blake3"], num_samples=d["num_samples"],
                   num_tokens=d["num_tokens"], stats=d.get("stats"))


def shard_file(index: int, prefix: str = "shard") -> str:
    return f"{prefix}-{index:05d}.safetensors"


def shard_number(name: str, prefix: str = "shard") -> int | None:
    """The index in a shard's file name, or None if `name` is not one."""
    m = re.fullmatch(rf"{re.escape(prefix)}-(\d+)\.safetensors", name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, kw_only=True)
class ShardHeader:
    """A shard's parsed header: its index, checksums and tensors."""

    index: list[list[Any]]
    digests: list[str] | None  # None: an output written before per-sample checksums
    tensors: dict[str, Tensor]
    data_start: int
    stats: dict[str, dict[str, Any]] | None = None  # its per-layer statistics (None: written without them)

    @classmethod
    def read(cls, read: Callable[[int, int], bytes], size: int | None, where: str) -> "ShardHeader":
        """Parse a shard's header (`read(offset, n)` gives its bytes); a ValueError names `where`."""
        try:
            return cls.of(parse_header(read, size))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"shard {where!r} has a damaged header ({e}); `vllm-hidden inspect` checks every "
                             "shard") from None

    @classmethod
    def of(cls, h: Header) -> "ShardHeader":
        index = json.loads(h.metadata[INDEX])
        if not isinstance(index, list) or not all(
                isinstance(e, list) and len(e) in (3, 4) and all(isinstance(x, int) and x >= 0 for x in e[1:])
                for e in index):
            raise ValueError(f"its index is not a list of [id, row, count(, prompt)] entries: {str(index)[:200]}")
        digests = json.loads(h.metadata[SAMPLE_CHECKSUMS]) if SAMPLE_CHECKSUMS in h.metadata else None
        if digests is not None and (not isinstance(digests, list) or len(digests) != len(index)):
            raise ValueError(f"{len(digests) if isinstance(digests, list) else digests!r} checksums for "
                             f"{len(index)} index entries")
        for name, rank in ((HIDDEN, 3), (TOKENS, 1)):
            if name not in h.tensors or len(h.tensors[name].shape) != rank:
                raise ValueError(f"no {name} tensor of rank {rank}")
        stats = check_record(json.loads(h.metadata[STATS])) if STATS in h.metadata else None
        return cls(index=index, digests=digests, tensors=h.tensors, data_start=h.data_start, stats=stats)

    @property
    def rows(self) -> dict[str, Tensor]:
        """The per-token tensors it has, in ROW_TENSORS order."""
        return {name: self.tensors[name] for name in ROW_TENSORS if name in self.tensors}

    @property
    def lengths(self) -> list[int]:
        """Token counts of its samples, in index order."""
        return [e[2] for e in self.index]

    def problems(self, info: ShardInfo, layers: int | None) -> list[str]:
        """What disagrees with its record `info`, with `layers` layers, or inside the shard: the
        index's counts, rows outside the tensors, tensors that do not cover the rows."""
        out = []
        tokens = sum(self.lengths)
        if len(self.index) != info.num_samples or tokens != info.num_tokens:
            out.append(f"{info.file}: index lists {len(self.index)} samples / {tokens} tokens, "
                       f"recorded {info.num_samples} / {info.num_tokens}")
        hs, tok = list(self.tensors[HIDDEN].shape), list(self.tensors[TOKENS].shape)
        if hs[0] != tok[0] or any(e[1] + e[2] > hs[0] for e in self.index):
            out.append(f"{info.file}: index rows fall outside hidden_states {hs} / token_ids {tok}")
        if layers is not None and hs[1] != layers:
            out.append(f"{info.file}: {hs[1]} layers, the manifest lists {layers}")
        want = {FINAL: [hs[0], hs[2]], LOSS_MASK: [hs[0]], HIDDEN_SCALE: [hs[0], hs[1]], FINAL_SCALE: [hs[0]]}
        out += [f"{info.file}: {name} has shape {list(self.tensors[name].shape)}, expected {shape}"
                for name, shape in want.items() if name in self.tensors and list(self.tensors[name].shape) != shape]
        return out
