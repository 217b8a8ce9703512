"""The middleware's answer for a request whose client hangs up (`_answer`), with a stand-in form
and a stand-in ASGI receive: before the states came nothing is stored; while they were stored,
what was stored is discarded; a client that stays gets its answer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from vllm_hidden.config import ServeConfig
from vllm_hidden.server.middleware import HiddenStatesMiddleware
from vllm_hidden.server.transport import Answer, Delivery, Transport


class Form(Transport):
    def __init__(self, write_s: float = 0.0) -> None:
        self.write_s, self.calls, self.discarded = write_s, [], []

    async def respond(self, body, got, pending, reserved):
        self.calls.append(reserved)
        await asyncio.sleep(self.write_s)  # the write
        return Answer([body], "key-1")

    async def discard(self, stored):
        self.discarded.append(stored)


def middleware(form: Form) -> HiddenStatesMiddleware:
    mw = HiddenStatesMiddleware.__new__(HiddenStatesMiddleware)
    mw.cfg = ServeConfig(timeout_s=5)
    mw._forms = {"connector": form}
    return mw


def pending(loop) -> SimpleNamespace:
    return SimpleNamespace(spec=SimpleNamespace(transfer="connector"), future=loop.create_future(), prompt_ids=[1, 2],
                           reserved=100)


def receive_after(seconds: float | None):
    """An ASGI receive whose http.disconnect comes after `seconds` (None: never)."""

    async def receive():
        if seconds is None:
            await asyncio.Event().wait()
        await asyncio.sleep(seconds)
        return {"type": "http.disconnect"}

    return receive


def run(form: Form, deliver_at: float, gone_at: float | None):
    async def main():
        loop = asyncio.get_running_loop()
        p = pending(loop)
        loop.call_later(deliver_at, p.future.set_result, Delivery(torch.zeros(2, 1, 1), None, True))
        return await middleware(form)._answer(b"{}", p, receive_after(gone_at)), p

    return asyncio.run(main())


def test_a_client_gone_before_its_states_came_gets_nothing_stored():
    form = Form()
    answer, p = run(form, deliver_at=0.3, gone_at=0.05)
    assert answer is None and form.calls == [] and form.discarded == []
    assert p.reserved == 100  # still the request's: released when it ends


def test_a_client_gone_while_its_states_were_stored_has_them_discarded():
    form = Form(write_s=0.3)
    answer, p = run(form, deliver_at=0.01, gone_at=0.1)
    assert answer is None and form.calls == [100] and form.discarded == ["key-1"]
    assert p.reserved == 0  # the form's: held by what it stored, given back by the discard


def test_a_client_that_stays_gets_its_answer():
    form = Form(write_s=0.05)
    answer, p = run(form, deliver_at=0.01, gone_at=None)
    assert answer == Answer([b"{}"], "key-1") and form.discarded == []
