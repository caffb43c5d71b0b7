"""The anchor partitioners' cutters: a list of weights in topological order cut into contiguous parts.

Pure functions of the weights, shared by :mod:`solvers.anchors` (which scores each as a partitioner of
its own) and :mod:`solvers.dp` (which starts from their cuts, so that no anchor ends better than it).
"""

from __future__ import annotations

import math
from typing import Callable

from solvers.problem import Problem

__all__ = ["CUT_ANCHORS", "QUADRATIC_ANCHORS", "equal_size_cuts", "minmax_cuts", "node_weights", "spread_cuts",
           "uniform_cuts"]


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


def node_weights(problem: Problem, field: str) -> list[float]:
    nodes = problem.node_map()
    if field == "time":
        return [nodes[v].fwd_s + nodes[v].bwd_s for v in problem.order]
    return [nodes[v].param_bytes for v in problem.order]


CUT_ANCHORS: list[tuple[Callable[[list[float], int], list[int]], Callable[[Problem], list[float]]]] = [
    (uniform_cuts, lambda p: node_weights(p, "time")), (spread_cuts, lambda p: node_weights(p, "params")),
    (minmax_cuts, lambda p: node_weights(p, "time")), (equal_size_cuts, lambda p: node_weights(p, "params")),
]
"""The anchors' cutters with their weights: the DP's first incumbents (stage k on device k)."""
QUADRATIC_ANCHORS = (spread_cuts, minmax_cuts)
"""Cutters whose dynamic programmes take ``O(nodes^2 x parts)``."""

