"""The captured layers written by the forward into the step buffer (engine.stash): the op, the
hooked `_maybe_add_hidden_state`, a compiled forward keeping the op, and the step transfer taking
columns already in place (`submit(staged=...)`) to the same host bytes as a gather."""

from __future__ import annotations

import pytest
import torch

from vllm_hidden.capture.ring import StepTransfer
from vllm_hidden.engine import hooks, stash

H = 8


@pytest.fixture(autouse=True)
def no_target():
    stash.set_target(None)
    yield
    stash.set_target(None)


def _toy_class():
    """A model in vLLM's shape: an EagleModelMixin whose forward adds aux states through
    `_maybe_add_hidden_state`, with the method as the plugin replaces it."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    class Toy(torch.nn.Module, EagleModelMixin):
        def __init__(self, layers=3):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(layers))

        def forward(self, x):
            hidden, residual = x, None
            aux = self._maybe_add_hidden_state([], 0, hidden, residual)
            for i, layer in enumerate(self.layers):
                residual = hidden if residual is None else hidden + residual
                hidden = torch.tanh(layer(residual))
                self._maybe_add_hidden_state(aux, i + 1, hidden, residual)
            return (hidden, aux) if aux else hidden

    Toy._maybe_add_hidden_state = hooks._stash_aux_states(EagleModelMixin._maybe_add_hidden_state)
    return Toy


def _reference(model, x):
    """Each aux id's state, by vLLM's own rule (hidden + residual; the embedding for id 0)."""
    hidden, residual, out = x, None, {0: x}
    for i, layer in enumerate(model.layers):
        residual = hidden if residual is None else hidden + residual
        hidden = torch.tanh(layer(residual))
        out[i + 1] = hidden + residual
    return out


def test_the_op_writes_the_sum_into_its_column_and_nothing_without_a_target():
    values = torch.zeros(6, 3, H)
    token = torch.zeros(1)
    h, r = torch.randn(4, H), torch.randn(4, H)
    torch.ops.vllm_hidden.stash(token, h, r, 1)  # no target: nothing written
    assert not values.any()
    stash.set_target(stash.Target(values))
    torch.ops.vllm_hidden.stash(token, h, r, 1)
    torch.ops.vllm_hidden.stash(token, h, None, 2)  # the embedding: no residual yet
    assert torch.equal(values[:4, 1], h + r) and torch.equal(values[:4, 2], h)
    assert not values[:, 0].any() and not values[4:].any()
    big = torch.randn(9, H)  # more rows than the buffer: only what fits (padding rows past the step)
    torch.ops.vllm_hidden.stash(token, big, None, 0)
    assert torch.equal(values[:, 0], big[:6])


def test_the_hooked_method_stashes_on_an_attached_model_and_adds_aux_elsewhere():
    Toy = _toy_class()
    x = torch.randn(5, H)
    with torch.no_grad():
        ref = _reference(Toy(), x)

    plain = Toy()  # not attached: vLLM's own method, aux outputs as vLLM makes them
    plain.aux_hidden_state_layers = (1, 3)
    with torch.no_grad():
        hidden, aux = plain(x)
    assert len(aux) == 2 and torch.allclose(aux[0], ref[1]) and torch.allclose(aux[1], ref[3])

    model = Toy()
    model.aux_hidden_state_layers = (0, 1, 3)
    assert stash.aux_module(model, (0, 1, 3)) is model
    stash.attach(model, {3: 0, 0: 1, 1: 2}, torch.device("cpu"))  # columns in a user's layer order
    values = torch.zeros(8, 3, H)
    stash.set_target(stash.Target(values))
    with torch.no_grad():  # as vLLM runs its models
        out = model(x)
    assert isinstance(out, torch.Tensor) and torch.allclose(out, hidden)  # no aux outputs: plain's return
    for aux_id, col in {3: 0, 0: 1, 1: 2}.items():
        assert torch.allclose(values[:5, col], ref[aux_id]), aux_id


def test_a_compiled_forward_keeps_the_op():
    Toy = _toy_class()
    model = Toy()
    model.aux_hidden_state_layers = (2, 3)
    stash.attach(model, {2: 1, 3: 0}, torch.device("cpu"))
    values = torch.zeros(16, 2, H)
    stash.set_target(stash.Target(values))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for n in (5, 11):  # two sizes through one dynamic graph
        values.zero_()
        x = torch.randn(n, H)
        with torch.no_grad():
            ref = _reference(model, x)
            compiled(x)
        assert torch.allclose(values[:n, 0], ref[3], atol=1e-6) and torch.allclose(values[:n, 1], ref[2], atol=1e-6)


def test_a_model_that_adds_aux_states_inline_is_not_stashed():
    from vllm.model_executor.models.interfaces import EagleModelMixin

    class Inline(torch.nn.Module, EagleModelMixin):
        def forward(self, x):
            aux = [x + x] if 1 in self.aux_hidden_state_layers else []
            return x, aux

    m = Inline()
    m.aux_hidden_state_layers = (1,)
    assert stash.aux_module(m, (1,)) is None
    Toy = _toy_class()
    t = Toy()
    t.aux_hidden_state_layers = (1,)
    assert stash.aux_module(t, (2,)) is None  # another model's ids


@pytest.mark.parametrize("fp8", [False, True])
def test_staged_columns_reach_the_host_as_a_gather_does(fp8):
    """Rows 2..6 of a step: two layers written in place by the forward, the final state gathered
    beside them; the host slot (values and statistics) equals what the all-gather path gives."""
    torch.manual_seed(1)
    n_rows, start, n = 12, 2, 5
    layers = [torch.randn(n_rows, H, dtype=torch.bfloat16) * 3 for _ in range(3)]

    gathered = StepTransfer(16, 3, H, torch.bfloat16, torch.device("cpu"), 2, fp8=fp8, row_sums=True)
    slot = gathered.acquire()
    gathered.submit(layers, n, slot, start)

    staged = StepTransfer(16, 3, H, torch.bfloat16, torch.device("cpu"), 2, fp8=fp8, row_sums=True)
    stage = staged.stage()
    assert stage.shape == (16, 3, H) and stage.dtype == torch.bfloat16
    stage.fill_(7)  # rows outside the step must not reach the host
    for c in range(2):
        stage[:n_rows, c].copy_(layers[c])  # what the forward wrote: every row of its batch
    slot2 = staged.acquire()
    staged.submit(layers[2:], n, slot2, start, staged=2)

    assert torch.equal(staged._host_rows[slot2][:n], gathered._host_rows[slot][:n])
    if not fp8:
        assert torch.equal(staged.host[slot2][:n, 0], layers[0][start:start + n])
    with pytest.raises(ValueError, match="1 staged \\+ 1 gathered columns; the buffer has 3"):
        staged.submit(layers[2:], n, staged.acquire(), start, staged=1)
