"""What the runner hook tells the host side, and what the host side fills: the contract
between the engine thread (`engine.runner`), the assembler and its sinks.

Per step the hook sends a `StepRecord`: the ring slot its rows went to and, per captured
request, a `Segment` (rows, position). A `Sink` takes the assembled samples, in one of two
ways: it hands out a `Slot` per sample (`reserve`), the assembler `place`s rows into it across
steps, then `commit`s it (or `drop`s it if the request was aborted); or, with --generate, it
takes a whole sample at once (`add_rows`). A request whose rows cannot be assembled goes to
the sink's `on_failure` first. `Sink` is an abstract base class: a sink missing one of these
methods cannot be instantiated. The shard writer (`storage.shards.ShardWriter`) is a sink
whose slots live in its shard arenas; `capture.memory.MemorySink` keeps each sample in its
own tensor (the server).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

log = logging.getLogger("vllm_hidden")


@dataclass(frozen=True, slots=True)
class Segment:
    req_id: str
    row: int  # first row of this request in the step buffer
    count: int  # rows of this request in the step
    pos: int  # position (token index in the prompt) of the first row


@dataclass(frozen=True, slots=True)
class Rows:
    """Captured rows, the one value every intake of a sink takes (`Slot.place`, `Sink.add_rows`):
    `values` [n, C, H] as the ring's columns hold them (the layers, then the final state's
    column if the ring has one), `row_scale` [n, C] float32 beside them (format.quant), and
    `row_sums` [n, 2, C], each row's sum and centred sum of squares, where the device made them
    (format.stats.RowSums)."""

    values: torch.Tensor
    row_scale: torch.Tensor
    row_sums: torch.Tensor | None = None

    def __getitem__(self, sel: slice | torch.Tensor) -> "Rows":
        return Rows(self.values[sel], self.row_scale[sel], None if self.row_sums is None else self.row_sums[sel])

    def __len__(self) -> int:
        return self.values.shape[0]

    @classmethod
    def measured(cls, values: torch.Tensor, fp8: bool) -> "Rows":
        """Rows of the model's dtype [n, C, H] with their row_scale made here (the values
        quantized first for a float8 output)."""
        from vllm_hidden.format import quant

        row_scale = torch.empty(values.shape[:2], dtype=torch.float32)
        if fp8:
            q = torch.empty(values.shape, dtype=quant.FP8)
            quant.quantize(values, q, row_scale, torch.empty_like(row_scale))
            return cls(q, row_scale)
        quant.row_amax(values, row_scale)
        return cls(values, row_scale)


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

    def __post_init__(self) -> None:
        if self.generate and (self.rows is None or self.line is None):
            raise ValueError(f"a generating request needs its rows and input line, got rows={self.rows!r} "
                             f"line={self.line!r} (sample {self.sample_id!r})")

    @property
    def until_finished(self) -> bool:
        return self.rows is not None and not self.generate


@dataclass(slots=True)
class ResponseEnd:
    """extract --generate: where a response ended, the driver's word to the worker. Named by the
    request's input line and turn (the engine's request ids are not the driver's: vLLM adds a
    suffix to each). Either `drop` (a reason: an error record, or a turn a later turn computes
    again; its rows go) or the sample: its first `rows` rows (prompt + response) and what goes
    with them. Crosses to the worker as a plain dict (`to_dict`): vLLM's RPC carries any."""

    line: int
    turn: int = 0
    drop: str | None = None
    rows: int = 0
    token_ids: list[int] = field(default_factory=list)  # all of them, prompt and response
    loss_spans: list[list[int]] | None = None
    num_prompt: int = 0
    record: str = ""  # the generations.jsonl line

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ResponseEnd":
        return cls(**d)


@dataclass(slots=True)
class StepRecord:
    slot: int | None  # None: no rows this step, only request bookkeeping
    num_tokens: int
    segments: list[Segment]
    new: dict[str, NewRequest] = field(default_factory=dict)
    finished: frozenset[str] = frozenset()
    ends: list[ResponseEnd] = field(default_factory=list)  # extract --generate: responses now ended


@dataclass(slots=True)
class Sample:
    sample_id: Any
    token_ids: torch.Tensor  # int64 [T]
    hidden_states: torch.Tensor  # [T, K, H]
    finite: bool = True  # the rows' statistics found no NaN/Inf (MemorySink sets it)
    scale: torch.Tensor | None = None  # float8 rows: their float32 scales [T, K] (value = fp8 * scale)


class CaptureError(RuntimeError):
    pass


class Slot(Protocol):
    buf: torch.Tensor  # [T, K, H], filled by the assembler

    # rows [pos, pos + len(rows)) of the sample, from the ring (`Rows`)
    def place(self, pos: int, rows: Rows) -> None: ...


class Sink(ABC):
    """Where assembled samples go. Every method is called from one thread (the assembler's).
    A sink is also a context manager: leaving the block closes it, also when the block raised."""

    @abstractmethod
    def reserve(self, sample_id: Any, token_ids: Sequence[int] | torch.Tensor, *, rows: int | None = None,
                line: int | None = None, loss_spans: list[list[int]] | None = None) -> Slot:
        """Room for one sample's rows, one per token id, or with `rows` room for that many
        (open-ended capture: the assembler commits the slot with `buf` cut to the rows captured
        by then). `line`: its input line, for error reports; `loss_spans`: [start, end) token
        spans with loss 1. A sink that cannot honour an argument raises ValueError naming it."""

    @abstractmethod
    def add_rows(self, sample_id: Any, token_ids: Sequence[int] | torch.Tensor, rows: Rows, *,
                 loss_spans: list[list[int]] | None, num_prompt: int, record: str, line: int | None = None,
                 done: Callable[[], None] | None = None) -> None:
        """--generate: a whole sample at once, its `rows` one per token id, with its prompt length
        and its generation record (a JSON line). `done`, if given, is called (from any thread)
        once the sink reads `rows` no more: the caller reuses their memory then."""

    @abstractmethod
    def commit(self, slot: Any) -> None:
        """The slot's rows are all placed: the sample is complete."""

    @abstractmethod
    def drop(self, slot: Any) -> None:
        """The slot's request was aborted or failed: its sample goes nowhere."""

    def on_failure(self, sample_id: Any, reason: str) -> bool:
        """A request whose rows cannot be assembled (`reason` says why). Returns whether the
        sink took the report. False (this default): the assembler raises the capture error, or,
        for a request that ended before its rows were all captured, keeps its id for the run's
        end-of-run check (`Assembler.dropped`)."""
        return False

    def close(self) -> Any:
        """Finish what the sink holds; nothing to finish by default."""
        return None

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc_type is None:
            self.close()
            return False
        # The block failed: close anyway (what is complete is kept, threads stop), but its own
        # exception is the one to see, not a close failure that may only follow from it.
        try:
            self.close()
        except Exception:
            log.exception("vllm-hidden: closing %s after a failure failed too", type(self).__name__)
        return False
