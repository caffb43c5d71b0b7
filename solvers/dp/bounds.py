"""Lower bounds that prune the search: memory (the smallest feasible peak), placement floors."""

from __future__ import annotations

import math
from dataclasses import replace

from solvers.groups import GroupTable
from solvers.problem import Problem
from solvers.dp.tables import Tables, device_classes, fastest_link, stage_counts
from solvers.dp.deepen import deepening
from solvers.dp.frontier import Timeout
from solvers.dp.space import Space
from solvers.dp.peaks import least_peak

__all__ = ['min_peak_bytes', 'placement_floor']


def min_peak_bytes(problem: Problem) -> float:
    """Smallest over the search space of the largest per-device peak memory of a stage.

    With one device per stage, :func:`solvers.dp.peaks.least_peak` (to a relative 1e-12); with
    ``max_replicas > 1`` a stage may spread its activations over a replica group of consecutive devices,
    so a quadratic programme also tracks devices used.
    """
    if problem.max_replicas == 1:   # one device per stage: bisection on the cap (solvers.dp.peaks)
        return least_peak(problem, problem.order, stage_counts(problem))
    tables = Tables(problem)
    n, factor, d = tables.n, 1.0 + problem.optimizer_state_factor, len(problem.devices)
    reps = range(1, problem.max_replicas + 1)
    best = math.inf
    for p in stage_counts(problem):
        # prev[(j, used)]: min over plans of stages 0..k-1 covering [0, j) on `used` devices of the max peak
        prev = {(0, 0): 0.0}
        for k in range(p):
            cur: dict[tuple[int, int], float] = {}
            inflight = problem.inflight(k, p)
            for (j, used), v0 in prev.items():
                params = acts = 0.0
                for j2 in range(j + 1, n + 1):
                    params += tables.param[j2 - 1]
                    acts += tables.act[j2 - 1]
                    for r in reps:
                        if used + r + (p - k - 1) > d:
                            break
                        v = max(v0, params * factor + acts * inflight / r)
                        if v < cur.get((j2, used + r), math.inf):
                            cur[(j2, used + r)] = v
            prev = cur
        best = min([best] + [v for (j, _), v in prev.items() if j == n])
    return best


def placement_floor(problem: Problem, ub: float, deadline: float) -> dict[int, float]:
    """Lower bounds per stage count for every single-device mapping, from a relaxation.

    Every link is made as fast as the fastest link of the problem, so no
    mapping costs less than the relaxed optimum; with identical devices the
    relaxation is one search over stage ``k`` on device ``k``. A count whose
    relaxed optimum is not below ``ub`` gets ``ub``.
    """
    d = len(problem.devices)
    bw, lat = fastest_link(problem)
    relaxed = replace(problem, order=[], max_replicas=1,
                      bandwidth_Bps=[[0.0 if i == j else bw for j in range(d)] for i in range(d)],
                      latency_s=[[0.0 if i == j else lat for j in range(d)] for i in range(d)])
    tables, table = Tables(relaxed), GroupTable(relaxed)
    space = Space("classes", table, classes=device_classes(relaxed))
    floor: dict[int, float] = {}
    for p in stage_counts(relaxed):
        proven: dict[int, float] = {}
        try:
            label, t = deepening(relaxed, tables, p, ub, space, deadline, proven)
        except Timeout:
            floor[p] = proven.get(p, 0.0)
            break
        floor[p] = t if label is not None else ub
    return floor
