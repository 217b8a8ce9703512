"""vllm-project/speculators 0.9.0's offline training data (train/data.py ArrowDataset):
a `datasets` table (`save_to_disk`, torch format) with `input_ids`, `loss_mask`, `seq_len`
per row, and `hidden_states/hs_{i}.safetensors` for row i with `hidden_states` [T, K, H] and
`token_ids` [T] (which must equal the row's input_ids, dtype included, or the row is dropped).
One row per sample: a multi-turn conversation is one row whose loss mask covers every
assistant turn. speculators' own preprocessing (data_generation/preprocessing.py
_render_boundary_rows) fans a conversation out to one row per assistant turn, the conversation
rendered through that turn with only that turn masked. Attention is causal, so a turn's rows
in the whole conversation are those of its prefix: where the chat template renders a
conversation's history as it rendered it turn by turn, the one row supervises the same tokens
with the same states, at a fraction of the storage (a row per turn repeats every earlier turn).

Its EAGLE-3 model takes the last of the K slots as the verifier's final layer BEFORE the norm
(models/eagle3/core.py applies `verifier_norm` to it), so the last exported layer must be the
model's last. The other K-1 slots are the aux states its trainer is told about with
`--target-layer-ids`, in vLLM's numbering (aux id j = input of layer j = layer id j - 1), which
is also what the trained drafter's config records for vLLM to serve it with; export.json
holds them. token_freq.pt is what speculators' train/vocab_mapping.py
save_token_frequency_distribution writes (a dict token id -> count over input_ids[loss_mask],
read by train/cli.py with torch.load) so `--draft-vocab-size` builds d2t/t2d without a pass
over the data.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_hidden.export.run import (
    Tally,
    Writers,
    columns,
    finish,
    open_source,
    own,
    samples,
    save_atomic,
    source_identity,
    start,
)
from vllm_hidden.layers import to_aux_ids

TOKEN_FREQ = "token_freq.pt"
TABLE_BATCH_ROWS = 1024  # rows per Arrow batch written to the table's stream


@dataclass
class TableRows:
    """Table rows not yet written to the stream, a list per column (numpy int64 arrays for the
    token columns)."""

    input_ids: list[Any] = field(default_factory=list)
    loss_mask: list[Any] = field(default_factory=list)
    seq_len: list[int] = field(default_factory=list)

    def add(self, token_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        self.input_ids.append(token_ids.numpy())
        self.loss_mask.append(loss_mask.numpy())
        self.seq_len.append(int(token_ids.shape[0]))

    def __len__(self) -> int:
        return len(self.seq_len)

    def clear(self) -> None:
        for column in (self.input_ids, self.loss_mask, self.seq_len):
            column.clear()


def _check(ds: Any, use: list[int] | None) -> tuple[list[int], list[int]]:
    m = ds.manifest
    last = m.num_model_layers - 1
    have = list(m.layer_ids)
    want = list(have) if use is None else list(use)
    if want[-1] != last:
        aux = [i for i in want if i != last]
        fix = ",".join(map(str, [*aux, last]))
        how = f"pass --layers {fix}" if all(i in have for i in [*aux, last]) else f"extract with --layers {fix}"
        raise ValueError(f"speculators reads the last hidden-state slot as the model's final layer (layer id {last}, "
                         f"before the norm); the last exported layer is {want[-1]}: {how}")
    if len(want) < 2:
        raise ValueError(f"speculators' EAGLE-3 needs aux layers besides the final one (layer id {last}); got "
                         f"{want}: extract with e.g. --layers "
                         f"{','.join(map(str, [1, m.num_model_layers // 2 - 1, m.num_model_layers - 4, last]))}")
    return columns(have, want)


def trainer_flags(dest: Path, model: str, aux: list[int]) -> str:
    return (f"--data-path {dest} --verifier-name-or-path {model} --target-layer-ids {' '.join(map(str, aux))} "
            "--draft-vocab-size N (d2t/t2d from token_freq.pt)")


def export_speculators(src: str, dest: str | Path, *, layers: list[int] | None = None,
                       s3_endpoint_url: str | None = None, progress: bool = False) -> dict[str, Any]:
    """Write the extract output `src` (local or s3://) as speculators' offline training data
    in `dest` (new or empty, or an unfinished export of the same). `layers`: the layer ids to
    export, in order (default: all); the last must be the model's last. Returns export.json."""
    try:
        import datasets
        import pyarrow as pa
    except ImportError:
        raise ImportError("export --to speculators needs the datasets package: pip install datasets (in a clone of "
                          "vllm-hidden: pip install -e '.[export]')") from None
    from safetensors.torch import save_file

    ds = open_source(src, s3_endpoint_url)
    ids, cols = _check(ds, layers)
    out = Path(dest)
    identity = {"kind": "speculators", **source_identity(src, ds), "layer_ids": ids}
    resumed = start(out, identity)
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(exist_ok=True)
    freq: Counter[int] = Counter()
    done = Tally()
    # the table is streamed to an Arrow file in batches (never all rows in memory), then
    # memory-mapped by datasets and saved in its own layout; the file is beside the output,
    # not in it: datasets will not save a table over the file it maps
    ids_t = pa.list_(pa.int64())
    schema = pa.schema([("input_ids", ids_t), ("loss_mask", ids_t), ("seq_len", pa.int64())])
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-export-", dir=out.parent) as scratch:
        stream = Path(scratch) / "table.arrow"
        rows = TableRows()
        with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, schema) as table_out, Writers() as w:
            def flush() -> None:
                if rows:
                    table_out.write_batch(pa.record_batch(
                        [pa.array(rows.input_ids, ids_t), pa.array(rows.loss_mask, ids_t),
                         pa.array(rows.seq_len, pa.int64())], schema=schema))
                    rows.clear()

            for i, s in samples(ds, progress, "export speculators"):
                tok = own(s["token_ids"])
                mask = s.get("loss_mask")  # --loss-mask none: every token counts
                mask = torch.ones_like(tok) if mask is None else mask.to(torch.int64)
                path = hs_dir / f"hs_{i}.safetensors"
                if not (resumed and path.is_file()):
                    hs = s["hidden_states"][:, cols].contiguous()
                    w.submit(save_atomic, {"hidden_states": hs, "token_ids": tok}, path, save_file)
                    done.written += 1
                rows.add(tok, mask)
                ids_u, counts = tok[mask.bool()].unique(return_counts=True)
                freq.update(dict(zip(ids_u.tolist(), counts.tolist())))
                done.samples += 1
                done.tokens += int(tok.shape[0])
                if len(rows) >= TABLE_BATCH_ROWS:
                    flush()
            flush()
        table = datasets.Dataset.from_file(str(stream))
        table.set_format(type="torch")  # speculators compares input_ids with torch.equal
        quiet = not progress and datasets.is_progress_bar_enabled()
        if quiet:
            datasets.disable_progress_bars()
        try:
            table.save_to_disk(str(out))  # beside hidden_states/; a rerun of an unfinished export writes it anew
        finally:
            if quiet:
                datasets.enable_progress_bars()
        del table
    save_atomic(dict(freq), out / TOKEN_FREQ, torch.save)
    m = ds.manifest
    aux = to_aux_ids(ids[:-1])
    record = {**identity, "exported_samples": done.samples, "exported_tokens": done.tokens,
              "target_layer_ids": aux,
              "numbering": "target_layer_ids: vLLM EAGLE-3 aux ids (input of layer j = layer id j-1), without the "
                           "final layer, whose state (before the norm) is the last hidden-state slot",
              "final_layer_id": m.num_model_layers - 1, "hidden_size": m.hidden_size, "token_freq": TOKEN_FREQ,
              "rows": "one per sample: a multi-turn conversation is one row, its loss mask over every assistant "
                      "turn (speculators' own preprocessing makes a row per assistant turn; see the docs)",
              "settings": {"trainer": "speculators 0.9.0", "flags": trainer_flags(out, m.model, aux)}}
    finish(out, record)
    return {**record, "written": done.written, "resumed": resumed}
