"""Closing the loop: re-plan on measured stage times (``fxpipe.compile(..., calibrate=True)``).

Per-node profiles miss what only shows when a stage runs as a whole: per-call
overheads between nodes, kernels that run faster or slower in sequence than
alone, workers contending for cores and memory bandwidth. After a first plan,
:func:`stage_time_factors` runs a few real training steps with ``pipe.step`` and
takes, per stage, the measured forward and backward time over the predicted
one; :func:`scale_costs` multiplies every node's profiled time by its stage's
factors, and the planner solves again on those costs; the compiler repeats
until the cuts stop moving, so the plan's stage times are the ones measured in
the pipeline (contention with the other workers included). The loss of the
calibration steps is ``compile``'s ``loss_fn`` on its ``example_target`` when
given (the last stage's backward then includes the loss's, as in training),
else the sum of the model's floating-point outputs. Gradients,
BatchNorm statistics and the RNG state are restored afterwards, so calibrating
leaves no trace on the model.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.errors import FxpipeError
from fxpipe.runtime.execute.no_trace import leaving_no_trace
from fxpipe.planning.memory_model import recompute_s
from fxpipe.planning.plan import Plan
from solvers.simulate import per_micro_batch

__all__ = ["stage_time_factors", "step_stage_times", "predicted_backward_s", "scale_costs"]


def _sum_of_outputs(output: Any, _target: Any) -> torch.Tensor:
    parts = [t.float().sum() for t in tree_flatten(output)[0]
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not parts:
        raise FxpipeError("calibrate=True times the backward too, but no output of the model requires grad; "
                          "calibrate a model whose parameters train (or leave calibrate off)")
    return torch.stack(parts).sum()


def step_stage_times(pipe: Any, example_inputs: tuple, steps: int = 2, target: Any = None,
                     loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> list[tuple[list[float], list[float]]]:
    """Per stage, the forward seconds of every micro-batch and the backward (B plus W) seconds of every
    micro-batch in ``steps`` timed ``pipe.step`` runs after a warm-up, with ``loss_fn(output, target)`` as the
    loss (default: the sum of the outputs); the pipeline and the model are left as they were."""
    if steps < 1:
        raise ValueError(f"calibration_steps must be at least 1, got {steps}")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if loss_fn is None:   # any batch-sized tensor will do as the target: the loss ignores it
        target, loss_fn, reduction = next(t for t in inputs if isinstance(t, torch.Tensor)), _sum_of_outputs, "sum"
    else:
        reduction = "mean"
    times: list[tuple[list[float], list[float]]] = [([], []) for _ in pipe.plan.stages]
    try:
        with leaving_no_trace(pipe), torch.enable_grad():   # they train, even if compile runs under no_grad
            for step in range(steps + 1):
                pipe.step(inputs, target, loss_fn, reduction=reduction)
                if step == 0:
                    continue
                for st in pipe.plan.stages:
                    fwd, bwd = per_micro_batch([(t.kind, t.micro_batch, t.end_s - t.start_s)
                                                for t in pipe.last_step["timings"] if t.stage == st.index])
                    times[st.index][0].extend(fwd)
                    times[st.index][1].extend(bwd)
    finally:
        pipe.last_step = None
    return times


def predicted_backward_s(pipe: Any, stage: Any, micro_batches: int) -> float:
    """A plan stage's backward per micro-batch as a step runs it: ``bwd_s``, plus what its mode recomputes
    (:func:`fxpipe.planning.memory_model.recompute_s`: the forward again for the share of its micro-batches that
    are checkpointed, or the recomputed blocks)."""
    return stage.bwd_s + recompute_s(stage, pipe.stage_checkpoint(stage.index), micro_batches)


def stage_time_factors(pipe: Any, example_inputs: tuple, steps: int = 2, target: Any = None,
                       loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> list[list[float]]:
    """``[forward, backward]`` measured/predicted ratio of every stage over ``steps`` timed steps (after a warm-up),
    with ``loss_fn(output, target)`` as the loss (default: the sum of the outputs)."""
    times = step_stage_times(pipe, example_inputs, steps, target, loss_fn)
    m = len(times[0][0]) // steps    # micro-batches per step (fewer than chunks for a small batch)
    factors = []
    for st, (forward, backward) in zip(pipe.plan.stages, times):
        meas_f = statistics.median(forward)
        meas_b = statistics.median(backward)     # B and W together, per micro-batch
        pred_b = predicted_backward_s(pipe, st, m)
        factors.append([meas_f / st.fwd_s if st.fwd_s > 0 else 1.0,
                        meas_b / pred_b if pred_b > 0 else 1.0])
    return factors


def scale_costs(costs: dict[str, Any], plan: Plan, factors: list[list[float]]) -> dict[str, Any]:
    """``costs`` with each node's forward and backward time times its stage's factors in ``plan``."""
    stage_of = plan.stage_of()
    scaled = {}
    for name, cost in costs.items():
        if name in stage_of:
            f, b = factors[stage_of[name]]
            cost = dataclasses.replace(cost, fwd_s=cost.fwd_s * f, bwd_s=cost.bwd_s * b)
        scaled[name] = cost
    return scaled
