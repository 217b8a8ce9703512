"""Extract output -> the files a drafter trainer reads: `export_output(src, kind, dest)`.

Kinds: speculators (to_speculators.py), specforge-eagle3 and specforge-dflash
(to_specforge.py). The destination's life (resumable, `export.json` last) is in run.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

KINDS = ("speculators", "specforge-eagle3", "specforge-dflash")


def export_output(src: str, kind: str, dest: str | Path, *, layers: list[int] | None = None,
                  s3_endpoint_url: str | None = None, progress: bool = False) -> dict[str, Any]:
    """Write the extract output `src` (a directory or s3://bucket/prefix) in trainer `kind`'s
    layout into `dest`; `layers`: the output's layer ids to write, in order. Returns what
    export.json records (plus `written` and `resumed`)."""
    if kind == "speculators":
        from vllm_hidden.export.to_speculators import export_speculators

        return export_speculators(src, dest, layers=layers, s3_endpoint_url=s3_endpoint_url, progress=progress)
    if kind in KINDS:
        from vllm_hidden.export.to_specforge import export_specforge

        return export_specforge(kind, src, dest, layers=layers, s3_endpoint_url=s3_endpoint_url, progress=progress)
    raise ValueError(f"--to must be one of {', '.join(KINDS)}, got {kind!r}")


def settings_lines(record: dict[str, Any]) -> list[str]:
    """The trainer settings that go with an export (its `record`), for a person."""
    s = record["settings"]
    lines = [f"exported {record['exported_samples']} samples, {record['exported_tokens']} tokens"
             + (f" ({record['written']} written now, the rest by the run this one finished)"
                if record["resumed"] else "")
             + (f"; left out {record['skipped']['count']}: {record['skipped']['why']}"
                if record.get("skipped") else ""),
             f"{s['trainer']}:"]
    if record["kind"] == "speculators":
        return [*lines, f"  target layer ids {record['target_layer_ids']} ({record['numbering']})",
                f"  flags: {s['flags']}"]
    return [*lines, f"  layer ids {record['layer_ids']}: {s['numbering']}",
            *(f"  {k}: {v}" for k, v in {**s["run_config"], **s["draft_config"]}.items()), f"  {s['command']}"]


__all__ = ["KINDS", "export_output", "settings_lines"]
