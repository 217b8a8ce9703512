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


__all__ = ["KINDS", "export_output"]
