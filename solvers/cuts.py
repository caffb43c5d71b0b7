"""The anchor partitioners' cutters: a list of weights in topological order cut into contiguous parts.

Pure functions of the weights, shared by :mod:`solvers.anchors` (which scores each as a partitioner of
its own) and :mod:`solvers.dp` (which starts from their cuts, so that no anchor ends better than it).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

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
    """DeepSpeed-style DP: per (prefix i, parts j) keep the split with the least max - min.

    Ties go to the latest split point, as a scan that replaces on ``<=`` would. Each row of
    the table depends on the previous one only, so a row is computed for every ``(i, k)`` at once.
    """
    n = len(weights)
    if n <= parts:
        return uniform_cuts(weights, parts)
    prefix = np.array(_prefix_sums(weights))
    inf = math.inf
    block = prefix[:, None] - prefix[None, :]          # block[i, k]: weight of items k..i-1
    lower = np.tril(np.ones((n + 1, n + 1), dtype=bool), -1)   # k < i
    cost, hi, lo = np.full(n + 1, inf), np.full(n + 1, inf), np.full(n + 1, inf)
    cost[0], hi[0] = 0.0, 0.0
    backs = []
    with np.errstate(invalid="ignore"):
        for _ in range(parts):
            ok = lower & np.isfinite(cost)[None, :]
            h = np.maximum(hi[None, :], block)
            lw = np.minimum(lo[None, :], block)
            val = np.where(ok, h - lw, inf)
            best = val.min(axis=1)
            # last k reaching the minimum (ties to the latest split, as DeepSpeed's scan)
            hit = (val == best[:, None]) & ok
            k = n - np.argmax(hit[:, ::-1], axis=1)
            found = hit.any(axis=1)
            rows = np.arange(n + 1)
            kk = np.where(found, k, 0)
            cost = np.where(found, best, inf)
            hi = np.where(found, h[rows, kk], inf)
            lo = np.where(found, lw[rows, kk], inf)
            backs.append(kk)
    return _backtrack(lambda i, j: int(backs[j - 1][i]), n, parts)


def minmax_cuts(weights: list[float], parts: int, offsets: list[float] | None = None) -> list[int]:
    """Contiguous parts with the smallest maximum part weight (exact); ties to the earliest split.

    ``offsets[j]`` is added to part ``j``'s weight (a cost the part pays whatever it holds).
    Row ``j`` of the table depends on row ``j - 1`` only: each is computed for every ``(i, k)`` at once.
    """
    n = len(weights)
    prefix = np.array(_prefix_sums(weights))
    inf = math.inf
    block = prefix[:, None] - prefix[None, :]
    lower = np.tril(np.ones((n + 1, n + 1), dtype=bool), -1)
    best = np.full(n + 1, inf)
    best[0] = 0.0
    backs = []
    for j in range(1, parts + 1):
        extra = offsets[j - 1] if offsets is not None else 0.0
        val = np.where(lower, np.maximum(best[None, :], block + extra), inf)
        k = np.argmin(val, axis=1)            # first minimum: ties to the earliest split
        row = val[np.arange(n + 1), k]
        valid = np.zeros(n + 1, dtype=bool)
        valid[j:n - (parts - j) + 1] = True   # part j ends where the remaining parts still fit
        best = np.where(valid, row, inf)
        backs.append(k)
    return _backtrack(lambda i, j: int(backs[j - 1][i]), n, parts)


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

