"""A lower bound over the whole reference space from the problem's heaviest chain of nodes.

Deleting nodes relaxes the reference problem. Restrict any plan to the nodes that are left: a convex
partition stays convex (a chain of ideals restricts to one), its stages keep their devices (a stage left
empty is dropped), no stage computes or sends more than before (a transfer is sent once per receiving
stage, at the largest of fewer edges), and none holds more memory (under GPipe, 1F1B and ZB-H1 a
dropped stage only lowers the in-flight counts of the others; ZB-V, whose count is read off its
order, gets no bound here). So every plan's ``sum t_s`` is at least its restriction's plus
the deleted work at the fastest speed, and its ``max t_s`` at least its restriction's:
``T >= OPT(restricted problem) + deleted work / fastest speed``.

The heaviest path of the DAG (most work), with every edge between its nodes, is a restricted problem whose
only topological order joins consecutive nodes by edges: its contiguous stages are all of its convex
partitions, and the DP (:mod:`solvers.dp`) is exact over its whole reference space, or bounds it when its
time runs out. Where the graph has branches that one order cannot split side by side, this bound is over
convex partitions and placements alike, which the DP's own bound is not; on a transformer whose branches
are a few shape checks it is within their work of the optimum.
"""

from __future__ import annotations

import dataclasses

from solvers.errors import InfeasibleError, SolverError
from solvers.problem import Problem
from solvers.schedules import get_schedule

__all__ = ["heaviest_path", "spine_lower_bound"]


def heaviest_path(problem: Problem) -> list[str]:
    """The path of the DAG with the most work (then the most nodes), in order."""
    nodes = problem.node_map()
    preds: dict[str, list[str]] = {v: [] for v in problem.order}
    for e in problem.edges:
        preds[e.dst].append(e.src)
    best: dict[str, tuple[float, int]] = {}
    back: dict[str, str | None] = {}
    for v in problem.order:   # a topological order
        w = nodes[v].fwd_s + nodes[v].bwd_s
        prior = max(preds[v], key=lambda u: best[u], default=None)
        base = best[prior] if prior is not None else (0.0, 0)
        best[v], back[v] = (base[0] + w, base[1] + 1), prior
    end: str | None = max(problem.order, key=lambda v: best[v])
    path = []
    while end is not None:
        path.append(end)
        end = back[end]
    return path[::-1]


def spine_lower_bound(problem: Problem, time_limit_s: float) -> float:
    """``T`` of every plan of ``problem`` is at least this (0 when the path is the whole problem, which then
    teaches nothing beyond the DP's own bound, when replica groups are allowed, or under ZB-V)."""
    from solvers.dp import solve_dp   # the DP imports the certificate, which this module's callers sit beside

    path = heaviest_path(problem)
    # ZB-V's in-flight count is read off its V-shaped order and may rise when a stage is dropped
    if (len(path) == len(problem.nodes) or problem.max_replicas > 1
            or not get_schedule(problem.schedule).monotone_inflight):
        return 0.0
    kept = set(path)
    nodes = problem.node_map()
    left_work = sum(n.fwd_s + n.bwd_s for n in problem.nodes if n.id not in kept)
    # stages: any count, since a restriction may drop stages that held only deleted nodes
    sub = dataclasses.replace(problem, nodes=[nodes[v] for v in path], order=[],
                              edges=[e for e in problem.edges if e.src in kept and e.dst in kept], stages=None)
    try:
        bound = solve_dp(sub, time_limit_s=time_limit_s).solver["lower_bound_s"]
    except (InfeasibleError, SolverError):   # no plan in the time given (none at all cannot be: a restriction fits)
        return 0.0
    return bound + left_work / max(d.speed for d in problem.devices)
