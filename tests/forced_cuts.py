"""Test helper: compile a model with its stage boundaries where the test says, not where the planner would."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

import fxpipe

__all__ = ["compile_with_cuts"]


def compile_with_cuts(model: nn.Module, inputs: tuple, first_nodes: list[str], **kwargs: Any) -> fxpipe.Pipeline:
    """A pipeline of ``len(first_nodes) + 1`` stages on CPU workers whose stage ``s + 1`` starts at traced node
    ``first_nodes[s]`` (in graph order): a plan is made, its nodes re-assigned, and the model compiled on it."""
    devices = ["cpu"] * (len(first_nodes) + 1)
    planned = fxpipe.compile(model, devices, inputs, stages=len(devices), profile="estimate", **kwargs)
    plan = copy.deepcopy(planned.plan)
    del planned
    order = [n for stage in plan.stages for n in stage.nodes]
    missing = [n for n in first_nodes if n not in order]
    assert not missing, f"no traced nodes {missing}; the graph has {order}"
    bounds = [0] + [order.index(n) for n in first_nodes] + [len(order)]
    assert bounds == sorted(bounds), f"cuts {first_nodes} are not in graph order"
    for stage, start, end in zip(plan.stages, bounds, bounds[1:]):
        stage.nodes = order[start:end]
        stage.checkpoint = ""
    # the inputs again: the torch.export front end traces on them (fx ignores them with a plan)
    return fxpipe.compile(model, devices, inputs, plan=plan, **{k: v for k, v in kwargs.items() if k != "chunks"})
