"""What ``pipe.step`` adds to the model's own operators, counted: the executor's cost, which becomes kernel launches
and host time on a GPU.

The caller's ``TorchDispatchMode`` reaches the stage workers (:mod:`fxpipe.runtime.execute.caller_state`), so a mode
around ``pipe.step`` sees every ATen operator the step dispatches, on every worker. The reference is the plain
model: ``loss_fn(model(x), y).backward()`` for one micro-batch, and for ``m`` micro-batches the usual gradient
accumulation loop (each micro-batch's loss weighted ``n_i / N``, then ``backward``). Operator counts on CPU are
deterministic. What the step adds, stated and asserted here:

- per step: :data:`PER_STEP` (the step's loss, summed over its micro-batches);
- per micro-batch: :data:`PER_MICRO_BATCH`: views (detached copies of the returned loss and output, fresh leaves)
  and one multiplication (the returned loss's part, weighted ``n_i / N`` as the loop weights the one it
  backpropagates), absent for one micro-batch, whose weight is 1; one stage and one micro-batch without
  checkpointing, :data:`WHOLE_BATCH` in all: ``stack`` and ``sum`` are the only operators that compute;
- per stage boundary and micro-batch: nothing (a boundary value is handed on as the same tensor, a fresh leaf);
- under a zero-bubble schedule (split backward): one view per parameter per step, finding its autograd node;
- none of it grows with the model (the same counts for a model of twice the blocks).
"""

from __future__ import annotations

import collections
import threading

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

import fxpipe

# Run in a process of their own (CI's ``-m alone`` run): after some other modules in the same process (seen with
# test_caller_state, test_module_hooks and test_profile before it, none of them alone) autograd copies some
# parameters' first gradients instead of taking them (``new_empty_strided`` + ``copy_`` in place of ``detach``),
# and these exact counts differ; the cause is not found.
pytestmark = pytest.mark.alone

PER_STEP = {"aten.stack.default": 1, "aten.sum.default": 1}
PER_MICRO_BATCH = {"aten.detach.default": 4, "aten.view.default": 2, "aten.mul.Tensor": 1}
# the batch split into one micro-batch (a view of the input and of the target), no weight to multiply by
WHOLE_BATCH = {**PER_STEP, "aten.detach.default": 4, "aten.view.default": 2, "aten.slice.Tensor": 2}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _count(run) -> collections.Counter:
    with _Count() as mode:
        run()
    return mode.ops


def _model(blocks: int, width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True) for _ in range(blocks)]
    return nn.Sequential(nn.Linear(width, width), *layers, nn.Linear(width, 7))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


X, Y = torch.randn(12, 6, 16), torch.randn(12, 6, 7)


def _added(model: nn.Module, pipe: fxpipe.Pipeline, m: int, schedule: str = "gpipe",
           reduction: str = "mean") -> dict[str, int]:
    """The operators ``pipe.step`` dispatches beyond the reference loop's, by name (negative: fewer)."""
    def reference() -> None:
        model.zero_grad()
        if m == 1:
            _loss(model(X), Y).backward()
            return
        for x, y in zip(X.tensor_split(m), Y.tensor_split(m)):
            (_loss(model(x), y) * (len(x) / len(X))).backward()

    def step() -> None:
        pipe.zero_grad()
        pipe.step(X, Y, _loss, chunks=m, schedule=schedule, reduction=reduction)

    reference(), step()   # warm: lazy initialisations count once, outside
    added = collections.Counter(_count(step))
    added.subtract(_count(reference))
    return {name: n for name, n in added.items() if n}


def _times(counts: dict[str, int], k: int) -> dict[str, int]:
    return {name: n * k for name, n in counts.items()}


def _plus(*parts: dict[str, int]) -> dict[str, int]:
    total: collections.Counter = collections.Counter()
    for part in parts:
        total.update(part)
    return {name: n for name, n in total.items() if n}


@pytest.fixture(scope="module")
def pipes() -> dict:
    built = {}
    for blocks in (2, 4):
        model = _model(blocks)
        built[blocks] = (model, {p: fxpipe.compile(model, ["cpu"] * p, (X,), stages=p, chunks=1, checkpoint="never")
                                 for p in (1, 2)})
    return built


@pytest.mark.parametrize("blocks", [2, 4])
def test_one_stage_one_micro_batch_adds_a_constant_to_the_model(pipes, blocks):
    model, by_stages = pipes[blocks]
    assert _added(model, by_stages[1], 1) == WHOLE_BATCH


@pytest.mark.parametrize("reduction", ["auto", "mean"])
def test_the_whole_batch_in_one_micro_batch_is_not_checked_or_rescaled(pipes, reduction):
    """One micro-batch needs no weights: ``"auto"`` neither reruns the loss to check it nor scales the gradients
    (a pass over every parameter) afterwards; what it adds does not grow with the model."""
    added = [_added(*_pair(pipes, blocks, 1), 1, reduction=reduction) for blocks in (2, 4)]
    assert added[0] == added[1]
    assert sum(added[0].values()) <= sum(WHOLE_BATCH.values()) + 5
    assert not any("mse_loss" in name or "norm" in name or "foreach" in name or "mul_" in name for name in added[0])


def _pair(pipes: dict, blocks: int, p: int) -> tuple[nn.Module, fxpipe.Pipeline]:
    model, by_stages = pipes[blocks]
    return model, by_stages[p]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_micro_batch_adds_a_constant_and_a_boundary_adds_nothing(pipes, schedule):
    for p in (1, 2):
        for m in (2, 3, 4):
            if p == 1 and schedule != "gpipe":
                continue
            assert _added(*_pair(pipes, 2, p), m, schedule) == _plus(PER_STEP, _times(PER_MICRO_BATCH, m)), (p, m)


def test_a_split_backward_finds_each_parameter_once_per_step(pipes):
    model, pipe = _pair(pipes, 2, 2)
    n_params = len(list(model.parameters()))
    for m in (2, 4):
        split = _added(model, pipe, m, "zb-h1")
        assert _plus(split, _times(_added(model, pipe, m, "1f1b"), -1)) == {"aten.view.default": n_params}


def test_a_mode_around_the_step_counts_the_model_flops(pipes):
    """``FlopCounterMode`` around ``pipe.step`` sees the workers' operators: the model's forward and backward FLOPs."""
    model, pipe = _pair(pipes, 2, 2)
    with FlopCounterMode(display=False) as plain:
        _loss(model(X), Y).backward()
    with FlopCounterMode(display=False) as piped:
        pipe.step(X, Y, _loss, chunks=3)
    assert piped.get_total_flops() == plain.get_total_flops() > 0


class _WeightCasts(TorchDispatchMode):
    """Counts autocast's casts of the given parameters (a float32 ``_to_copy`` of their storage), per parameter."""

    def __init__(self, params) -> None:
        super().__init__()
        self.names = {p.data_ptr(): name for name, p in params}
        self.casts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 \
                and args[0].data_ptr() in self.names:
            self.casts[self.names[args[0].data_ptr()]] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_autocast_casts_each_weight_once_per_step(pipes, schedule, checkpoint):
    """Under ``torch.autocast`` a step of 4 micro-batches casts each weight once, as the plain model's forward does
    (the workers stay in the caller's autocast for the whole step and leave its cast cache, one for the process, to
    the caller's autocast to clear); it cast each 4 times (8 with recomputation) when every operation entered and
    left autocast on its own, clearing every worker's casts."""
    model, pipe = _pair(pipes, 2, 2)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), target)

    plain = _WeightCasts(model.named_parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16), plain:
        loss(model(X), Y).backward()
    pipe.checkpoint = checkpoint
    try:
        piped = _WeightCasts(model.named_parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16), piped:
            pipe.step(X, Y, loss, chunks=4, schedule=schedule)
    finally:
        pipe.checkpoint = "never"
    norms = sum(1 for name, _ in model.named_parameters() if ".norm" in name)   # layer norms run in float32
    assert set(plain.casts.values()) == {1} and len(plain.casts) == len(list(model.parameters())) - norms > 0
    assert set(piped.casts) == set(plain.casts)   # the stages hold the model's own parameters
    assert set(piped.casts.values()) == {1}


def test_workers_outlive_the_step_and_keep_no_state_of_it(pipes):
    """The stage workers are borrowed from a pool (a fresh thread's first matrix products cost milliseconds): the
    same threads run the next step, none is left lent out, and none keeps the step's grad mode, autocast or
    dispatch modes."""
    from fxpipe.runtime.execute.worker import POOL, spawn_workers

    model, pipe = _pair(pipes, 2, 2)
    pipe.step(X, Y, _loss, chunks=2)
    size, threads = POOL.size, threading.active_count()
    with torch.autocast("cpu", dtype=torch.bfloat16), _Count():
        pipe.step(X, Y, _loss, chunks=2)
    with torch.no_grad():
        pipe(X)
    assert (POOL.size, threading.active_count(), POOL.busy()) == (size, threads, 0)
    with spawn_workers(POOL.size) as workers:
        for w in range(POOL.size):
            workers.submit(w, w, lambda: (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                                          len(_get_current_dispatch_mode_stack())))
        states = {workers.collect()[2] for _ in range(POOL.size)}
    assert states == {(True, False, 0)}


def test_autocast_casts_each_weight_once_in_a_call(pipes):
    """``pipe(x)`` under autocast, as ``pipe.step``: each weight is cast once for the 4 micro-batches (its workers
    leave autocast's cast cache to the caller's autocast)."""
    model, pipe = _pair(pipes, 2, 2)
    piped = _WeightCasts(model.named_parameters())
    pipe.inputs.chunks = 4
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), piped:
            out = pipe(X)
    finally:
        pipe.inputs.chunks = 1
    assert out.shape[0] == len(X) and piped.casts and set(piped.casts.values()) == {1}
