"""Samples -> what drafter trainers read, without glue.

- `DFlashCollator`: `input_ids` [B, T], `hidden_states` [B, T, K*H] (the selected layers
  concatenated, DFlash `target_layer_ids` order), `loss_mask` [B, T].
- `Eagle3Collator`: `input_ids`, `aux_hidden_state` [B, T, 3H] (three layers concatenated,
  SpecForge's layout), `hidden_state` [B, T, H] (the final state after the model's norm,
  from `--final-state post-norm`), `loss_mask`.
Both pad to the longest sample and add `attention_mask` [B, T] and `lengths` [B]. Rows stay
unshifted (row t is token t); the trainer shifts. Use one as a DataLoader's `collate_fn`.

`export_speculators` writes what vllm-project/speculators' offline trainer loads: a
`datasets` table (`save_to_disk`, torch format) with `input_ids`, `loss_mask`, `seq_len`
per row, and `hidden_states/hs_{i}.safetensors` for row i with `hidden_states` [T, K, H]
and `token_ids` [T]. Its trainer reads the last of the K slots as the final layer's state
BEFORE the norm (it applies the norm), so the last exported layer must be the model's last.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def _columns(layer_ids: Sequence[int], use: Sequence[int] | None, what: str) -> list[int] | None:
    """Positions of `use` (layer ids) among the output's `layer_ids`; None: all, in order."""
    if use is None:
        return None
    missing = [i for i in use if i not in layer_ids]
    if missing:
        raise ValueError(f"{what}: layer id {missing[0]} is not in the output (its layer ids are {list(layer_ids)})")
    return [list(layer_ids).index(i) for i in use]


def _mask(sample: dict[str, Any]) -> torch.Tensor:
    m = sample.get("loss_mask")
    # an output extracted with --loss-mask none: every token counts
    return torch.ones(sample["token_ids"].shape[0], dtype=torch.bool) if m is None else m.bool()


def pad_batch(features: list[dict[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad each [T, ...] tensor to the longest T; `attention_mask` and `lengths` added."""
    if not features:
        raise ValueError("cannot collate an empty batch")
    lengths = torch.tensor([f["input_ids"].shape[0] for f in features], dtype=torch.int64)
    t = int(lengths.max())
    out: dict[str, torch.Tensor] = {}
    for name in features[0]:
        first = features[0][name]
        pad = pad_token_id if name == "input_ids" else 0
        batch = torch.full((len(features), t, *first.shape[1:]), pad, dtype=first.dtype)
        for b, f in enumerate(features):
            batch[b, : f[name].shape[0]] = f[name]
        out[name] = batch
    out["attention_mask"] = torch.arange(t)[None, :] < lengths[:, None]
    out["lengths"] = lengths
    return out


class DFlashCollator:
    """DFlash: K layers concatenated per token. `use`: the layer ids to keep, in the order
    the drafter's `target_layer_ids` lists them (default: every layer of the output)."""

    def __init__(self, layer_ids: Sequence[int], use: Sequence[int] | None = None, pad_token_id: int = 0) -> None:
        self.cols = _columns(layer_ids, use, "DFlashCollator")
        self.pad_token_id = pad_token_id

    def features(self, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        hs = sample["hidden_states"]
        if self.cols is not None:
            hs = hs[:, self.cols]
        return {"input_ids": sample["token_ids"], "hidden_states": hs.reshape(hs.shape[0], -1),
                "loss_mask": _mask(sample)}

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return pad_batch([self.features(s) for s in batch], self.pad_token_id)


class Eagle3Collator:
    """EAGLE-3 (SpecForge's layout): three aux layers concatenated, and the final normed state.
    `use`: the three layer ids (default: the output's, if it has exactly three)."""

    def __init__(self, layer_ids: Sequence[int], use: Sequence[int] | None = None, pad_token_id: int = 0) -> None:
        use = list(use) if use is not None else list(layer_ids)
        if len(use) != 3:
            raise ValueError(f"Eagle3Collator: EAGLE-3 takes 3 layers, got {use!r}; pass use=[low, mid, high]")
        self.cols = _columns(layer_ids, use, "Eagle3Collator")
        self.pad_token_id = pad_token_id

    def features(self, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        final = sample.get("final_hidden_states")
        if final is None:
            raise ValueError(f"sample {sample.get('id')!r} has no final_hidden_states: EAGLE-3 needs the final "
                             "normed state; extract with --final-state post-norm")
        hs = sample["hidden_states"][:, self.cols]
        return {"input_ids": sample["token_ids"], "aux_hidden_state": hs.reshape(hs.shape[0], -1),
                "hidden_state": final, "loss_mask": _mask(sample)}

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return pad_batch([self.features(s) for s in batch], self.pad_token_id)


def export_speculators(src: str, dst: str | Path, *, layers: Sequence[int] | None = None,
                       s3_endpoint_url: str | None = None, progress: bool = False) -> dict[str, Any]:
    """Write the extract output `src` (local or s3://) as speculators' offline training data
    in `dst` (new or empty). `layers`: the layer ids to export, in order (default: all); the
    last must be the model's last layer. Returns a summary."""
    try:
        import datasets
        import pyarrow as pa
    except ImportError:
        raise ImportError("export --to speculators needs the datasets package: pip install 'vllm-hidden[export]' "
                          "(or pip install datasets)") from None
    from safetensors.torch import save_file

    from vllm_hidden.data.dataset import HiddenStatesDataset

    ds = HiddenStatesDataset(src, s3_endpoint_url)
    use = list(layers) if layers is not None else list(ds.layer_ids)
    cols = _columns(ds.layer_ids, use, "--layers")
    last = ds.manifest.num_model_layers - 1
    if use[-1] != last:
        raise ValueError(f"speculators reads the last hidden-state slot as the model's final layer (layer id {last}, "
                         f"before the norm); the last exported layer is {use[-1]}: extract with layer {last} last "
                         f"(e.g. --layers {','.join(map(str, [*use[:-1], last]))}), or pass --layers ending in it")
    out = Path(dst)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"export: {str(dst)!r} exists and is not an empty directory")
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True)
    it: Any = range(len(ds))
    if progress:
        from rich.progress import track

        it = track(it, description="export")
    # the table is streamed to an Arrow file in batches (never all rows in memory), then
    # memory-mapped by datasets and saved in its own layout; the file is beside the output,
    # not in it: datasets will not save a table over the file it maps
    ids_t = pa.list_(pa.int64())
    schema = pa.schema([("input_ids", ids_t), ("loss_mask", ids_t), ("seq_len", pa.int64())])
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-export-", dir=out.parent) as scratch:
        stream = Path(scratch) / "table.arrow"
        rows: tuple[list[Any], list[Any], list[int]] = ([], [], [])
        tokens = 0
        with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, schema) as table_out:
            def flush() -> None:
                if rows[2]:
                    table_out.write_batch(pa.record_batch([pa.array(rows[0], ids_t), pa.array(rows[1], ids_t),
                                                           pa.array(rows[2], pa.int64())], schema=schema))
                    for r in rows:
                        r.clear()

            for i in it:
                s = ds[i]
                hs = s["hidden_states"] if cols is None else s["hidden_states"][:, cols]
                tok = s["token_ids"]
                save_file({"hidden_states": hs.contiguous(), "token_ids": tok.contiguous()},
                          str(hs_dir / f"hs_{i}.safetensors"))
                rows[0].append(tok.numpy())
                rows[1].append(_mask(s).to(torch.int64).numpy())
                rows[2].append(int(tok.shape[0]))
                tokens += int(tok.shape[0])
                if len(rows[2]) >= 1024:
                    flush()
            flush()
        table = datasets.Dataset.from_file(str(stream))
        table.set_format(type="torch")  # speculators compares input_ids with torch.equal
        table.save_to_disk(str(out))
        del table
    return {"samples": len(ds), "tokens": tokens, "layer_ids": use, "output": str(out)}
