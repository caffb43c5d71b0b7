"""A batch shorter than the plan's micro-batches (a data loader's last batch) trains in one micro-batch per sample,
exactly as the one-process model; ``pipe.step(chunks=N)`` (``python -m fxpipe.launch --chunks N``) runs N."""

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe import launch
from models import SkipTied


def mlp(width=8, depth=6):
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(depth)])


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model, x, y):
    """Loss and gradients of the unpartitioned model on the whole batch."""
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_close(got, want):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_short_last_batch_trains_in_one_micro_batch_per_sample_as_one_process(schedule):
    torch.manual_seed(0)
    model = mlp()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=4, schedule=schedule,
                          profile="estimate")
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    want_loss, want = _reference(model, x, y)
    loss, out = pipe.step(x, y, F.mse_loss, return_outputs=True)
    assert pipe.last_step["micro_batches"] == 3
    torch.testing.assert_close(loss, want_loss)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    _assert_close(_grads(model), want)
    one = torch.randn(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(pipe(one), model(one))   # the forward alone, one sample: one micro-batch


@pytest.mark.parametrize("schedule,need", [("interleaved-1f1b", "micro-batches in groups of its 2 workers"),
                                           ("dualpipev", "at least as many micro-batches as its 4 stages")])
def test_a_short_batch_a_schedule_cannot_group_is_refused_naming_the_batch(schedule, need):
    """Interleaved 1F1B groups micro-batches by the workers and DualPipeV needs one a stage: a short batch of 3
    they cannot run is refused before anything runs, naming its samples and the batch that runs (the schedule's
    own fix, another chunks=, cannot help a batch of 3 samples)."""
    model = mlp()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=4, schedule=schedule,
                          profile="estimate")
    with pytest.raises(ValueError, match=rf"this batch has 3 samples, fewer than the 4 micro-batches planned, so it "
                                         rf"runs as 3 micro-batches of one sample; {schedule} runs {need}: give the "
                                         rf"step a batch of at least 4 samples"):
        pipe.step(torch.randn(3, 8), torch.randn(3, 8), F.mse_loss)
    assert all(p.grad is None for p in model.parameters())


def test_a_short_batch_interleaved_can_group_trains_exactly():
    """2 samples on 2 workers: interleaved 1F1B groups them, and the step is the model's."""
    torch.manual_seed(0)
    model = mlp()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=4, schedule="interleaved-1f1b",
                          profile="estimate")
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    want_loss, want = _reference(model, x, y)
    loss = pipe.step(x, y, F.mse_loss)
    assert pipe.last_step["micro_batches"] == 2
    torch.testing.assert_close(loss, want_loss)
    _assert_close(_grads(model), want)


def test_a_short_batch_of_tokens_without_a_target_trains_exactly():
    """The model's own output as the loss (target None) on 2 sequences with 3 micro-batches planned."""
    torch.manual_seed(0)
    model = SkipTied().train()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randint(0, 13, (6, 5)),), chunks=3, profile="estimate")
    tokens = torch.randint(0, 13, (2, 5))
    model.zero_grad(set_to_none=True)
    model(tokens).pow(2).mean().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    pipe.step(tokens, None, lambda out, _: out.pow(2).mean(), reduction="mean")
    assert pipe.last_step["micro_batches"] == 2
    _assert_close(_grads(model), want)


def test_step_chunks_runs_that_many_micro_batches_and_the_same_gradients():
    torch.manual_seed(0)
    model = mlp()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=4, profile="estimate")
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    _, want = _reference(model, x, y)
    for chunks, ran in ((2, 2), (8, 8), (16, 8)):
        pipe.step(x, y, F.mse_loss, chunks=chunks)
        assert pipe.last_step["micro_batches"] == ran
        _assert_close(_grads(model), want)
        model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"chunks must be a positive int \(micro-batches per step\), got 0; pass "
                                         r"e\.g\. chunks=4, the plan's"):
        pipe.step(x, y, F.mse_loss, chunks=0)


def test_launch_chunks_reaches_the_step():
    """``--chunks N`` becomes the step's ``chunks=N`` (with ``--schedule``); left out, the step gets neither."""
    base = ["--plan", "p.json", "--model", "m:f", "--data", "d:b"]
    assert launch.step_options(launch.parser().parse_args(base)) == {}
    args = launch.parser().parse_args([*base, "--chunks", "2", "--schedule", "gpipe"])
    assert launch.step_options(args) == {"chunks": 2, "schedule": "gpipe"}
    with pytest.raises(launch.UsageError, match="--chunks must be 1 or more micro-batches per step, got 0"):
        launch.step_options(launch.parser().parse_args([*base, "--chunks", "0"]))
    torch.manual_seed(0)
    model = mlp()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=4, profile="estimate")
    pipe.step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss, **launch.step_options(args))
    assert pipe.last_step["micro_batches"] == 2 and pipe.last_step["schedule"] == "gpipe"
