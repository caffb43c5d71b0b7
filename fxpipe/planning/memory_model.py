"""Predicted peak memory per worker: parameters and optimizer state, plus activations walked along the schedule.

Parameters, their gradients and the optimizer's state (the factor the plan
was made with: Adam 2, SGD with momentum 1, SGD 0) stay for the whole step.
Activations follow :func:`solvers.activation_memory.worker_peak_bytes`: each
stage's saved bytes per micro-batch, only its inputs for a checkpointed
micro-batch (and one recomputation at a time during backward), gradients held
until a split backward's weight pass, and each operation's transient buffers on
top. The stage sizes are measured by :mod:`fxpipe.refine.stage_memory` when the plan
was compiled with ``profile="measure"``; otherwise they are estimated from the
profile's node sizes (saved activations, boundary values, twice the largest
node output as workspace, twice the model output for the loss).
:mod:`fxpipe.runtime.memory_probe` measures the activation part, so the two can be
compared term for term (``benchmarks/memory.py``, ``benchmarks/fidelity.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.planning.plan_view import PlanView, StageView
from solvers.activation_memory import StageBytes, worker_peak_bytes
from solvers.schedules import MULTI_STAGE, SPLIT_BACKWARD, Op, stage_worker, worker_orders

__all__ = ["WorkerPrediction", "predict_worker_memory", "checkpointed", "stage_bytes", "choose_checkpoints",
           "worker_memory", "check_fits"]

PREFERENCE = ("never", "except_last", "always")   # cheapest first: each recomputes more forwards


def checkpointed(mode: str, micro_batch: int, micro_batches: int) -> bool:
    """Whether ``micro_batch`` runs under activation checkpointing in ``mode`` (torchgpipe's modes)."""
    return mode == "always" or (mode == "except_last" and micro_batch != micro_batches - 1)


def stage_bytes(st: StageView) -> StageBytes:
    """The memory model's sizes of one plan stage: measured when the plan has them
    (:mod:`fxpipe.refine.stage_memory`), else estimated from the profile's node sizes."""
    if st.measured_bytes:
        return StageBytes(**st.measured_bytes)
    boundary = st.input_bytes + st.output_bytes
    return StageBytes.estimate(
        full=st.act_bytes + boundary - st.overlap_bytes, checkpointed=boundary, recompute=st.act_bytes,
        workspace=st.workspace_bytes, loss=st.loss_bytes,
        # a split backward keeps the saved activations and received inputs (the graph holds them) and,
        # where there are inputs to differentiate, the gradients at the weight frontier (about as large)
        weight_pending=st.act_bytes + st.input_bytes + (st.act_bytes if st.input_bytes > 0 else 0.0),
    )


@dataclass(frozen=True)
class WorkerPrediction:
    worker: int
    param_bytes: float        # parameters, gradients and optimizer state
    activation_bytes: float   # peak of activations, recomputation and workspace over the step

    @property
    def peak_bytes(self) -> float:
        return self.param_bytes + self.activation_bytes


def predict_worker_memory(plan: PlanView, schedule: str | None = None, checkpoint: str | None = None,
                          micro_batches: int | None = None,
                          weight_versions: list[int] | None = None,
                          orders: list[list[Op]] | None = None) -> list[WorkerPrediction]:
    """Predicted peak memory of every worker of ``plan`` for one step.

    ``weight_versions[s]``: weight versions stage ``s`` keeps besides its parameters (asynchronous training's
    stash, :func:`solvers.asynchronous.stashed_versions`); each costs the stage's parameter bytes once more.
    ``orders`` replaces the schedule's per-worker orders (one stage per worker; asynchronous training's).
    """
    schedule = schedule or plan.schedule

    def mode(stage: int) -> str:   # the given mode for all stages, else each stage's own (checkpoint="auto")
        return checkpoint or plan.stages[stage].checkpoint or plan.checkpoint
    m, p = micro_batches or plan.chunks, len(plan.stages)
    workers = plan.workers if schedule in MULTI_STAGE else p
    factor = 1.0 + float((plan.problem or {}).get("optimizer_state_factor", 0.0))
    sizes = [stage_bytes(st) for st in plan.stages]
    out = []
    for w, order in enumerate(orders or worker_orders(schedule, p, m, workers)):
        act = worker_peak_bytes(order, lambda s: sizes[s], lambda s, i: checkpointed(mode(s), i, m),
                                split_backward=schedule in SPLIT_BACKWARD)
        params = sum(st.param_bytes * (factor + (weight_versions[st.index] if weight_versions else 0))
                     for st in plan.stages if stage_worker(schedule, st.index, workers) == w)
        out.append(WorkerPrediction(w, params, act))
    return out


def choose_checkpoints(plan: PlanView, memory_bytes: list[float] | None = None) -> list[str]:
    """Give every worker of ``plan`` the cheapest checkpoint mode whose predicted peak fits its
    ``memory_bytes`` (default: the memory the plan gives its stages); set it on the worker's stages and
    return the modes per worker.

    Raises ``MemoryError`` naming the worker, its need and its memory when even ``"always"`` does not fit.
    """
    workers = plan.workers if plan.schedule in MULTI_STAGE else len(plan.stages)
    memory_bytes = memory_bytes if memory_bytes is not None else worker_memory(plan)
    predictions = {mode: predict_worker_memory(plan, checkpoint=mode) for mode in PREFERENCE}
    chosen = []
    for w in range(workers):
        mode = next((mode for mode in PREFERENCE if predictions[mode][w].peak_bytes <= memory_bytes[w]), None)
        if mode is None:
            need = predictions["always"][w].peak_bytes
            raise MemoryError(f"worker {w} needs {need / 2**30:.2f} GiB even with checkpoint='always' and has "
                              f"{memory_bytes[w] / 2**30:.2f} GiB; add devices or use more micro-batches")
        chosen.append(mode)
        for st in plan.stages:
            if stage_worker(plan.schedule, st.index, workers) == w:
                st.checkpoint = mode
    return chosen


def worker_memory(plan: PlanView) -> list[float]:
    """The memory the plan gives each worker: the sum over its stages (an interleaved worker's share each)."""
    workers = plan.workers if plan.schedule in MULTI_STAGE else len(plan.stages)
    return [sum(st.memory_bytes for st in plan.stages if stage_worker(plan.schedule, st.index, workers) == w)
            for w in range(workers)]


def check_fits(plan: PlanView) -> None:
    """Raise ``MemoryError`` naming the first worker whose predicted peak under the plan's checkpoint mode is
    above the memory the plan gives it."""
    for w, (pred, memory) in enumerate(zip(predict_worker_memory(plan), worker_memory(plan))):
        if pred.peak_bytes > memory:
            raise MemoryError(f"worker {w} is predicted to peak at {_size(pred.peak_bytes)} under "
                              f"checkpoint={plan.checkpoint!r} and has {_size(memory)}")


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
