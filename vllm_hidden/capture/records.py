"""What the runner hook tells the host side, and what the host side fills: the contract
between the engine thread (`engine.runner`), the assembler and its sinks.

Per step the hook sends a `StepRecord`: the ring slot its rows went to and, per captured
request, a `Segment` (rows, position). A sink hands out a `Slot` per sample: `reserve`, the
assembler `place`s rows into it across steps, then `commit` (or `drop` if the request was
aborted). The shard writer (`storage.shards`) is a sink whose slots live in its shard arenas;
`capture.memory.MemorySink` keeps each sample in its own tensor (the server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class Segment:
    req_id: str
    row: int  # first row of this request in the step buffer
    count: int  # rows of this request in the step
    pos: int  # position (token index in the prompt) of the first row


@dataclass(frozen=True, slots=True)
class NewRequest:
    sample_id: Any
    token_ids: list[int]
    # Open-ended capture (server, prompt + generated tokens): room for `rows` rows, and the
    # sample is complete when the request finishes, with the rows captured by then.
    rows: int | None = None
    line: int | None = None  # the input line (extract), for the sink's error reports
    loss_spans: list[list[int]] | None = None  # [start, end) token spans with loss 1 (extract)
    # extract --generate: room for `rows` (prompt + max tokens) in a buffer of its own; the
    # sample goes to the sink when the driver says where its response ends (`StepRecord.ends`)
    generate: bool = False
    turn: int = 0  # --regenerate all: which of the conversation's responses this request writes

    @property
    def until_finished(self) -> bool:
        return self.rows is not None and not self.generate


@dataclass(slots=True)
class StepRecord:
    slot: int | None  # None: no rows this step, only request bookkeeping
    num_tokens: int
    segments: list[Segment]
    new: dict[str, NewRequest] = field(default_factory=dict)
    finished: frozenset[str] = frozenset()
    # extract --generate: where responses ended, once the driver knows, each named by its "line" and
    # "turn" (the engine's request ids are not the driver's: vLLM adds a suffix to each): "rows" to
    # keep (prompt + response), "token_ids" (all of them), "loss_spans", "num_prompt", "record"; or
    # "drop" (a reason): its rows go
    ends: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Sample:
    sample_id: Any
    token_ids: torch.Tensor  # int64 [T]
    hidden_states: torch.Tensor  # [T, K, H]
    finite: bool = True  # the rows' statistics found no NaN/Inf (MemorySink sets it)


class CaptureError(RuntimeError):
    pass


class Slot(Protocol):
    buf: torch.Tensor  # [T, K, H], filled by the assembler

    # rows [pos, pos + n) from the ring: values [n, C, H] and their per-column statistic [n, C]
    # (C: the layers, then the final state's column if the ring has one)
    def place(self, pos: int, rows: torch.Tensor, stat: torch.Tensor) -> None: ...


class Sink(Protocol):
    def reserve(self, sample_id: Any, token_ids: list[int], *, line: int | None = None,
                loss_spans: list[list[int]] | None = None) -> Slot: ...
    # --generate: a whole sample at once, rows [T, C, H] as the ring's columns hold them
    def add_rows(self, sample_id: Any, token_ids: list[int], rows: torch.Tensor, stat: torch.Tensor, *,
                 loss_spans: list[list[int]] | None, num_prompt: int, record: str, line: int | None) -> None: ...
    def commit(self, slot: Any) -> None: ...
    def drop(self, slot: Any) -> None: ...
