"""pipe.step: explicit GPipe/1F1B schedules, per-stage backward, exact gradients, errors."""

import gc
import threading

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import max_relative_error
from fxpipe.codegen import split_graph
from fxpipe.step import run_step
from models import SkipTied


def _reference(model, x, target, loss_fn):
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = loss_fn(out, target)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), out.detach(), grads


def _assert_step_matches(model, pipe, x, target, loss_fn, tol=1e-5, **kwargs):
    ref_loss, ref_out, ref_grads = _reference(model, x, target, loss_fn)
    loss, out = pipe.step(x, target, loss_fn, return_outputs=True, **kwargs)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    assert max_relative_error(out, ref_out) <= tol
    assert set(grads) == set(ref_grads)
    worst = max((max_relative_error(grads[n], ref_grads[n]), n) for n in ref_grads)
    assert worst[0] <= tol, worst


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_step_equals_one_full_batch_backward_with_skips_and_tied_weights(schedule, checkpoint):
    torch.manual_seed(0)
    model = SkipTied(vocab=13, width=16, depth=6)
    tokens = torch.randint(0, 13, (10, 5))
    target = torch.randint(0, 13, (10, 5))
    pipe = fxpipe.compile(model, ["cpu"] * 4, (tokens,), chunks=4, stages=4, schedule=schedule,
                          checkpoint=checkpoint, profile="estimate")
    assert len(pipe.plan.stages) == 4 and pipe.schedule == schedule

    def loss_fn(logits, t):
        return nn.functional.cross_entropy(logits.reshape(-1, 13), t.reshape(-1))
    _assert_step_matches(model, pipe, tokens, target, loss_fn)   # 10 rows: micro-batches 3, 3, 3, 1


def test_sum_reduction_and_a_second_step_accumulate_like_the_model():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))
    x, target = torch.randn(7, 6), torch.randn(7, 3)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=3, stages=3, schedule="1f1b", profile="estimate")

    def loss_fn(out, t):
        return ((out - t) ** 2).sum()
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), target).backward()
    loss_fn(model(x), target).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pipe.step(x, target, loss_fn, reduction="sum")
    pipe.step(x, target, loss_fn, reduction="sum")
    for n, p in model.named_parameters():
        assert max_relative_error(p.grad, want[n]) <= 1e-5, n


class TwoHalves(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        left, right = self.a(x).chunk(2, dim=1)    # a tuple value
        return self.b(left) * self.c(right)


def test_a_tuple_crossing_a_stage_boundary_carries_gradients_to_every_element():
    torch.manual_seed(2)
    model = TwoHalves()
    gm = fxpipe.trace(model)
    names = [n.name for n in gm.graph.nodes if n.op != "output"]
    cut = names.index("chunk") + 1             # the chunk's tuple crosses into stage 1
    stage_of = {name: (0 if i < cut else 1) for i, name in enumerate(names)}
    specs = split_graph(gm, stage_of, 2)
    assert "chunk" in specs[1].inputs
    x, target = torch.randn(6, 4), torch.randn(6, 4)
    micro = [{"x": t} for t in x.chunk(2)]
    output_arg = next(n for n in gm.graph.nodes if n.op == "output").args[0]

    def loss_fn(out, t):
        return ((out - t) ** 2).mean()
    loss, _ = run_step(specs, [torch.device("cpu")] * 2, output_arg, micro, list(target.chunk(2)), loss_fn,
                       "1f1b", lambda k, i: False)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want_loss = loss_fn(model(x), target)
    want_loss.backward()
    assert abs(loss.item() - want_loss.item()) < 1e-6
    for n, p in model.named_parameters():
        assert max_relative_error(got[n], p.grad) <= 1e-5, n   # a.weight gets both halves' gradients


class FailingBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        if FailingBackward.armed:
            raise RuntimeError("backward exploded")
        return g


class Fragile(nn.Module):
    """A leaf module (torch.fx would trace through the Function's forward and lose its backward)."""

    def forward(self, x):
        return FailingBackward.apply(x)


class WithFailingBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.fragile = Fragile()

    def forward(self, x):
        return self.c(self.fragile(self.b(torch.relu(self.a(x)))))


def test_a_failing_backward_names_stage_micro_batch_and_pass_and_a_later_step_works():
    torch.manual_seed(3)
    model = WithFailingBackward()
    x, target = torch.randn(6, 4), torch.randn(6, 4)
    before = threading.active_count()
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=3, stages=3, schedule="1f1b", profile="estimate",
                          leaf_modules=[Fragile])
    stage = next(s.index for s in pipe.plan.stages if "fragile" in s.nodes)
    loss_fn = nn.MSELoss()
    FailingBackward.armed = True
    try:
        with pytest.raises(fxpipe.StageError) as info:
            pipe.step(x, target, loss_fn)
    finally:
        FailingBackward.armed = False
    err = info.value
    assert err.stage == stage and "in backward of micro-batch" in str(err) and "backward exploded" in str(err)
    assert threading.active_count() == before
    model.zero_grad(set_to_none=True)
    _assert_step_matches(model, pipe, x, target, loss_fn)
    del pipe
    gc.collect()
    assert threading.active_count() == before


def test_step_arguments_are_checked():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile="estimate")
    with pytest.raises(ValueError, match="batch size of the inputs"):
        pipe.step(x, torch.randn(3, 2), nn.MSELoss())
    with pytest.raises(ValueError, match="reduction must be one of"):
        pipe.step(x, torch.randn(4, 2), nn.MSELoss(), reduction="max")
    with pytest.raises(ValueError, match="not supported by pipe.step"):
        pipe.step(x, torch.randn(4, 2), nn.MSELoss(), schedule="zigzag")
    with pytest.raises(fxpipe.StageError, match="loss_fn must return a scalar tensor"):
        pipe.step(x, torch.randn(4, 2), nn.MSELoss(reduction="none"))


def test_schedule_table_lists_every_operation_and_1f1b_keeps_at_most_p_minus_s_in_flight():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    pipe = fxpipe.compile(model, ["cpu"] * 4, (torch.randn(8, 4),), chunks=8, stages=4, schedule="1f1b",
                          profile="estimate")
    table = pipe.schedule_table()
    rows = table.splitlines()[1:]
    assert len(rows) == 4
    for s, row in enumerate(rows):
        ops = row.split(": ")[1].split()
        assert sorted(ops) == sorted([f"F{i}" for i in range(8)] + [f"B{i}" for i in range(8)])
        inflight = peak = 0
        for op in ops:
            inflight += 1 if op[0] == "F" else -1
            peak = max(peak, inflight)
        assert peak == 4 - s
    gpipe = pipe.schedule_table("gpipe").splitlines()[1]
    assert gpipe.split(": ")[1].split()[:8] == [f"F{i}" for i in range(8)]


def test_report_compares_predicted_and_measured_per_stage_after_a_step():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, schedule="1f1b")
    with pytest.raises(fxpipe.FxpipeError, match="run pipe.step"):
        pipe.report()
    pipe.step(x, y, nn.functional.cross_entropy)
    timings = pipe.last_step["timings"]
    assert sorted((t.kind, t.stage, t.micro_batch) for t in timings) == sorted(
        (kind, k, i) for kind in "FB" for k in range(2) for i in range(4))
    assert all(0 <= t.start_s <= t.end_s <= pipe.last_step["wall_s"] for t in timings)
    for k in range(2):   # each stage ran its operations one after another, in the schedule's order
        mine = sorted((t for t in timings if t.stage == k), key=lambda t: t.start_s)
        assert [(t.kind, t.micro_batch) for t in mine] == [(kind, i) for kind, i in
                                                           fxpipe.step.schedule_order("1f1b", k, 2, 4)]
        assert all(a.end_s <= b.start_s for a, b in zip(mine, mine[1:]))
    text = pipe.report()
    assert "fwd ms pred" in text and "stage-time error: median" in text and len(text.splitlines()) == 6
