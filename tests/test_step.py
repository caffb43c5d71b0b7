"""pipe.step: explicit GPipe/1F1B schedules, per-stage backward, exact gradients, errors."""

import copy
import gc
import threading

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import max_relative_error
from fxpipe.runtime.execute.codegen import split_graph
from fxpipe.runtime.execute.step import run_step
from models import SkipTied
from solvers.schedules import worker_orders


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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
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


@pytest.mark.parametrize("v,devices,chunks", [(2, 2, 4), (2, 3, 6), (3, 2, 2)])
def test_interleaved_1f1b_runs_v_stages_per_worker_with_skips_and_tied_weights(v, devices, chunks):
    torch.manual_seed(5)
    model = SkipTied(vocab=11, width=8, depth=2 * v * devices)
    tokens, target = torch.randint(0, 11, (12, 3)), torch.randint(0, 11, (12, 3))
    pipe = fxpipe.compile(model, ["cpu"] * devices, (tokens,), chunks=chunks, schedule="interleaved-1f1b",
                          virtual_stages=v, checkpoint="never", profile="estimate")
    assert len(pipe.plan.stages) == v * devices and pipe.plan.workers == devices
    assert pipe.plan.virtual_stages == v and pipe.plan.schedule == "interleaved-1f1b"
    assert len(fxpipe.Plan.from_dict(pipe.plan.to_dict()).stages) == v * devices   # survives JSON

    def loss_fn(logits, t):
        return nn.functional.cross_entropy(logits.reshape(-1, 11), t.reshape(-1))
    _assert_step_matches(model, pipe, tokens, target, loss_fn)
    for w, order in enumerate(worker_orders("interleaved-1f1b", v * devices, chunks, devices)):
        mine = sorted((t for t in pipe.last_step["timings"] if t.stage % devices == w), key=lambda t: t.start_s)
        assert [(t.kind, t.stage, t.micro_batch) for t in mine] == order   # one worker, in the schedule's order
        assert all(a.end_s <= b.start_s for a, b in zip(mine, mine[1:]))
    table = pipe.schedule_table().splitlines()
    assert len(table) == devices + 1 and "F0.0" in table[1] and f"F0.{devices}" in table[1]


def test_zb_h1_defers_weight_gradients_to_a_separate_pass():
    torch.manual_seed(6)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    x, target = torch.randn(8, 16), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4, stages=3, schedule="zb-h1", checkpoint="never",
                          profile="estimate")
    _assert_step_matches(model, pipe, x, target, nn.MSELoss())
    timings = pipe.last_step["timings"]
    assert sorted((t.kind, t.stage, t.micro_batch) for t in timings) == sorted(
        (kind, k, i) for kind in "FIW" for k in range(3) for i in range(4))
    for k in range(3):
        mine = sorted((t for t in timings if t.stage == k), key=lambda t: t.start_s)
        assert [(t.kind, t.stage, t.micro_batch) for t in mine] == worker_orders("zb-h1", 3, 4)[k]
    assert "W0" in pipe.schedule_table().splitlines()[3]
    assert "bwd ms pred" in pipe.report()


def test_an_interleaved_plan_needs_micro_batches_in_groups_of_the_workers():
    model = SkipTied(vocab=11, width=8, depth=4)
    tokens = torch.randint(0, 11, (12, 3))
    with pytest.raises(ValueError, match="use chunks=4"):
        fxpipe.compile(model, ["cpu"] * 2, (tokens,), chunks=3, schedule="interleaved-1f1b", profile="estimate")
    with pytest.raises(ValueError, match="needs schedule='interleaved-1f1b'"):
        fxpipe.compile(model, ["cpu"] * 2, (tokens,), chunks=4, virtual_stages=2, profile="estimate")
    with pytest.raises(ValueError, match="stages = 2 x the devices used"):
        fxpipe.compile(model, ["cpu"] * 2, (tokens,), chunks=4, stages=3, schedule="interleaved-1f1b",
                       profile="estimate")


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
                          options=fxpipe.CompileOptions(leaf_modules=[Fragile]))
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


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_loss_of_the_output_alone_takes_target_none(schedule):
    """``pipe.step(x, None, loss_fn)``: a self-supervised loss (or one over terms the model returns) gets
    ``None`` for every micro-batch, and the step equals the model's full-batch backward."""
    torch.manual_seed(0)
    model = SkipTied(vocab=13, width=16, depth=6)
    tokens = torch.randint(0, 13, (10, 5))
    pipe = fxpipe.compile(model, ["cpu"] * 4, (tokens,), chunks=4, stages=4, schedule=schedule,
                          profile="estimate")
    seen = []

    def loss_fn(logits, target):
        seen.append(target)
        return logits.logsumexp(-1).mean()
    _assert_step_matches(model, pipe, tokens, None, loss_fn)
    # the reference's call, one per micro-batch, and reduction="auto"'s check (a loss it does not recognise): one
    # call on a reference sample and one per micro-batch with that sample added
    assert seen == [None] * (1 + 4 + 1 + 4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_inputs_that_require_grad_get_the_full_batch_gradient(schedule):
    """An input leaf that requires grad gets its gradient (ZB-H1 and ZB-V left it on the micro-batch's
    slice), and an input computed by the caller (``pipe.step(torch.tanh(encoder(x)), ...)``) hands its
    gradient on into the caller's graph once (every schedule failed on the second micro-batch's backward
    through it)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)])
    encoder = nn.Linear(16, 16)
    x = torch.randn(10, 16, requires_grad=True)

    def loss_fn(out, target):
        return (out - target).pow(2).mean()
    target = torch.randn(10, 16)
    loss_fn(model(torch.tanh(encoder(x))), target).backward()
    want = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in encoder.named_parameters()}}
    x.grad = None
    encoder.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, schedule=schedule, profile="estimate")
    loss_fn(model(x), target).backward()
    want_leaf = x.grad.clone()
    x.grad = None
    pipe.step(x, target, loss_fn)
    assert max_relative_error(x.grad, want_leaf) <= 1e-5
    x.grad = None
    pipe.step(torch.tanh(encoder(x)), target, loss_fn)
    got = {"x": x.grad, **{n: p.grad for n, p in encoder.named_parameters()}}
    assert all(max_relative_error(got[n], want[n]) <= 1e-5 for n in want), {
        n: max_relative_error(got[n], want[n]) for n in want}


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
        assert [(t.kind, k, t.micro_batch) for t in mine] == worker_orders("1f1b", 2, 4)[k]
        assert all(a.end_s <= b.start_s for a, b in zip(mine, mine[1:]))
    text = pipe.report()
    assert "fwd ms pred" in text and "stage-time error: median" in text and len(text.splitlines()) == 6
    assert "workers sharing" in text      # CPU workers share the machine: the prediction says how
    assert pipe.plan.measured["cpu_sharing"][0] > 0


class ConvBN(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6, momentum=momentum)
        self.c2, self.b2 = nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6, momentum=momentum)
        self.head, self.b3 = nn.Linear(6, 4), nn.BatchNorm1d(4, momentum=momentum)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.b3(self.head(x.mean((2, 3))))


def _bn_state(model):
    return {n: b.clone() for n, b in model.named_buffers()}


def _full_batch_reference(model, steps, chunks):
    """What one full-batch nn.BatchNorm update per step gives, fed each layer's actual inputs: the
    concatenation of its micro-batches' inputs (each micro-batch is normalised by its own statistics)."""
    copy_model = copy.deepcopy(model)
    layers = {n: copy.deepcopy(m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    for batch in steps:
        seen = {n: [] for n in layers}
        hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen[n].append(args[0].detach()))
                 for n, m in copy_model.named_modules() if n in layers]
        for micro in batch.chunk(chunks):
            copy_model(micro)
        for h in hooks:
            h.remove()
        for n, layer in layers.items():
            layer.train()(torch.cat(seen[n]))
    return {f"{n}.{b}": t for n, layer in layers.items() for b, t in layer.named_buffers()}


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint,schedule", [("always", "1f1b"), ("never", "gpipe"), ("except_last", "zb-h1")])
def test_deferred_batch_norm_updates_running_statistics_like_one_full_batch_step(momentum, checkpoint, schedule):
    torch.manual_seed(7)
    model = ConvBN(momentum).train()
    x, target = torch.randn(12, 3, 8, 8), torch.randn(12, 4)
    steps = [torch.randn(12, 3, 8, 8) * (1 + k) + k for k in range(2)]
    want = _full_batch_reference(model, steps, 4)
    first = copy.deepcopy(model.b1)      # b1's input does not depend on micro-batching: plain full-batch BN
    with torch.no_grad():
        for batch in steps:
            first(model.c1(batch))
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4, stages=3, schedule=schedule, checkpoint=checkpoint,
                          profile="estimate", options=fxpipe.CompileOptions(deferred_batch_norm=True))
    for batch in steps:
        pipe.step(batch, target, nn.MSELoss())
    got = _bn_state(model)      # the user's own buffers were updated in place
    assert got["b1.num_batches_tracked"].item() == 2
    assert max_relative_error(got["b1.running_var"], first.running_var) <= 1e-5
    assert max_relative_error(got["b1.running_mean"], first.running_mean) <= 1e-5
    for name in want:
        assert max_relative_error(got[name], want[name]) <= 1e-5, name
    # without deferral each micro-batch moves the statistics once (a recomputation does not)
    model2 = ConvBN(momentum).train()
    plain = fxpipe.compile(model2, ["cpu"] * 3, (x,), chunks=4, stages=3, schedule=schedule, checkpoint=checkpoint,
                           profile="estimate")
    before = model2.b1.num_batches_tracked.item()
    plain.step(steps[0], target, nn.MSELoss())
    assert model2.b1.num_batches_tracked.item() - before == 4


def test_deferred_batch_norm_through_pipe_call_and_a_failed_step_leaves_no_partial_statistics():
    torch.manual_seed(8)
    model = ConvBN().train()
    x = torch.randn(8, 3, 8, 8)
    want = _full_batch_reference(model, [x], 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, stages=2, profile="estimate", checkpoint="except_last",
                          options=fxpipe.CompileOptions(deferred_batch_norm=True))
    pipe(x).sum().backward()     # except_last: the recomputation in backward must not count the statistics twice
    for name, got in model.named_buffers():
        assert max_relative_error(got, want[name]) <= 1e-5, name

    def bad_loss(out, t):
        raise RuntimeError("loss failed")
    before = _bn_state(model)
    with pytest.raises(fxpipe.StageError, match="loss failed"):
        pipe.step(x, torch.randn(8, 4), bad_loss)
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    want = _full_batch_reference(model, [x], 4)
    pipe(x)                      # the next mini-batch commits only its own statistics
    for name, got in model.named_buffers():
        assert max_relative_error(got, want[name]) <= 1e-5, name


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_checkpoint_recomputation_replays_the_same_dropout_masks(schedule):
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), *[m for _ in range(5) for m in (nn.Linear(32, 32),
                                                                                              nn.Tanh())]).train()
    x, target = torch.randn(8, 16), torch.randn(8, 32)

    def run(checkpoint, seed):
        pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, stages=2, schedule=schedule,
                              checkpoint=checkpoint, profile="estimate")
        assert pipe.plan.stage_of()["_1"] == 0     # dropout on stage 0: one thread draws every mask, in order
        torch.manual_seed(seed)
        loss, out = pipe.step(x, target, nn.MSELoss(), return_outputs=True)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out, grads
    out_never, grads_never = run("never", 0)
    out_always, grads_always = run("always", 0)     # recomputed in backward: same masks or other gradients
    assert torch.equal(out_never, out_always)
    assert all(torch.equal(a, b) for a, b in zip(grads_never, grads_always))
    out_other, grads_other = run("always", 1)       # the masks matter: another seed changes the gradients
    assert not torch.equal(grads_other[0], grads_never[0])


class DropoutEverywhere(nn.Module):
    def __init__(self, depth=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(depth))
        self.drops = nn.ModuleList(nn.Dropout(0.3) for _ in range(depth))

    def forward(self, x):
        for layer, drop in zip(self.layers, self.drops):
            x = drop(torch.tanh(layer(x)))
        return x


class _FixedMask(nn.Module):
    def __init__(self, masks, index, p):
        super().__init__()
        self.masks, self.index, self.p = masks, index, p

    def forward(self, x):
        mask = self.masks[(self.index, x.detach().numpy().tobytes())][0].to(x.dtype)
        return x.mul(mask).mul_(1.0 / (1 - self.p))     # native_dropout's arithmetic, bit for bit


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_concurrent_random_stages_replay_their_own_masks_on_recompute(schedule):
    """Four workers with dropout in every stage, all checkpointed. The gradient must be that of the masks
    the forwards drew: a recomputation that drew other masks (the device generator moved by another
    worker) would give another gradient. Masks are recorded by input, so the reference model replays them."""
    torch.manual_seed(10)
    model = DropoutEverywhere().train()
    x, target = torch.randn(16, 24), torch.randn(16, 24)
    two_each = schedule in ("interleaved-1f1b", "zb-v")   # two stages on each of two workers
    kwargs = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {"stages": 4}
    pipe = fxpipe.compile(model, ["cpu"] * (2 if two_each else 4), (x,), chunks=4,
                          schedule=schedule, checkpoint="always", profile="estimate", **kwargs)
    assert all(pipe._random_stages())
    seen: dict[tuple[int, bytes], list[torch.Tensor]] = {}
    lock = threading.Lock()

    def hook(module, args, out, index):
        with lock:
            seen.setdefault((index, args[0].detach().numpy().tobytes()), []).append(out.detach() != 0)
    hooks = [d.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i)) for i, d in enumerate(model.drops)]
    pipe.step(x, target, nn.MSELoss())
    for h in hooks:
        h.remove()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert len(seen) == 4 * 8                    # every forward drew once per dropout and micro-batch
    assert all(torch.equal(masks[0], m) for masks in seen.values() for m in masks[1:])   # replays agree
    fixed = copy.deepcopy(model)
    fixed.drops = nn.ModuleList(_FixedMask(seen, i, 0.3) for i in range(8))
    for xs, ts in zip(x.chunk(4), target.chunk(4)):
        (nn.functional.mse_loss(fixed(xs), ts) * len(xs) / len(x)).backward()
    for a, b in zip(got, fixed.parameters()):
        assert max_relative_error(a, b.grad) <= 1e-5


def test_report_with_memory_goes_into_the_plan_json(tmp_path):
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, schedule="1f1b", profile="estimate")
    pipe.step(x, y, nn.functional.cross_entropy, schedule="gpipe", measure_memory=True)
    text = pipe.report()
    assert "peak memory above parameters (profiled replay" in text and "MiB pred" in text
    measured = pipe.plan.measured
    assert measured["schedule"] == "gpipe" and len(measured["stages"]) == 2 and len(measured["memory"]) == 2
    assert all(w["activation_bytes"][1] > 0 for w in measured["memory"])
    pipe.plan.save(tmp_path / "plan.json")
    again = fxpipe.load_plan(tmp_path / "plan.json")
    assert again.measured["memory"] == measured["memory"]
    assert again.measured["iteration_s"] == pytest.approx(measured["iteration_s"])


def test_a_dropout_in_eval_mode_is_not_random_and_in_train_mode_is():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
    pipe = fxpipe.compile(model.eval(), ["cpu"] * 2, (torch.randn(4, 4),), chunks=2, stages=2, profile="estimate")
    assert not any(pipe._random_stages())       # eval: no generator is drawn from, no stage waits for it
    pipe.train()
    assert any(pipe._random_stages())
