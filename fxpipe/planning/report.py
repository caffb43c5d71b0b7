"""Predicted against measured for one training step: per-stage times, idle share and per-worker peak memory.

:meth:`Pipeline.report` prints this table and stores the same numbers in the
plan (``plan.measured``), so a saved plan carries how far its predictions were
from a real run. The prediction for the step's schedule comes from the
simulator (:mod:`solvers.simulate`) on the plan's stage times, with a
checkpointed micro-batch's recomputed forward added to its backward; on CPU
workers, which share the machine's cores (:mod:`fxpipe.cost.cpu.sharing`), the
simulator lets concurrent operations share them, and the predicted time of an
operation is its simulated duration, not its time alone. Memory,
when the step measured it (``pipe.step(..., measure_memory=True)``), is the
peak above parameters and gradients per worker: ``torch.cuda.max_memory_allocated``
on a GPU, a profiled replay of the worker on CPU (:mod:`fxpipe.runtime.execute.memory_probe`),
against :mod:`fxpipe.planning.memory_model`. Transfers happen inside the consumer's
forward and the producer's backward on CPU workers, so they are part of the
measured times, not a column of their own.
"""

from __future__ import annotations

import statistics
from typing import Any

from fxpipe.cost.cpu.sharing import CpuSharing
from fxpipe.planning.memory_model import predict_worker_memory
from fxpipe.planning.plan import Plan, aligned_table
from solvers.schedules import BACKWARDS, stage_worker
from solvers.simulate import per_micro_batch, simulate, stage_medians, weight_shares

__all__ = ["step_report", "predicted_times", "per_micro_batch"]


def _error(measured: float, predicted: float) -> float:
    return (predicted - measured) / measured if measured > 0 else float("nan")


def predicted_times(fwd_s: list[float], bwd_s: list[float], micro_batches: int, schedule: str, workers: int,
                    sharing: CpuSharing | None = None,
                    recompute_s: list[float] | None = None) -> tuple[float, list[tuple[float, float]]]:
    """The simulated iteration and, per stage, the median forward and backward (B plus W) duration of
    one micro-batch: the times alone, or stretched where workers share CPU cores. ``recompute_s[s]``: the
    recomputed forward a micro-batch of stage ``s`` adds to its backward on average, run in ``B`` under a
    split backward (the weight pass takes half of the backward proper, as :func:`solvers.simulate.simulate`'s
    default)."""
    recompute_s = recompute_s or [0.0] * len(fwd_s)
    total = [b + r for b, r in zip(bwd_s, recompute_s)]
    sim = simulate(fwd_s, total, micro_batches, schedule, workers=workers, weight_share=weight_shares(bwd_s, total),
                   cores=sharing.cores if sharing else None,
                   parallel_efficiency=sharing.parallel_efficiency if sharing else 1.0,
                   stage_efficiency=sharing.stage_efficiency if sharing else None,
                   slots=sharing.slots if sharing else None)
    return sim.iteration_s, stage_medians(sim.timeline, len(fwd_s))


def step_report(plan: Plan, last_step: dict[str, Any], sharing: CpuSharing | None = None) -> tuple[str, dict[str, Any]]:
    """The report's text and its numbers (JSON-able) for ``last_step`` of a pipeline built from ``plan``
    (``sharing``: how its CPU workers share the cores, None for devices of their own)."""
    timings, wall = last_step["timings"], last_step["wall_s"]
    schedule, m, workers = last_step["schedule"], last_step["micro_batches"], last_step["workers"]
    head = ["stage", "fwd ms pred", "meas", "err", "bwd ms pred", "meas", "err", "busy ms", "idle"]
    rows, stages, errors = [], [], []
    alone_fwd, alone_bwd, recomputed = [], [], []
    for st in plan.stages:
        recompute = statistics.mean(1.0 if t.checkpointed else 0.0 for t in timings
                                    if t.stage == st.index and t.kind in BACKWARDS)
        alone_fwd.append(st.fwd_s)
        alone_bwd.append(st.bwd_s)
        recomputed.append(recompute * st.fwd_s)
    pred_iter, pred_ops = predicted_times(alone_fwd, alone_bwd, m, schedule, workers, sharing, recomputed)
    for st in plan.stages:
        fwd, bwd = per_micro_batch([(t.kind, t.micro_batch, t.end_s - t.start_s) for t in timings
                                    if t.stage == st.index])
        pred_f, pred_b = pred_ops[st.index]
        meas_f, meas_b = statistics.median(fwd), statistics.median(bwd)
        err_f, err_b = _error(meas_f, pred_f), _error(meas_b, pred_b)
        errors += [abs(err_f), abs(err_b)]
        busy = sum(fwd) + sum(bwd)
        rows.append([str(st.index), f"{pred_f * 1e3:.2f}", f"{meas_f * 1e3:.2f}", f"{err_f:+.0%}",
                     f"{pred_b * 1e3:.2f}", f"{meas_b * 1e3:.2f}", f"{err_b:+.0%}", f"{busy * 1e3:.1f}",
                     f"{1 - busy / wall:.0%}"])
        stages.append({"stage": st.index, "fwd_s": [pred_f, meas_f], "bwd_s": [pred_b, meas_b],
                       "busy_s": busy, "idle_share": 1 - busy / wall})
    shared = (f"; {workers} workers sharing {sharing.cores:g} cores at {sharing.parallel_efficiency:.0%} "
              f"parallel efficiency" if sharing else "")
    out = [f"last step: {schedule}, {m} micro-batches, {wall * 1e3:.1f} ms measured, {pred_iter * 1e3:.1f} ms "
           f"predicted ({_error(wall, pred_iter):+.0%}{shared})"]
    out += aligned_table(head, rows)
    out.append(f"stage-time error: median {statistics.median(errors):.0%}, worst {max(errors):.0%} "
               f"(profile: {plan.profile.get('mode', '?')})")
    doc: dict[str, Any] = {"schedule": schedule, "micro_batches": m, "iteration_s": [pred_iter, wall],
                           "cpu_sharing": [sharing.cores, sharing.parallel_efficiency] if sharing else None,
                           "stages": stages, "stage_time_error_median": statistics.median(errors)}
    memory = last_step.get("memory")
    if memory is not None:
        predicted = predict_worker_memory(plan, schedule, micro_batches=m)
        mem_rows, mem_doc = [], []
        for w, (pred, meas) in enumerate(zip(predicted, memory)):
            err = _error(meas, pred.activation_bytes)
            mine = [st.index for st in plan.stages if stage_worker(schedule, st.index, workers) == w]
            mem_rows.append([str(w), ",".join(map(str, mine)), f"{pred.activation_bytes / 2**20:.1f}",
                             f"{meas / 2**20:.1f}", f"{err:+.0%}", f"{pred.param_bytes / 2**20:.1f}"])
            mem_doc.append({"worker": w, "activation_bytes": [pred.activation_bytes, meas],
                            "param_bytes": pred.param_bytes})
        out.append(f"peak memory above parameters ({last_step.get('memory_method', '?')}):")
        out += aligned_table(["worker", "stages", "MiB pred", "meas", "err", "params+grads+opt MiB"], mem_rows)
        doc["memory"] = mem_doc
    return "\n".join(out), doc
