"""Codegen and wrap: a traced graph and a plan become a runnable :class:`~fxpipe.runtime.execute.pipeline.Pipeline`."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from fxpipe.planning.plan import Plan
from fxpipe.runtime.execute.codegen import StageSpec, move_stage, split_graph
from fxpipe.runtime.backward.block_recompute import apply_recompute
from fxpipe.runtime.execute.compiled import compile_stages
from fxpipe.runtime.checks.guards import ModelGuard
from fxpipe.runtime.execute.host import UNSHARED, Host
from fxpipe.runtime.execute.pipeline import Pipeline

__all__ = ["build_pipeline"]


def build_pipeline(gm: fx.GraphModule, plan: Plan, checkpoint: str,
                   mode_dependent: bool | Callable[[], bool],
                   host: Host = UNSHARED, guard: ModelGuard | None = None, compiled: dict[str, Any] | None = None,
                   specs: list[StageSpec] | None = None) -> Pipeline:
    """One stage module per planned stage, moved to its device, run by a :class:`Pipeline` on ``host``; with
    ``compiled`` (``torch.compile`` keyword arguments) each stage module is compiled in place
    (:mod:`fxpipe.runtime.execute.compiled`). ``specs``: stages built before for the same cuts and devices, reused
    (compiled stages keep the code they compiled)."""
    stage_devices = [torch.device(s.device) for s in plan.stages]
    if specs is None:
        specs = split_graph(gm, plan.stage_of(), len(plan.stages), copies=True)   # tied weights: a copy per stage
        for spec, dev in zip(specs, stage_devices):
            move_stage(spec, dev)
        if compiled is not None:
            compile_stages([spec.module for spec in specs], compiled)
    pipe = Pipeline(gm, specs, stage_devices, plan, checkpoint=checkpoint, mode_dependent=mode_dependent,
                    host=host, guard=guard, compiled=compiled)
    # per-block recomputation rewrites the stage graphs in place; the compiled ones trace them at their first call
    apply_recompute(gm, [(spec.module, pipe.stage_checkpoint(k)) for k, spec in enumerate(specs)])
    return pipe
