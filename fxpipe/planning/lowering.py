"""From a profiled fx graph and a device list to a ``solvers.Problem``, and back.

The node order handed to the solver is the graph's order with every
``get_attr`` moved to just before its first user, so that a parameter read by
a node lands in that node's stage rather than wherever tracing met it. A
parameter read in another stage as well (a tied weight) is charged once per
step, not per micro-batch (:mod:`fxpipe.planning.tied_cost`).
"""

from __future__ import annotations

import os
from typing import Mapping

import torch
import torch.fx as fx

import solvers
from fxpipe.cost.profile import NodeCost
from fxpipe.planning.tied_cost import edge_bytes, parameter_reads
from fxpipe.planning.topology import Links

__all__ = ["solver_order", "build_problem", "device_memory_bytes", "problem_device_ids"]


def solver_order(gm: fx.GraphModule) -> list[fx.Node]:
    """Graph order, ``output`` dropped, ``get_attr`` nodes sunk to their first user."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    attrs = {n for n in nodes if n.op == "get_attr" and n.users}
    order: list[fx.Node] = []
    placed: set[fx.Node] = set()
    for n in nodes:
        if n in attrs:
            continue
        for a in n.all_input_nodes:
            if a in attrs and a not in placed:
                order.append(a)
                placed.add(a)
        order.append(n)
        placed.add(n)
    order += [n for n in nodes if n not in placed]  # unused attributes
    return order


def device_memory_bytes(devices: list[torch.device]) -> list[float]:
    """Memory each pipeline device may use: a GPU's total, or host RAM shared by CPU workers."""
    cpu_workers = sum(1 for d in devices if d.type == "cpu")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out = []
    for d in devices:
        if d.type == "cuda":
            out.append(float(torch.cuda.get_device_properties(d).total_memory))
        else:
            out.append(float(host) / max(cpu_workers, 1))
    return out


def problem_device_ids(devices: list[torch.device]) -> list[str]:
    """Unique ids for the solver: ``"0:cpu"``, ``"1:cpu"``, ``"2:cuda:0"``..."""
    return [f"{i}:{d}" for i, d in enumerate(devices)]


def build_problem(
    gm: fx.GraphModule,
    costs: dict[str, NodeCost],
    devices: list[torch.device],
    links: Links,
    micro_batches: int,
    memory_bytes: list[float],
    stages: int | None = None,
    optimizer_state_factor: float = 0.0,
    schedule: str = "gpipe",
    name: str = "model",
    speeds: list[float] | None = None,
    output_bytes: Mapping[str, float] | None = None,
) -> solvers.Problem:
    """The solver's problem; ``output_bytes`` (default: each node's) is what a cut after a node costs
    (:func:`fxpipe.planning.boundaries.charged_bytes` under boundary compression)."""
    order = solver_order(gm)
    in_problem = set(order)
    nodes = [solvers.Node(n.name, costs[n.name].fwd_s, costs[n.name].bwd_s,
                          float(costs[n.name].param_bytes), float(costs[n.name].act_bytes)) for n in order]
    reads = parameter_reads(gm)   # a copy in each stage that reads it: its gradient summed once per step

    def charged(n: fx.Node) -> float:
        if n.name in reads:
            return edge_bytes(reads[n.name][1], micro_batches)
        return float(costs[n.name].output_bytes if output_bytes is None else output_bytes[n.name])
    edges = [solvers.Edge(n.name, u.name, charged(n)) for n in order for u in n.users if u in in_problem]
    ids = problem_device_ids(devices)
    return solvers.Problem(
        nodes=nodes, edges=edges,
        devices=[solvers.Device(i, m, v) for i, m, v in zip(ids, memory_bytes, speeds or [1.0] * len(ids))],
        bandwidth_Bps=links.bandwidth_Bps, latency_s=links.latency_s,
        micro_batches=micro_batches, schedule=schedule, stages=stages,
        optimizer_state_factor=optimizer_state_factor, name=name,
    )
