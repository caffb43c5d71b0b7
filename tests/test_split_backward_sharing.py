"""ZB-H1's deferred weight pass when a parameter-side subgraph that saves tensors is shared at any depth: between
frontiers two levels down, with a value the stage also sends on, in a T5-style position bias, and a parameter
used both directly and through a function (issue 15, item 8). Gradients equal one full-batch backward."""

import copy

import pytest
import torch
from torch import nn

from equivalence import max_relative_error
from forced_cuts import compile_with_cuts
from fxpipe.runtime.backward.split_backward import backward_inputs


class SharedTwoLevelsDown(nn.Module):
    """``w = tanh(p)`` reaches two matmuls through ``w.t()`` and ``w * 3``: the frontiers' direct children
    differ, the saved ``tanh`` below them is shared."""

    def __init__(self, d=6):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.p = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x):
        h = self.a(x)
        w = torch.tanh(self.p)
        return self.b(h @ w.t() + torch.sin(h) @ (w * 3))


class SharedAcrossStages(nn.Module):
    """``w = tanh(p)`` used in its own stage and sent on to the next one, which uses it too."""

    def __init__(self, d=6):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.p = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x):
        h = self.a(x)
        w = torch.tanh(self.p)
        y = self.b(torch.relu(h @ w.t()))
        return self.c(torch.sigmoid(y @ w.t()))


class DirectAndThroughAFunction(nn.Module):
    """``p`` read directly by one matmul and through ``exp`` (which saves its result) by two more."""

    def __init__(self, d=6):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.p = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x):
        h = self.a(x)
        e = torch.exp(self.p)
        return self.b(h @ self.p + torch.tanh(h) @ e[:, :].t() + (h * h) @ (e * 2))


class RelativeBiasAttention(nn.Module):
    """T5-style: one relative-position bias (an embedding of bucket indices, which saves them) computed once and
    added, sliced differently, to the attention scores of two layers."""

    def __init__(self, d=8, length=5, buckets=7):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.bias = nn.Embedding(buckets, 1)
        pos = torch.arange(length)
        self.register_buffer("buckets", (pos[None, :] - pos[:, None]).clamp(-3, 3) + 3)
        self.q1, self.q2 = nn.Linear(d, d), nn.Linear(d, d)
        self.k1, self.k2 = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)   # a key bias's gradient is 0

    def forward(self, x):
        h = self.inp(x)
        bias = self.bias(self.buckets).squeeze(-1)           # (L, L), parameter side only
        s1 = self.q1(h) @ self.k1(h).transpose(1, 2) + bias[None]
        h = torch.softmax(s1, -1) @ h
        s2 = self.q2(h) @ self.k2(h).transpose(1, 2) + bias.unsqueeze(0) * 0.5
        return torch.softmax(s2, -1) @ h


CASES = [
    (SharedTwoLevelsDown, (8, 6), ["p"]),
    (SharedAcrossStages, (8, 6), ["p", "relu"]),
    (DirectAndThroughAFunction, (8, 6), ["exp"]),
    (RelativeBiasAttention, (8, 5, 8), ["bias", "q2"]),
]


@pytest.mark.parametrize("make,shape,cuts", CASES, ids=[c[0].__name__ for c in CASES])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_zb_h1_gradients_equal_one_full_batch_backward(make, shape, cuts, checkpoint):
    torch.manual_seed(0)
    model = make()
    x, target = torch.randn(*shape), torch.randn(*shape)
    loss_fn = nn.functional.mse_loss
    ref = copy.deepcopy(model)
    loss_fn(ref(x), target).backward()
    pipe = compile_with_cuts(model, (x,), cuts, chunks=4, checkpoint=checkpoint)
    pipe.step(x, target, loss_fn, schedule="zb-h1")
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, dict(ref.named_parameters())[name].grad) <= 1e-5, name


def test_the_input_pass_leaves_weight_gradients_for_the_weight_pass_even_when_shared_deep_down():
    torch.manual_seed(0)
    model = SharedTwoLevelsDown()
    x = torch.randn(4, 6)
    ref = copy.deepcopy(model)
    leaf = ref.a(x).detach().requires_grad_()
    w = torch.tanh(ref.p)
    (ref.b(leaf @ w.t() + torch.sin(leaf) @ (w * 3)) ** 2).sum().backward()

    h = model.a(x).detach().requires_grad_()
    w = torch.tanh(model.p)
    out = model.b(h @ w.t() + torch.sin(h) @ (w * 3))
    params = [model.p, model.b.weight, model.b.bias]
    weight_pass = backward_inputs([out], [2 * out.detach()], [h], params)
    assert weight_pass.deferred and all(p.grad is None for p in params)   # B computed input gradients only
    assert max_relative_error(h.grad, leaf.grad) <= 1e-6
    weight_pass.run()
    for p, q in zip(params, [ref.p, ref.b.weight, ref.b.bias]):
        assert max_relative_error(p.grad, q.grad) <= 1e-6


F = nn.functional
IN_A_ROW = {   # a parameter reached again from a frontier below: autograd would sum both paths
    "module applied twice": lambda x, p, b: F.linear(F.linear(x, p, b), p, b),
    "computed weight twice in a row": lambda x, p, b: (lambda w: (x @ w) @ w)(torch.tanh(p)),
    "weight and bias, weight again": lambda x, p, b: (x @ p + b) @ p,
}
SIDE_BY_SIDE = {   # shared only between branches: the weight pass stays deferred
    "two tanh of one parameter": lambda x, p, b: (x @ torch.tanh(p)) @ torch.tanh(p),
    "branches": lambda x, p, b: torch.relu(x @ p + b) + x @ p,
    "transpose and direct": lambda x, p, b: (x @ p) @ p.t() * 3,
}


@pytest.mark.parametrize("name", list(IN_A_ROW) + list(SIDE_BY_SIDE))
def test_the_split_backward_of_a_parameter_used_twice_equals_one_backward(name):
    build = {**IN_A_ROW, **SIDE_BY_SIDE}[name]
    torch.manual_seed(0)
    p, b, x = torch.randn(4, 4, requires_grad=True), torch.randn(4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    y = build(x, p, b)
    g = torch.randn_like(y)
    want = torch.autograd.grad([y], [x, p, b], [g], retain_graph=True, allow_unused=True)
    weight_pass = backward_inputs([y], [g], [x], [p, b])
    assert weight_pass.deferred == (name in SIDE_BY_SIDE)
    weight_pass.run()
    for got, expected in zip([x.grad, p.grad, b.grad], want):
        assert (got is None) == (expected is None)
        if expected is not None:
            assert max_relative_error(got, expected) <= 1e-6, name


class LinearTwice(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def test_zb_h1_with_a_module_called_twice_in_one_stage_equals_one_backward():
    """Found by the property test: a shared module whose parameters arrive from another stage."""
    torch.manual_seed(4)
    model = LinearTwice()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    reference = copy.deepcopy(model)
    nn.functional.mse_loss(reference(x), target).backward()
    pipe = compile_with_cuts(model, (x,), ["tanh"], chunks=4, schedule="zb-h1", checkpoint="never")
    pipe.step(x, target, nn.functional.mse_loss)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert max_relative_error(got.grad, want.grad) <= 1e-5, name
