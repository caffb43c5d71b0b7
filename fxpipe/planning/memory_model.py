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
:mod:`fxpipe.runtime.execute.memory_probe` measures the activation part, so the two can be
compared term for term (``benchmarks/memory.py``, ``benchmarks/fidelity.py``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from fxpipe.planning.plan_view import PlanView, StageView
from solvers.activation_memory import StageBytes, worker_peak_bytes
from solvers.schedules import Op, get_schedule, splits_backward, stage_worker, worker_orders

__all__ = ["WorkerPrediction", "predict_worker_memory", "checkpointed", "stage_bytes", "choose_checkpoints",
           "worker_memory", "check_fits", "block_mode", "refuse_with_schedule", "is_checkpoint_mode", "recompute_s",
           "STAGE_MODES", "CHECKPOINT_SPELLINGS", "planned_mode"]

STAGE_MODES = ("always", "except_last", "never")   # whole stages, per micro-batch (torchgpipe's modes)
# every mode choose_checkpoints considers; per block ones only for stages that hold blocks
CANDIDATES = ("never", "selective", "blocks:2", "blocks", "except_last", "always")
CHECKPOINT_SPELLINGS = "'never', 'except_last', 'always', 'blocks', 'blocks:K' (every K-th block) or 'selective'"
_BLOCKS = re.compile(r"^blocks(?::([1-9][0-9]*))?$")


def block_mode(mode: str | None) -> tuple[int, bool] | None:
    """``(every, selective)`` of a per-block recomputation mode (:mod:`fxpipe.runtime.backward.block_recompute`):
    ``"blocks"`` (1, False), ``"blocks:K"`` (K, False), ``"selective"`` (1, True); ``None`` for any other."""
    if mode == "selective":
        return 1, True
    hit = _BLOCKS.match(mode or "")
    return (int(hit.group(1) or 1), False) if hit else None


def refuse_with_schedule(mode: str, schedule: str) -> None:
    """Raise ``ValueError`` where ``mode`` cannot run under ``schedule``: a per-block mode (``"blocks"``,
    ``"blocks:K"``, ``"selective"``) under a split backward.

    torch's activation checkpointing recomputes a region once per backward call and keeps what that call did not
    read until the graph is freed; a split backward is two calls (input gradients, then weight gradients), so each
    block was recomputed twice and the first recomputation's weight-side tensors were held until the weight pass:
    measured on a 4-block Llama under ZB-H1, 2.15 MB on the second worker against 0.27 MB planned and 0.94 MB
    without any recomputation. Selective checkpointing allows one backward through a region at all. A whole
    stage (``"always"``, ``"except_last"``) is recomputed by hand once, before the input pass
    (:mod:`fxpipe.runtime.backward.split_backward`), and runs as planned."""
    if block_mode(mode) is not None and splits_backward(schedule):
        why = ("torch's selective checkpointing allows one backward through a region" if mode == "selective" else
               "torch's checkpointing recomputes each block in both passes and holds the first recomputation until "
               "the weight pass, more memory than no recomputation at all")
        raise ValueError(f"checkpoint={mode!r} cannot run under {schedule}: its split backward goes through each "
                         f"block twice (input gradients, then weight gradients) and {why}; use checkpoint='always' "
                         "or 'except_last' (whole stages, recomputed once before the input pass), or a schedule "
                         "without a split backward ('1f1b', 'interleaved-1f1b') for per-block recomputation")


def is_checkpoint_mode(mode: str) -> bool:
    """Whether ``mode`` is one the runtime runs (``"auto"`` is a planning choice, not one of them)."""
    return mode in STAGE_MODES or block_mode(mode) is not None


def planned_mode(plan: PlanView) -> str:
    """The recomputation a plan was made with, as it runs (``fxpipe.compile(plan=...)`` and the ranks by default):
    ``"auto"`` where each stage records its chosen mode, the plan's own mode where it is one the runtime runs, else
    torchgpipe's ``"except_last"`` (a plan saved before stages recorded their modes)."""
    if plan.checkpoint == "auto" and all(st.checkpoint for st in plan.stages):
        return "auto"
    return plan.checkpoint if is_checkpoint_mode(plan.checkpoint) else "except_last"


def _chosen_blocks(st: StageView, mode: str) -> list[dict[str, float]]:
    """The stage's block figures (``st.blocks``) that ``mode`` recomputes."""
    parsed = block_mode(mode)
    if parsed is None:
        return []
    every = parsed[0]
    return [b for b in (getattr(st, "blocks", None) or []) if int(b["position"]) % every == 0]


def recompute_s(st: StageView, mode: str, micro_batches: int) -> float:
    """Seconds of forward that ``mode`` recomputes per micro-batch of stage ``st``, on average: the whole stage
    for the checkpointed share of micro-batches, the chosen blocks (less what ``"selective"`` keeps) for the
    block modes (refused under a split backward, :func:`refuse_with_schedule`: once)."""
    parsed = block_mode(mode)
    if parsed is None:
        return st.fwd_s * sum(checkpointed(mode, i, micro_batches) for i in range(micro_batches)) / micro_batches
    selective = parsed[1]
    return sum(b["fwd_s"] - (b["kept_fwd_s"] if selective else 0.0) for b in _chosen_blocks(st, mode))


def checkpointed(mode: str, micro_batch: int, micro_batches: int) -> bool:
    """Whether ``micro_batch`` runs under activation checkpointing in ``mode`` (torchgpipe's modes)."""
    return mode == "always" or (mode == "except_last" and micro_batch != micro_batches - 1)


def stage_bytes(st: StageView, mode: str = "") -> StageBytes:
    """The memory model's sizes of one plan stage: measured when the plan has them
    (:mod:`fxpipe.refine.stage_memory`), else estimated from the profile's node sizes. Under a block mode
    (``mode``), estimated: a micro-batch keeps each recomputed block's inputs (and, ``"selective"``, the
    outputs of its matrix products and attention) in place of its saved activations, and a backward rebuilds
    one block at a time; for a stage measured without it, that estimate scaled by the measured over the estimated
    bytes of the stage without recomputation (one scale for every mode of a stage)."""
    chosen = _chosen_blocks(st, mode)
    if not st.measured_bytes:
        return _estimate(st, mode, chosen)
    measured = StageBytes(**st.measured_bytes)
    if not chosen:
        return measured
    base = _estimate(st, "", [])
    scale = measured.full / base.full if base.full > 0 else 1.0
    sized = dataclasses.asdict(_estimate(st, mode, chosen))
    return StageBytes(**{k: None if v is None else v * scale for k, v in sized.items()})


def _estimate(st: StageView, mode: str, chosen: list[dict[str, float]]) -> StageBytes:
    """:func:`stage_bytes` estimated from the profile's node sizes, the blocks ``chosen`` recomputed per block."""
    selective = bool(block_mode(mode) and block_mode(mode)[1])
    act = st.act_bytes
    largest = 0.0
    if chosen:
        kept = sum(b["kept_bytes"] for b in chosen) if selective else 0.0
        act = max(0.0, act - sum(b["act_bytes"] for b in chosen)) + kept + sum(b["input_bytes"] for b in chosen)
        largest = max(b["act_bytes"] - (b["kept_bytes"] if selective else 0.0) for b in chosen)
    boundary = st.input_bytes + st.output_bytes
    sizes = StageBytes.estimate(
        full=act + boundary - st.overlap_bytes, checkpointed=boundary, recompute=st.act_bytes,
        workspace=st.workspace_bytes, loss=st.loss_bytes,
        # a split backward keeps the saved activations and received inputs (the graph holds them) and,
        # where there are inputs to differentiate, the gradients at the weight frontier (about as large)
        weight_pending=act + st.input_bytes + (act if st.input_bytes > 0 else 0.0),
    )
    if not chosen:
        return sizes
    rebuilt = st.workspace_bytes + max(st.loss_bytes, largest)   # one block's recomputation during a backward
    return dataclasses.replace(sizes, backward_peak=rebuilt, backward_peak_split=rebuilt)


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
    workers = get_schedule(schedule).workers(p, plan.workers)
    factor = 1.0 + float((plan.problem or {}).get("optimizer_state_factor", 0.0))
    sizes = [stage_bytes(st, mode(st.index)) for st in plan.stages]
    out = []
    for w, order in enumerate(orders or worker_orders(schedule, p, m, workers)):
        act = worker_peak_bytes(order, lambda s: sizes[s], lambda s, i: checkpointed(mode(s), i, m))
        params = sum(st.param_bytes * (factor + (weight_versions[st.index] if weight_versions else 0))
                     for st in plan.stages if stage_worker(schedule, st.index, workers) == w)
        out.append(WorkerPrediction(w, params, act))
    return out


def choose_checkpoints(plan: PlanView, memory_bytes: list[float] | None = None) -> list[str]:
    """Give every worker of ``plan`` the checkpoint mode that recomputes least (:func:`recompute_s`) among those
    whose predicted peak fits its ``memory_bytes`` (default: the memory the plan gives its stages): the whole-stage
    modes, and for stages holding repeated blocks the per-block ones; set it on the worker's stages and return
    the modes per worker.

    Raises ``MemoryError`` naming the worker, its least need and its memory when no mode fits.
    """
    workers = get_schedule(plan.schedule).workers(len(plan.stages), plan.workers)
    memory_bytes = memory_bytes if memory_bytes is not None else worker_memory(plan)
    has_blocks = any(getattr(st, "blocks", None) for st in plan.stages)
    split = get_schedule(plan.schedule).split_backward
    modes = [mode for mode in CANDIDATES if (has_blocks or block_mode(mode) is None)
             and not (split and block_mode(mode) is not None)]   # (refuse_with_schedule)
    predictions = {mode: predict_worker_memory(plan, checkpoint=mode) for mode in modes}
    chosen = []
    for w in range(workers):
        mine = [st for st in plan.stages if stage_worker(plan.schedule, st.index, workers) == w]
        cost = {mode: (sum(recompute_s(st, mode, plan.chunks) for st in mine), i)
                for i, mode in enumerate(modes)}
        fits = [mode for mode in modes if predictions[mode][w].peak_bytes <= memory_bytes[w]]
        if not fits:
            least = min(modes, key=lambda mode: predictions[mode][w].peak_bytes)
            need = predictions[least][w].peak_bytes
            raise MemoryError(f"worker {w} needs {need / 2**30:.2f} GiB even with checkpoint={least!r} and has "
                              f"{memory_bytes[w] / 2**30:.2f} GiB; add devices or use more micro-batches")
        mode = min(fits, key=cost.__getitem__)
        chosen.append(mode)
        for st in mine:
            st.checkpoint = mode
    return chosen


def worker_memory(plan: PlanView) -> list[float]:
    """The memory the plan gives each worker: the sum over its stages (an interleaved worker's share each)."""
    workers = get_schedule(plan.schedule).workers(len(plan.stages), plan.workers)
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
