"""``fxpipe.planning.plan``: a plan for devices described by numbers, without allocating the model.

The model is traced and costed under ``FakeTensorMode`` (see ``profile`` mode
``"analytic"``): FLOPs, saved-activation bytes and parameter bytes come from
shapes only, so a model built on the ``meta`` device — billions of parameters
on a laptop — plans as well as a real one. Times come from the target devices'
roofline (:class:`fxpipe.cost.devices.Devices`), links from their link classes; the
solver and the :class:`fxpipe.Plan` are the same as :func:`fxpipe.compile`'s,
so the plan can later run on the real devices with ``compile(model, ..., plan=plan)``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

import solvers
from fxpipe.cost.devices import Devices
from fxpipe.errors import InfeasiblePlanError
from fxpipe.frontend.fingerprint import graph_fingerprint
from fxpipe.planning.lowering import build_problem
from fxpipe.planning.memory_model import check_fits
from fxpipe.runtime.microbatch import batch_size_of, scatter
from fxpipe.planning.plan import Plan
from fxpipe.planning.tied_cost import charge_copies, tied_weights
from fxpipe.cost.profile import profile_graph
from fxpipe.planning.topology import links_from_classes
from fxpipe.frontend.trace import trace

__all__ = ["plan", "OPTIMIZER_STATE"]

OPTIMIZER_STATE = {"none": 0.0, "sgd": 1.0, "momentum": 2.0, "adam": 3.0}
"""Bytes kept per parameter byte besides the parameter: gradients, then optimizer moments."""


def plan(
    model: nn.Module,
    devices: Devices,
    example_inputs: tuple,
    *,
    chunks: int | None = None,
    schedule: str = "1f1b",
    stages: int | None = None,
    optimizer: str = "adam",
    checkpoint: str = "except_last",
    leaf_modules: Iterable[type | str] = (),
    time_limit_s: float = 10.0,
) -> Plan:
    """Plan ``model`` for ``devices`` (e.g. ``fxpipe.Devices.preset("h100", 8)``) from shapes alone.

    ``example_inputs`` is one full batch (real or ``meta`` tensors); ``optimizer`` sets
    the memory kept per parameter (``OPTIMIZER_STATE``: Adam keeps gradients and two
    moments). Raises :class:`fxpipe.InfeasiblePlanError` when nothing fits.
    """
    from fxpipe.planning.planner import (give_stage_memory, plan_from_solution, recompute_attempts, recompute_share,
                                         stage_buffers, with_recomputation)

    from fxpipe.checks import unwrap_compiled

    model = unwrap_compiled(model)
    if not isinstance(devices, Devices):
        raise TypeError("devices must be fxpipe.Devices, e.g. fxpipe.Devices.preset('h100', 8)")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE)}, got {optimizer!r}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    gm = trace(model, leaf_modules)
    batch = batch_size_of(list(example_inputs))
    chunks = chunks if chunks is not None else min(batch, 4 * len(devices))
    first = tuple(scatter(list(example_inputs), chunks)[0])
    reference = devices.specs[0]
    costs = profile_graph(gm, first, torch.device("cpu"), mode="analytic", spec=reference)
    links = links_from_classes(devices.link_classes, devices.bandwidth_Bps)
    failure: Exception | None = None
    for recompute in recompute_attempts(checkpoint):   # as fxpipe.planning.planner.Planner.plan
        share = recompute_share(checkpoint, chunks, recompute)   # the checkpointed micro-batches' forward, again
        problem = build_problem(gm, with_recomputation(costs, share), [torch.device(i) for i in devices.ids], links,
                                chunks, [s.memory_bytes for s in devices.specs], stages=stages,
                                optimizer_state_factor=OPTIMIZER_STATE[optimizer], schedule=schedule,
                                name=type(model).__name__,
                                speeds=[s.flops["float32"] / reference.flops["float32"] for s in devices.specs])
        problem.recompute = recompute
        try:
            solution = solvers.solve(problem, "dp", time_limit_s)
            result = plan_from_solution(problem, solution, devices.ids, graph_fingerprint(gm), type(model).__name__,
                                        chunks, checkpoint, batch, "analytic", reference.name, model.training,
                                        hosts=devices.nodes, recompute_share=share)
            stage_buffers(gm, costs, result)
            tied = tied_weights(gm, costs, result.stage_of(), chunks)
            if tied:
                result.predicted["tied_weights"] = tied
                charge_copies(result, tied, OPTIMIZER_STATE[optimizer])
            give_stage_memory(result, problem, solution)
            if recompute:
                check_fits(result)
            return result
        except (solvers.InfeasibleError, MemoryError) as exc:
            failure = exc
    assert failure is not None
    hint = "" if checkpoint == "never" else f" (under checkpoint={checkpoint!r}, recomputation counted)"
    raise InfeasiblePlanError(f"{failure}{hint}", getattr(failure, "min_peak_bytes", None)) from failure
