"""The up-front pass over a prompt file: every record checked as the reader will check it, short
of tokenizing (`PromptReader.check`: the id, the kind and its fields, token ids against the
vocabulary and the length limit, loss masks, turns, tools; and duplicate ids), streamed a line
(row group) at a time, before the engine starts and before anything is written.

A systematic mistake stops the run here: a file without records, or one whose first
SYSTEMATIC records (all of them, when it holds fewer) are all bad, e.g. every line naming its
prompt by a field we do not read. Isolated bad records are counted (`InputScan`) and then
skipped by the run as always (errors.jsonl). What only tokenizing tells (a text or
conversation longer than --max-model-len, a chat template that fails) is found as the run
reads each record."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_hidden.inputs.reader import BadLine, PromptReader, duplicate
from vllm_hidden.inputs.sources import input_format, records

SYSTEMATIC = 100  # the first this many records all bad: a mistake in the whole file, not in some lines


def where(path: Any, line: int) -> str:
    """A record's place for a person: a JSONL line counted from 1 (as editors count), a
    Parquet row or an array element by its 0-based index (as pyarrow, pandas and json show it)."""
    fmt = input_format(path)
    return f"row {line}" if fmt == "parquet" else f"array element {line}" if fmt == "json" else f"line {line + 1}"


@dataclass
class InputScan:
    path: str
    records: int = 0
    bad: int = 0
    first_bad: BadLine | None = None
    bytes: int = 0
    seconds: float = 0.0
    # line -> id of each record whose id an earlier good record has: the whole file's duplicates,
    # for a reader that starts mid-file (a resumed colocated stream) and never saw the first ones
    duplicates: dict[int, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the log: how many records, how many will be skipped, the first of them."""
        rate = f"{self.bytes / 1e6 / self.seconds:,.0f} MB/s" if self.seconds > 0 else "-"
        head = f"--input {self.path}: {self.records} records checked in {self.seconds:.1f} s ({rate})"
        b = self.first_bad
        if b is None:
            return head
        return (f"{head}; {self.bad} bad, skipped and recorded in errors.jsonl; the first: "
                f"{where(self.path, b.line)} (id {b.id!r}): {b.reason}")


def scan_input(reader: PromptReader) -> InputScan:
    """Every record of `reader`'s file through `reader.check` (`reader`: one made for this pass;
    the run reads the file again with a fresh one). Raises ValueError, naming the first bad
    record and why, on a systematic mistake (module docstring)."""
    path = reader.path
    scan = InputScan(path=str(path), bytes=os.path.getsize(path))
    t0 = time.perf_counter()
    seen: set[Any] = set()
    for i, obj in records(path, reader.columns):
        rec = reader.check(i, obj)
        if not isinstance(rec, BadLine):
            if rec.id in seen:
                scan.duplicates[i] = rec.id
                rec = BadLine(i, rec.id, duplicate(rec.id))
            else:
                seen.add(rec.id)
        scan.records += 1
        if isinstance(rec, BadLine):
            scan.bad += 1
            scan.first_bad = scan.first_bad or rec
        if scan.records == SYSTEMATIC and scan.bad == SYSTEMATIC:
            break  # no need to read on
    scan.seconds = time.perf_counter() - t0
    if not scan.records:
        raise ValueError(f"--input {path} holds no records (it is empty, or blank lines only)")
    b = scan.first_bad
    if b is not None and scan.bad == scan.records:
        what = (f"the first {SYSTEMATIC} records are all bad" if scan.records == SYSTEMATIC
                else "its only record is bad" if scan.records == 1 else f"all {scan.records} records are bad")
        raise ValueError(f"--input {path} {where(path, b.line)}: {b.reason}; {what}, so nothing was started")
    return scan
