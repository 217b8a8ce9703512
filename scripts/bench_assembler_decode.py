"""Decode-step CPU time of Assembler.process alone (thread_time, no writer beside it): N
generating requests prefilled (200 tokens each), then decode steps of one row per request,
27B-shaped rows ([5, 5120] bf16) with row sums, a sink that keeps nothing. Three passes: the
staging pages touched for the first time, again, and with the step's rows in shuffled order.

    python scripts/bench_assembler_decode.py 256          # this checkout
    PYTHONPATH=/some/other/checkout python scripts/bench_assembler_decode.py 256
"""

from __future__ import annotations

import sys
import time

import torch

import vllm_hidden
from vllm_hidden.capture.assembler import Assembler
from vllm_hidden.capture.records import NewRequest, Segment, Sink, StepRecord
from vllm_hidden.capture.ring import StepTransfer

K, H = 5, 5120
PROMPT, DECODE = 200, 64


class Null(Sink):
    def reserve(self, *a, **k):
        raise AssertionError("prompt-only request in a generating benchmark")

    def add_rows(self, *a, done=None, **k):
        if done is not None:
            done()

    def commit(self, s):
        pass

    def drop(self, s):
        pass


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    print(vllm_hidden.__file__)
    tr = StepTransfer(4096, K, H, torch.bfloat16, torch.device("cpu"), 2, row_sums=True)
    a = Assembler(tr, Null())
    g = torch.Generator().manual_seed(0)
    for start in range(0, n, 16):  # prefill, 16 requests a step
        segs = [Segment(str(i), (i - start) * PROMPT, PROMPT, 0) for i in range(start, min(n, start + 16))]
        new = {s.req_id: NewRequest(s.req_id, list(range(PROMPT)), rows=PROMPT + DECODE, line=int(s.req_id),
                                    generate=True) for s in segs}
        a.process(StepRecord(tr.acquire(), len(segs) * PROMPT, segs, new))
    for label, shuffle in (("fresh pages, in order", False), ("pages touched before, in order", False),
                           ("pages touched before, shuffled", True)):
        ts = []
        for j in range(DECODE // 2):
            pos = PROMPT + j  # every pass fills the same positions: the later ones find their pages touched
            order = torch.randperm(n, generator=g).tolist() if shuffle else range(n)
            rec = StepRecord(tr.acquire(), n, [Segment(str(i), r, 1, pos) for r, i in enumerate(order)])
            t0 = time.thread_time()
            a.process(rec)
            ts.append(time.thread_time() - t0)
        ts = ts[2:]
        print(f"{n} requests, {label}: {sum(ts) / len(ts) * 1e3:.2f} ms of CPU per decode step")


if __name__ == "__main__":
    main()
