"""The experts regions of a costed graph charged as their active experts (:func:`cost_experts`).

A meta trace of a mixture-of-experts layer does not see what the step computes: transformers' experts interface
runs ``grouped_mm`` (a custom operation the FLOP counter counts as nothing), and a layer that loops over its
experts would be traced over every expert, or over none, as the meta tensors route. So the nodes of each experts
region (those whose innermost module, ``nn_module_stack``, is :attr:`fxpipe.frontend.experts.ExpertLayer.path` or
inside it) lose the FLOPs the trace gave them, and the region's last operation is charged the active experts:
``tokens × top_k × 2 × (one expert's parameters)`` FLOPs forward at the device's rate, twice that backward (as
every analytic node). What expert parallelism adds on top (the imbalance factor, the all-to-alls, the experts'
memory over ``ep``) is :mod:`solvers.experts`'s, charged by the mesh costing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx, nn

from fxpipe.cost.devices import DeviceSpec
from fxpipe.cost.profile import NodeCost
from fxpipe.frontend.experts import find_experts
from solvers.experts import Experts

__all__ = ["ExpertRegion", "as_experts", "cost_experts"]


@dataclass(frozen=True)
class ExpertRegion:
    """One experts region of the graph, at the costed micro-batch: its ``nodes`` (the last charged the active
    experts), its parameters' ``param_nodes``, ``tokens`` routed, and the figures of :class:`solvers.experts.Experts`
    before they are per sample."""

    path: str
    num_experts: int
    top_k: int
    hidden: int
    itemsize: int
    tokens: int
    nodes: tuple[str, ...]
    param_nodes: tuple[str, ...]
    flops: int       # the active experts' forward
    fwd_s: float     # its seconds (the backward's: twice)
    param_bytes: int


def as_experts(regions: Sequence[ExpertRegion], samples: float = 1.0) -> Experts:
    """The figures of ``regions`` (costed on micro-batches of ``samples`` samples) per sample, summed, as
    :mod:`solvers.experts` charges them: the mesh search's per piece, the node-level costing's per region."""
    return Experts(tuple(r.num_experts for r in regions), float(sum(r.param_bytes for r in regions)),
                   sum(r.fwd_s for r in regions) / samples, sum(2 * r.fwd_s for r in regions) / samples,
                   sum(r.tokens * r.top_k * r.hidden * r.itemsize for r in regions) / samples)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return last[0] if isinstance(last, tuple) else str(last)


def _tokens(costs: dict[str, NodeCost], names: list[str], hidden: int) -> tuple[int, int]:
    """(tokens, element bytes) of the region, as the costed micro-batch ran it (concrete shapes): the fewest rows of
    its float values shaped ``(..., hidden)``, the region's output (inside, the routed copies are ``top_k`` times as
    many)."""
    found = [(int(math.prod(shape[:-1])), int(itemsize)) for name in names
             for shape, itemsize in costs[name].float_outputs if len(shape) >= 2 and shape[-1] == hidden]
    return min(found) if found else (0, 4)


def cost_experts(model: nn.Module, gm: fx.GraphModule, costs: dict[str, NodeCost], spec: DeviceSpec,
                 dtype: torch.dtype) -> tuple[dict[str, NodeCost], tuple[ExpertRegion, ...]]:
    """``costs`` with each experts region charged as its active experts (module docstring), and the regions;
    a model without experts (or whose regions the trace does not show) comes back as it was, with none."""
    layers = find_experts(model)
    if not layers:
        return costs, ()
    rate = spec.flops.get(str(dtype).removeprefix("torch."), spec.flops["float32"])
    out, regions = dict(costs), []
    for layer in layers:
        inside = [n.name for n in gm.graph.nodes if n.name in costs and n.op != "get_attr"
                  and (p := _module_path(n)) and (p == layer.path or p.startswith(layer.path + "."))]
        params = tuple(n.name for n in gm.graph.nodes if n.op == "get_attr" and n.name in costs
                       and str(n.target).startswith(layer.path + "."))
        if not inside:
            continue
        hidden = int(model.get_submodule(layer.router).weight.shape[1])
        tokens, itemsize = _tokens(costs, inside, hidden)
        top_k = layer.top_k or layer.num_experts   # unsaid: every expert counted
        for name in inside:   # what the trace counted, taken back
            c = out[name]
            if c.flops:
                fwd = max(spec.launch_s, c.fwd_s - c.flops / rate)
                out[name] = dataclasses.replace(c, flops=0, fwd_s=fwd, bwd_s=2 * fwd)
        flops = 2 * tokens * top_k * layer.expert_params
        seconds = flops / rate
        last = out[inside[-1]]
        out[inside[-1]] = dataclasses.replace(last, flops=last.flops + flops, fwd_s=last.fwd_s + seconds,
                                              bwd_s=last.bwd_s + 2 * seconds)
        regions.append(ExpertRegion(layer.path, layer.num_experts, top_k, hidden, itemsize, tokens, tuple(inside),
                                    params, flops, seconds, sum(costs[n].param_bytes for n in params)))
    return out, tuple(regions)
