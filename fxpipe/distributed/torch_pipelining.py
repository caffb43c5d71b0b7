"""``plan.to_torch_pipelining(model, loss_fn)``: a plan's stages as torch.distributed.pipelining's own objects.

This rank's stages become ``torch.distributed.pipelining.PipelineStage`` s, built from fxpipe's stage
``GraphModule`` s (:func:`fxpipe.runtime.execute.codegen.split_graph`), and the plan's schedule one of torch's:
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, or, with ``schedule="fxpipe"``, fxpipe's own
per-worker order (:func:`solvers.schedules.worker_orders`, ZB-H1 included) written as torch's compute-action CSV
and loaded into ``_PipelineScheduleRuntime``. torch then runs it; fxpipe only translated.

torch.distributed.pipelining passes a stage's outputs to the next stage only, as positional arguments. A plan
fits when every value crossing a boundary goes from stage ``k`` to stage ``k + 1``, only stage 0 reads the
model's inputs and only the last stage produces the model's output. A plan with a value that skips a stage (a
skip connection from the first stage to the last, a later stage reading a model input) is refused with
:class:`NotAdjacentError` before any communication: fxpipe's own runtime
(:class:`fxpipe.distributed.PipelineRank`, or ``fxpipe.compile`` in one process) runs it.
"""

from __future__ import annotations

import csv
import io
import os
import tempfile
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import fx, nn

from fxpipe.distributed.placement import world_mismatch
from fxpipe.errors import FxpipeError, PlanMismatchError
from fxpipe.frontend.capture import capture_as_planned
from fxpipe.planning import plan as plan_module
from fxpipe.planning.plan import Plan
from fxpipe.runtime.execute.codegen import StageSpec, move_stage, split_graph
from solvers.schedules import REGISTRY, stage_worker, worker_orders

__all__ = ["NotAdjacentError", "TORCH_SCHEDULES", "adjacent_stages", "compute_actions_csv", "to_torch_pipelining"]

TORCH_SCHEDULES = tuple(n for n, s in REGISTRY.items() if s.torch_class) + ("fxpipe",)   # "fxpipe": its own order


class NotAdjacentError(FxpipeError, ValueError):
    """The plan sends a value past the next stage: torch.distributed.pipelining cannot express it."""


class _Positional(nn.Module):
    """A stage as torch.distributed.pipelining calls it: the previous stage's outputs (or the model's inputs on
    stage 0) as positional arguments, reordered to the stage's own inputs; it returns exactly what the next stage
    reads, in that stage's order, or on the last stage the model's output."""

    def __init__(self, stage: fx.GraphModule, inputs: list[str], received: list[str], outputs: list[str],
                 sends: list[str] | None, result: Any) -> None:
        super().__init__()
        self.stage = stage
        self.order = [received.index(name) for name in inputs]
        self.outputs, self.sends, self.result = outputs, sends, result

    def forward(self, *args: Any) -> Any:
        values = dict(zip(self.outputs, self.stage(*[args[i] for i in self.order])))
        if self.sends is not None:
            picked = tuple(values[name] for name in self.sends)
            return picked[0] if len(picked) == 1 else picked
        return fx.node.map_aggregate(self.result, lambda a: values[a] if isinstance(a, str) else a)


def _model_output(graph: fx.GraphModule) -> tuple[Any, set[str]]:
    """The model output's structure with each graph value as its node name, and those names."""
    out = next(n for n in graph.graph.nodes if n.op == "output")
    names: set[str] = set()

    def name(a: fx.Node) -> str:
        names.add(a.name)
        return a.name
    return fx.node.map_arg(out.args[0], name), names


def adjacent_stages(specs: list[StageSpec], graph: fx.GraphModule) -> list[str]:
    """Why torch.distributed.pipelining cannot run these stages (one line per value), or ``[]`` when it can."""
    placeholders = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
    _, produced = _model_output(graph)
    last = len(specs) - 1
    problems = []
    for spec in specs:
        k = spec.index
        for name in spec.inputs:
            if name in placeholders and k > 0:
                problems.append(f"stage {k} reads the model input {name!r} (torch passes inputs to stage 0 only)")
            elif name not in placeholders and (k == 0 or name not in specs[k - 1].outputs):
                src = next(s.index for s in specs if name in s.outputs)
                problems.append(f"{name!r} goes from stage {src} to stage {k}")
        for name in spec.outputs:
            if k < last and name in produced:
                problems.append(f"the model output {name!r} comes from stage {k}, not the last stage {last}")
            elif k < last and name not in specs[k + 1].inputs:
                readers = [s.index for s in specs if name in s.inputs]
                problems.append(f"{name!r} goes from stage {k} to stage(s) {readers}")
    return problems


def compute_actions_csv(plan: Plan, schedule: str | None = None) -> str:
    """fxpipe's per-worker order of ``schedule`` (default the plan's) as torch's compute-only action CSV: one
    row per rank, ``<stage><F|B|I|W><micro-batch>`` per cell (fxpipe's operation kinds are torch's)."""
    schedule = schedule or plan.schedule
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for order in worker_orders(schedule, len(plan.stages), plan.chunks, plan.workers):
        writer.writerow([f"{s}{kind}{i}" for kind, s, i in order])
    return buf.getvalue()


def _schedule(stages: list[Any], plan: Plan, schedule: str, loss_fn: Callable | None, **kwargs: Any) -> Any:
    from torch.distributed.pipelining import schedules as tds
    m = plan.chunks
    record = REGISTRY.get(schedule)
    if record is not None and record.torch_class is not None:   # torch's own class (one stage a rank, or looped)
        kind = getattr(tds, record.torch_class)
        return kind(stages if record.multi_stage else stages[0], n_microbatches=m, loss_fn=loss_fn, **kwargs)
    # fxpipe's order: torch's runtime schedule reads it from a CSV file (its only entry point for an order)
    runner = tds._PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=loss_fn, **kwargs)
    with tempfile.TemporaryDirectory(prefix="fxpipe-tdp-") as where:
        path = os.path.join(where, "order.csv")
        with open(path, "w") as f:
            f.write(compute_actions_csv(plan))
        runner._load_csv(path)
    return runner


def to_torch_pipelining(plan: Plan, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *,
                        schedule: str | None = None, group: Any = None, device: str | torch.device | None = None,
                        leaf_modules: Iterable[type | str] = (), **schedule_kwargs: Any) -> tuple[list[Any], Any]:
    """This rank's ``PipelineStage`` s (one; ``v`` with interleaved 1F1B) and a torch schedule running them.

    ``model`` is the model the plan was made for (the same on every rank: its parameters are used in place; only
    this rank's stages' are touched). ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (torch's
    classes) or ``"fxpipe"`` (the plan's own order as an action CSV); default the plan's schedule, or
    ``"fxpipe"`` for one torch has no class for (ZB-H1). ``group`` is the pipeline's process group, rank ``r``
    running worker ``r``; ``device`` overrides the plan's device for this rank's stages. Other keywords go to
    the schedule (``scale_grads``, ``args_chunk_spec``...). Raises :class:`NotAdjacentError` for a plan with a
    value that skips a stage, before any communication.
    """
    schedule = schedule or (plan.schedule if plan.schedule in TORCH_SCHEDULES else "fxpipe")
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(TORCH_SCHEDULES)}, got {schedule!r}")
    captured = capture_as_planned(model, plan.frontend, leaf_modules)
    if captured.fingerprint != plan.fingerprint:
        raise PlanMismatchError(captured.dtype_mismatch(plan.profile.get("dtype")) or
            f"the plan was made for another model ({plan.model}, fingerprint {plan.fingerprint[:12]}) but this "
            f"model traces to {captured.fingerprint[:12]}: plan this model (fxpipe.compile or fxpipe.plan) first")
    p = len(plan.stages)
    specs = split_graph(captured.graph, plan.stage_of(), p)
    problems = adjacent_stages(specs, captured.graph)
    if problems:
        raise NotAdjacentError(
            "torch.distributed.pipelining passes each stage's outputs to the next stage only, but in this plan "
            + "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
            + ". Run this plan with fxpipe's own runtime (fxpipe.distributed.PipelineRank, or fxpipe.compile in "
            "one process), which sends every value straight to the stage that reads it")
    if not dist.is_available() or not dist.is_initialized():
        raise FxpipeError("to_torch_pipelining needs torch.distributed initialised (torchrun, then "
                          "torch.distributed.init_process_group) with one process per worker of the plan")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mismatch = world_mismatch(plan, world)
    if mismatch is not None:
        raise mismatch
    from torch.distributed.pipelining import PipelineStage
    placeholders = [n.name for n in captured.graph.graph.nodes if n.op == "placeholder"]
    result, _ = _model_output(captured.graph)
    stages = []
    for k in range(p):
        if stage_worker(plan.schedule, k, plan.workers) != rank:
            continue
        where = torch.device(device if device is not None else plan.stages[k].device)
        move_stage(specs[k], where)
        spec = specs[k]
        # stage k - 1 sends exactly stage k's inputs, in their order (its ``sends``); stage 0 gets the model's
        module = _Positional(spec.module, spec.inputs, placeholders if k == 0 else spec.inputs, spec.outputs,
                             specs[k + 1].inputs if k < p - 1 else None, result)
        stages.append(PipelineStage(module, k, p, where, group=group))
    return stages, _schedule(stages, plan, schedule, loss_fn, **schedule_kwargs)


plan_module.EXPORTERS["torch_pipelining"] = to_torch_pipelining
