"""Codegen and wrap: a traced graph and a plan become a runnable :class:`~fxpipe.runtime.pipeline.Pipeline`."""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpipe.planning.plan import Plan
from fxpipe.runtime.codegen import move_stage, split_graph
from fxpipe.runtime.guards import ModelGuard
from fxpipe.runtime.host import UNSHARED, Host
from fxpipe.runtime.pipeline import Pipeline

__all__ = ["build_pipeline"]


def build_pipeline(gm: fx.GraphModule, plan: Plan, checkpoint: str, mode_dependent: bool,
                   host: Host = UNSHARED, guard: ModelGuard | None = None) -> Pipeline:
    """One stage module per planned stage, moved to its device, run by a :class:`Pipeline` on ``host``."""
    specs = split_graph(gm, plan.stage_of(), len(plan.stages), copies=True)   # tied weights: a copy per stage
    stage_devices = [torch.device(s.device) for s in plan.stages]
    for spec, dev in zip(specs, stage_devices):
        move_stage(spec, dev)
    return Pipeline(gm, specs, stage_devices, plan, checkpoint=checkpoint, mode_dependent=mode_dependent,
                    host=host, guard=guard)
