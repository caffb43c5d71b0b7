"""A checkpointed stage's recomputation neither updates buffers again nor reads them as later micro-batches left
them: BatchNorm statistics and any custom in-place buffer end as after each micro-batch ran once, and gradients
equal the unpartitioned model's (issue 15, item 2)."""

import copy
import dataclasses

import pytest
import torch
import torchvision

import fxpipe
from torch import nn

from equivalence import max_relative_error
from forced_cuts import compile_with_cuts

CHUNKS = 4


def _micro_batched_reference(model, x, target, loss_fn):
    """A deep copy run on the micro-batches in order, once each, no checkpointing: its buffers and the
    gradients of the full-batch mean loss."""
    ref = copy.deepcopy(model)
    for xs, ts in zip(x.chunk(CHUNKS), target.chunk(CHUNKS)):
        (loss_fn(ref(xs), ts) * len(xs) / len(x)).backward()
    return ({n: b.clone() for n, b in ref.named_buffers()},
            {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})


def _assert_same(model, want_buffers, want_grads, tol=1e-5):
    for name, b in model.named_buffers():
        if b.is_floating_point():
            assert max_relative_error(b, want_buffers[name]) <= tol, name
        else:
            assert torch.equal(b, want_buffers[name]), f"{name}: {b} != {want_buffers[name]}"
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, want_grads[name]) <= tol, name


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_resnet18_batchnorm_statistics_move_once_per_micro_batch(checkpoint, schedule):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x, target = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    loss_fn = nn.functional.cross_entropy
    want_buffers, want_grads = _micro_batched_reference(model, x, target, loss_fn)
    pipe = compile_with_cuts(model, (x,), ["layer2_0_conv1"], chunks=CHUNKS, checkpoint=checkpoint)
    pipe.step(x, target, loss_fn, schedule=schedule)
    tracked = {n: b.item() for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
    assert set(tracked.values()) == {CHUNKS}, tracked
    _assert_same(model, want_buffers, want_grads)


# These models read a buffer they update from the batch: micro-batches are successive calls on purpose.
SUCCESSIVE = fxpipe.CompileOptions(check_micro_batching=False)


class CountingEMA(nn.Module):
    """Updates buffers in place in forward and reads them: a counter and an exponential moving average."""

    def __init__(self, width=6):
        super().__init__()
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        self.count.add_(h.new_ones(()))          # constants alone would be folded away by torch.fx
        self.ema.mul_(h.new_full((), 0.9)).add_(h.mean(0).detach() * 0.1)
        return self.out(h + h * self.ema + self.count)   # (1 + self.ema) would be traced as a constant


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_custom_in_place_buffer_updates_happen_once_and_recomputation_reads_the_forwards_values(checkpoint,
                                                                                                  schedule):
    torch.manual_seed(1)
    model = CountingEMA()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    loss_fn = nn.functional.mse_loss
    want_buffers, want_grads = _micro_batched_reference(model, x, target, loss_fn)
    pipe = compile_with_cuts(model, (x,), ["tanh"], chunks=CHUNKS, checkpoint=checkpoint, options=SUCCESSIVE)
    pipe.step(x, target, loss_fn, schedule=schedule)
    assert model.count.item() == CHUNKS
    _assert_same(model, want_buffers, want_grads)


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_pipe_call_then_backward_recomputes_without_touching_buffers(checkpoint):
    torch.manual_seed(2)
    model = CountingEMA()
    x = torch.randn(8, 6)
    ref = copy.deepcopy(model)
    for xs in x.chunk(CHUNKS):   # one backward per micro-batch: the next forward changes what mul saved
        (ref(xs) ** 2).sum().backward()
    pipe = compile_with_cuts(model, (x,), ["tanh"], chunks=CHUNKS, checkpoint=checkpoint, options=SUCCESSIVE)
    (pipe(x) ** 2).sum().backward()
    assert model.count.item() == CHUNKS
    _assert_same(model, dict(ref.named_buffers()), {n: p.grad for n, p in ref.named_parameters()})


class EMA(nn.Module):
    """An exponential moving average updated in place and read by the same forward."""

    def __init__(self, width=6):
        super().__init__()
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        self.ema.mul_(h.new_full((), 0.9)).add_(h.mean(0).detach() * 0.1)
        return self.out(h + h * self.ema)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_buffer_whose_read_lands_in_the_stage_before_its_update_is_updated_itself_not_a_copy(schedule):
    torch.manual_seed(3)
    model = EMA()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    loss_fn = nn.functional.mse_loss
    want_buffers, want_grads = _micro_batched_reference(model, x, target, loss_fn)
    pipe = compile_with_cuts(model, (x,), ["mul_"], chunks=CHUNKS, checkpoint="except_last",
                             options=SUCCESSIVE)   # get_attr | mul_
    assert "ema" not in pipe.specs[1].inputs      # the stage reads the buffer itself
    pipe.step(x, target, loss_fn, schedule=schedule)
    _assert_same(model, want_buffers, want_grads)


class SplitUpdate(nn.Module):
    """A moving average updated by ``mul_`` and ``add_`` with work between them: a cut may fall inside."""

    def __init__(self, width=6):
        super().__init__()
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.avg = RunningAverage(width)

    def forward(self, x):
        return self.out(self.avg(torch.tanh(self.inp(x))))


class RunningAverage(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, h):
        decayed = self.ema.mul_(0.9)
        h = torch.sin(h) * 2
        decayed.add_(h.mean(0).detach() * 0.1)
        return h


def test_a_buffer_update_cut_across_stages_is_refused_and_the_leaf_it_names_works():
    torch.manual_seed(5)
    model = SplitUpdate()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    with pytest.raises(fxpipe.FxpipeError, match=r"buffer 'avg.ema' is updated in place and used in stages \[0, 1\].*"
                                                 r"leaf_modules=\['avg'\]"):
        compile_with_cuts(model, (x,), ["sin"], chunks=CHUNKS, options=SUCCESSIVE)
    want_buffers, want_grads = _micro_batched_reference(model, x, target, nn.functional.mse_loss)
    pipe = compile_with_cuts(model, (x,), ["out"], chunks=CHUNKS,
                             options=dataclasses.replace(SUCCESSIVE, leaf_modules=["avg"]))
    pipe.step(x, target, nn.functional.mse_loss, schedule="1f1b")
    _assert_same(model, want_buffers, want_grads)
