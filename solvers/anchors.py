"""The partitioners in use elsewhere, reimplemented on fxpipe's costs to be scored beside it.

Each is a faithful reimplementation of the published idea (no code copied);
all cut the same topological order into contiguous stages and place stage
``k`` on device ``k`` (topology-blind), using ``problem.stages`` stages or one
per device. None of them looks at memory; their plans are scored as they are.

* ``uniform``: equal node counts (DeepSpeed ``partition_method="uniform"``).
* ``parameters``: DeepSpeed's ``"parameters"`` method: a DP over prefixes that
  keeps, per (prefix, parts), the split with the smallest max-minus-min spread
  of parameter counts (greedy in its choice of state, as DeepSpeed's is).
* ``block``: torchgpipe's ``balance_by_time``: blocks of compute time with the
  smallest maximum block (the objective of Bárány et al.'s algorithm,
  arXiv:1308.2452, solved exactly here by a min-max DP).
* ``pippy``: PiPPy's ``split_into_equal_size``: walk the nodes, cut when the
  running parameter size reaches total / stages.
* ``blind``: fxpipe's own exact DP with the devices in the order given
  (topology-blind placement): the anchor for topology-aware placement.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from solvers.dp import solve_dp
from solvers.problem import Problem
from solvers.score import score_assignment
from solvers.solution import Solution, Stage, assignment_from_cuts

__all__ = ["ANCHORS", "anchor_solution", "uniform_cuts", "spread_cuts", "minmax_cuts", "equal_size_cuts"]


def _parts(problem: Problem) -> int:
    return problem.stages or min(len(problem.devices), len(problem.nodes))


def uniform_cuts(weights: list[float], parts: int) -> list[int]:
    """Cut positions giving each part ``len // parts`` or one more item."""
    n = len(weights)
    base, extra = divmod(n, parts)
    cuts, pos = [], 0
    for k in range(parts - 1):
        pos += base + (1 if k < extra else 0)
        cuts.append(pos)
    return cuts


def _prefix_sums(weights: list[float]) -> list[float]:
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    return prefix


def _backtrack(back, n: int, parts: int) -> list[int]:
    """Cut positions from ``back(i, j)``: where the part ``j`` that ends at ``i`` starts."""
    cuts, i = [], n
    for j in range(parts, 1, -1):
        i = back(i, j)
        cuts.append(i)
    return sorted(cuts)


def spread_cuts(weights: list[float], parts: int) -> list[int]:
    """DeepSpeed-style DP: per (prefix i, parts j) keep the split with the least max - min."""
    n = len(weights)
    if n <= parts:
        return uniform_cuts(weights, parts)
    prefix = _prefix_sums(weights)
    inf = math.inf
    cost = [[inf] * (parts + 1) for _ in range(n + 1)]
    hi = [[inf] * (parts + 1) for _ in range(n + 1)]
    lo = [[inf] * (parts + 1) for _ in range(n + 1)]
    back = [[0] * (parts + 1) for _ in range(n + 1)]
    cost[0][0], hi[0][0] = 0.0, 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(j - 1, i):
                if cost[k][j - 1] == inf:
                    continue
                block = prefix[i] - prefix[k]
                h, lw = max(hi[k][j - 1], block), min(lo[k][j - 1], block)
                if h - lw <= cost[i][j]:
                    cost[i][j], hi[i][j], lo[i][j], back[i][j] = h - lw, h, lw, k
    return _backtrack(lambda i, j: back[i][j], n, parts)


def minmax_cuts(weights: list[float], parts: int) -> list[int]:
    """Contiguous parts with the smallest maximum part weight (exact)."""
    n = len(weights)
    prefix = _prefix_sums(weights)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for j in range(1, parts + 1):
        for i in range(j, n - (parts - j) + 1):
            for k in range(j - 1, i):
                v = max(best[j - 1][k], prefix[i] - prefix[k])
                if v < best[j][i]:
                    best[j][i], back[j][i] = v, k
    return _backtrack(lambda i, j: back[j][i], n, parts)


def equal_size_cuts(weights: list[float], parts: int) -> list[int]:
    """PiPPy's greedy fill: cut after the node where the running size reaches total / parts."""
    threshold = sum(weights) / parts
    cuts, acc = [], 0.0
    n = len(weights)
    for i, w in enumerate(weights):
        acc += w
        if acc >= threshold and len(cuts) < parts - 1 and i + 1 < n:
            cuts.append(i + 1)
            acc = 0.0
    # Fewer cuts than parts - 1 (weight concentrated at the end): put the missing cuts at the
    # first free positions after the last one, so that every stage gets a node.
    while len(cuts) < parts - 1:
        last = cuts[-1] if cuts else 0
        free = [c for c in range(last + 1, n) if c not in cuts]
        cuts.append(free[0] if free else max(set(range(1, n)) - set(cuts)))
        cuts.sort()
    return cuts


def _solution_from_cuts(problem: Problem, cuts: list[int], method: str, started: float) -> Solution:
    order, p = problem.order, len(cuts) + 1
    stage_of = assignment_from_cuts(order, cuts)
    sc = score_assignment(problem, stage_of, list(range(p)))
    stages = [Stage([v for v in order if stage_of[v] == s], [problem.devices[s].id]) for s in range(p)]
    return Solution(stages, sc.as_predicted(),
                    {"method": method, "optimal": False, "time_s": time.perf_counter() - started})


def _weights(problem: Problem, field: str) -> list[float]:
    nodes = problem.node_map()
    if field == "time":
        return [nodes[v].fwd_s + nodes[v].bwd_s for v in problem.order]
    return [nodes[v].param_bytes for v in problem.order]


def _cut_anchor(name: str, field: str, cutter: Callable[[list[float], int], list[int]]):
    def run(problem: Problem) -> Solution:
        started = time.perf_counter()
        return _solution_from_cuts(problem, cutter(_weights(problem, field), _parts(problem)), name, started)
    return run


BLIND_TIME_LIMIT_S = 10.0
"""The blind anchor's exact search stops here (its plan is then its best so far)."""


def _blind(problem: Problem) -> Solution:
    sol = solve_dp(problem, placement=False, time_limit_s=BLIND_TIME_LIMIT_S)
    sol.solver["method"] = "blind"
    return sol


CUT_ANCHORS: list[tuple[Callable[[list[float], int], list[int]], Callable[[Problem], list[float]]]] = [
    (uniform_cuts, lambda p: _weights(p, "time")), (spread_cuts, lambda p: _weights(p, "params")),
    (minmax_cuts, lambda p: _weights(p, "time")), (equal_size_cuts, lambda p: _weights(p, "params")),
]
"""The anchors' cutters with their weights: the DP's first incumbents (stage k on device k)."""
QUADRATIC_ANCHORS = (spread_cuts, minmax_cuts)
"""Cutters whose dynamic programmes take ``O(nodes^2 x parts)``."""

ANCHORS: dict[str, Callable[[Problem], Solution]] = {
    "uniform": _cut_anchor("uniform", "time", uniform_cuts),
    "parameters": _cut_anchor("parameters", "params", spread_cuts),
    "block": _cut_anchor("block", "time", minmax_cuts),
    "pippy": _cut_anchor("pippy", "params", equal_size_cuts),
    "blind": _blind,
}


def anchor_solution(problem: Problem, name: str) -> Solution:
    """The plan anchor ``name`` makes for ``problem``, with its reference score."""
    if name not in ANCHORS:
        raise ValueError(f"unknown anchor {name!r}; expected one of {', '.join(ANCHORS)}")
    return ANCHORS[name](problem)
