"""How much slower each stage runs beside the others when CPU workers share the processors, measured in steps.

CPU "devices" are threads of one process on the same processors. Stage
timing (:mod:`fxpipe.refine.stage_profile`) times every stage alone; in the pipeline
it runs beside other stages and is slowed by what they share: the processors
themselves (four workers on two cores take turns, :mod:`fxpipe.cost.cpu.turns`),
caches and memory bandwidth, and the interpreter lock that a model of many
small operations holds between them. How much depends on the stage and on what
runs beside it, and what runs beside it is the schedule's doing, so
:func:`measure_contention` measures it the way it will happen: the compiled
plan's own schedule run for a few training steps (after a warm-up, through
``compile``'s ``loss_fn`` when given, else the sum of the outputs; the model is
left as it was, :func:`fxpipe.refine.calibrate.step_stage_times`), and
:func:`solvers.contention.fit_stage_speeds` finds each stage's forward and
backward speed beside the others for which the simulator, sharing processors
and turns as the executor does, reproduces the measured medians. The result is
stored in the plan (``plan.profile["contention"]``) and ``pipe.report()``
predicts with it (:meth:`fxpipe.Pipeline.cpu_sharing`); the stage times the
planner balances stay the times alone. Without it (GPU workers, one worker,
``ProfileOptions(stage_timing=False)``, a plan from elsewhere) the report falls back on
:func:`fxpipe.cost.cpu.sharing.cpu_sharing`'s synthetic figure.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from fxpipe.options import CONTENTION_STEPS   # timed steps: medians over steps x micro-batches
from fxpipe.refine.calibrate import predicted_backward_s, step_stage_times
from fxpipe.cost.cpu.sharing import cores_per_worker, processors
from solvers.contention import fit_stage_speeds

__all__ = ["measure_contention", "CONTENTION_STEPS"]



def measure_contention(pipe: Any, example_inputs: tuple, steps: int = CONTENTION_STEPS, target: Any = None,
                       loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> dict[str, Any] | None:
    """The record of ``plan.profile["contention"]`` for ``pipe`` (see the module doc), or None where its
    workers do not share processors (fewer than two, or not all on the CPU) or nothing in it trains."""
    if len(pipe.specs) < 2 or any(d.type != "cpu" for d in pipe.devices):
        return None
    if not any(p.requires_grad for p in pipe.parameters()):
        return None    # nothing trains: the pipeline will only run forward (pipe(x)), not steps
    times = step_stage_times(pipe, example_inputs, steps, target, loss_fn)
    m = len(times[0][0]) // steps
    measured = [[statistics.median(fwd), statistics.median(bwd)] for fwd, bwd in times]
    stages = pipe.plan.stages
    workers = pipe._workers(pipe.schedule)
    speeds = fit_stage_speeds([st.fwd_s for st in stages],   # as the report predicts: recomputation in B
                              [predicted_backward_s(pipe, st, m) for st in stages], measured, m,
                              pipe.schedule, cores=cores_per_worker(), workers=workers, slots=processors())
    return {"schedule": pipe.schedule, "steps": steps, "micro_batches": m,
            "stage_nodes": [len(st.nodes) for st in stages], "measured_s": measured,
            "stage_efficiency": speeds,
            "parallel_efficiency": statistics.median(x for pair in speeds for x in pair)}
