"""SpecForge 0.2.0's offline training data: one `torch.save` dict per sample at
`rows_{g}-{g+2000}/data_{i}.ckpt` (the layout of SpecForge's scripts/prepare_hidden_states.py;
its OfflineManifestReader, runtime/data_plane/offline_reader.py, takes every *.ckpt under the
directory, sorted).

- specforge-eagle3 (algorithms/eagle3/data.py normalize_offline_sample): `input_ids` int64 [T],
  `loss_mask` int64 [T], `aux_hidden_state` [1, T, 3H] (three layers concatenated, low to
  high), `hidden_state` [1, T, H] = the final state AFTER the model's norm.
- specforge-dflash (algorithms/common/dflash_family_data.py normalize_offline_sample):
  `input_ids`, `loss_mask`, `hidden_states` [1, T, K*H] (the layers concatenated in
  `dflash_config.target_layer_ids` order). SpecForge raises mid-training on a sample without
  two consecutive supervised tokens, so those are left out and listed in export.json.

Layer ids are the same numbers on both sides: SpecForge's EAGLE-3 ids are given to SGLang,
which captures the input of layer id+1 (= the output of layer id), and its DFlash
target_layer_ids index HF hidden_states[id + 1] (modeling/draft/dflash.py
extract_context_feature); both are this project's layer ids.
"""

from __future__ import annotations

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
from vllm_hidden.storage.files import fsync_dir

KINDS = ("specforge-eagle3", "specforge-dflash")
GROUP = 2000  # files per rows_* directory, as SpecForge writes them


def sample_path(dest: Path, i: int) -> Path:
    g = i // GROUP * GROUP
    return dest / f"rows_{g}-{g + GROUP}" / f"data_{i}.ckpt"


def eagle3_default(num_layers: int) -> list[int]:
    """SpecForge's EAGLE-3 layers when its config names none (algorithms/model_providers.py
    resolve_eagle_capture_layers): [1, N//2 - 1, N - 4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def consecutive(mask: torch.Tensor) -> bool:
    """Two supervised tokens in a row: what SpecForge's DFlash loss needs in every sample."""
    return bool((mask[1:] & mask[:-1]).any()) if mask.numel() > 1 else False


def _check(kind: str, ds: Any, use: list[int] | None) -> tuple[list[int], list[int]]:
    m = ds.manifest
    n = m.num_model_layers
    if m.input.get("loss_mask") == "none":
        raise ValueError(f"--to {kind}: the output has no loss mask (extracted with --loss-mask none); SpecForge "
                         "reads one per sample: extract again without --loss-mask none (or with --loss-mask "
                         "assistant)")
    if kind == "specforge-dflash":
        return columns(m.layer_ids, use)
    if m.final_state != "post-norm":
        raise ValueError("--to specforge-eagle3: the output has no final normed state, which SpecForge trains "
                         "EAGLE-3 against (hidden_state); extract again with --final-state post-norm")
    if use is None:
        if len(m.layer_ids) != 3:
            raise ValueError(f"--to specforge-eagle3: EAGLE-3 takes 3 layers and the output has {list(m.layer_ids)}; "
                             "pass --layers with three of them, low to high (SpecForge's default for this model is "
                             f"{','.join(map(str, eagle3_default(n)))})")
        use = sorted(m.layer_ids)
    if len(use) != 3:
        raise ValueError(f"--to specforge-eagle3: EAGLE-3 takes 3 layers, got --layers {','.join(map(str, use))}")
    return columns(m.layer_ids, use, f"; extract with --layers {','.join(map(str, use))} --final-state post-norm")


def _eagle3(s: dict[str, Any], cols: list[int]) -> dict[str, torch.Tensor]:
    t = s["token_ids"].shape[0]
    return {"input_ids": own(s["token_ids"]), "loss_mask": s["loss_mask"].to(torch.int64),
            "hidden_state": own(s["final_hidden_states"]).unsqueeze(0),
            "aux_hidden_state": s["hidden_states"][:, cols].reshape(1, t, -1).clone()}


def _dflash(s: dict[str, Any], cols: list[int]) -> dict[str, torch.Tensor]:
    t = s["token_ids"].shape[0]
    return {"input_ids": own(s["token_ids"]), "loss_mask": s["loss_mask"].to(torch.int64),
            "hidden_states": s["hidden_states"][:, cols].reshape(1, t, -1).clone()}


def settings(kind: str, dest: Path, ids: list[int], model: str, num_layers: int, hidden: int) -> dict[str, Any]:
    """What to give SpecForge: the run config's fields and the command."""
    strategy = kind.removeprefix("specforge-")
    cfg: dict[str, Any] = {"training.strategy": strategy, "model.target_model_path": model,
                           "data.hidden_states_path": str(dest)}
    if strategy == "eagle3":
        cfg["model.aux_hidden_state_layer_ids"] = ids
        draft = {"eagle_config.eagle_aux_hidden_state_layer_ids": ids, "target_hidden_size": hidden}
    else:
        draft = {"dflash_config.target_layer_ids": ids, "num_target_layers": num_layers,
                 "target_hidden_size": hidden, "context width (K*H)": len(ids) * hidden}
    return {"trainer": "SpecForge 0.2.0", "numbering": "SpecForge layer id i = output of decoder layer i "
            "(the same numbers as this output's layer ids)", "run_config": cfg, "draft_config": draft,
            "command": f"specforge train --config run.yaml data.hidden_states_path={dest}"}


def export_specforge(kind: str, src: str, dest: str | Path, *, layers: list[int] | None = None,
                     s3_endpoint_url: str | None = None, progress: bool = False) -> dict[str, Any]:
    if kind not in KINDS:
        raise ValueError(f"--to must be one of {', '.join(KINDS)}, got {kind!r}")
    ds = open_source(src, s3_endpoint_url)
    ids, cols = _check(kind, ds, layers)
    out = Path(dest)
    identity = {"kind": kind, **source_identity(src, ds), "layer_ids": ids}
    resumed = start(out, identity)
    make = _eagle3 if kind == "specforge-eagle3" else _dflash
    done = Tally()
    made: set[Path] = set()
    with Writers() as w:
        for i, s in samples(ds, progress, f"export {kind}"):
            mask = s["loss_mask"]
            if kind == "specforge-dflash" and not consecutive(mask):
                done.skipped.append(s["id"])
                continue
            path = sample_path(out, i)
            done.samples += 1
            done.tokens += int(mask.shape[0])
            if resumed and path.is_file():
                continue
            if path.parent not in made:
                path.parent.mkdir(exist_ok=True)
                made.add(path.parent)
            w.submit(save_atomic, make(s, cols), path, torch.save)
            done.written += 1
    m = ds.manifest
    record = {**identity, "exported_samples": done.samples, "exported_tokens": done.tokens,
              "skipped": {"count": len(done.skipped), "ids": done.skipped[:100],
                          "why": "no two consecutive supervised tokens (SpecForge's DFlash loss needs them)"}
              if done.skipped else None,
              "files": f"rows_{{g}}-{{g+{GROUP}}}/data_{{i}}.ckpt",
              "settings": settings(kind, out, ids, m.model, m.num_model_layers, m.hidden_size)}
    for d in made:
        fsync_dir(d)
    finish(out, record)
    return {**record, "written": done.written, "resumed": resumed}
