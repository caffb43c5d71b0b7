"""A lower bound on what the rest of a plan adds, joint in the sum and the max, over the lattice of ideals.

The counterpart of :mod:`solvers.dp.completion` for :mod:`solvers.dp.ideals`. For a grid ``M_0 < ... <
M_{G-1}`` of caps on the rest's slowest stage (and ``M_G = inf``), ``C_g[s][J]`` is the least sum that ``s``
stages covering ``V \\ J`` add when every stage's time is at most ``M_g``: a stage ``K \\ J'`` adds its work
at the fastest speed and, twice, what it receives over the problem's cheapest links (receiver and sender
both pay); its own time is at least its work, what it receives and what it must still send. A
completion whose slowest stage lies in ``(M_{g-1}, M_g]`` adds at least ``C_g[s][J]`` and makes the
maximum exceed ``M_{g-1}``, so a label with sum ``S`` and slowest stage ``x`` ends at least at
``S + min_g (C_g[s][J] + (m - 1) max(x, M_{g-1}))``. Each row is a min-plus step over the lattice's
transitions, vectorised with numpy (``minimum.reduceat`` over transitions grouped by their lower ideal).
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from solvers.dp.lattice import Lattice

__all__ = ["GRID", "IdealCompletion"]

GRID = 16
"""Caps on the rest's slowest stage the bound is taken at."""


class IdealCompletion:
    """``bound(s, j, x)``: the least the ``s`` stages after ideal ``j`` add to ``sum t + (m - 1) max t``,
    for a label whose slowest stage is already ``x``."""

    def __init__(self, lattice: Lattice, p: int, micro_batches: int, max_speed: float, least: float, cap: float,
                 deadline: float = math.inf) -> None:
        src, dst, work, recv_lb, alive_lb = lattice.transitions(cap * max_speed, deadline)
        n_ideals = len(lattice.ideals)
        self.weight = micro_batches - 1
        self.caps = [least + (cap - least) * (g + 1) / GRID for g in range(GRID)] if cap > least else [cap]
        compute = work / max_speed
        cost = compute + 2.0 * recv_lb
        stage_lb = compute + recv_lb + alive_lb
        rows = len(self.caps) + 1   # the last row: no cap
        costs = np.empty((rows, len(src)))
        for g, limit in enumerate(self.caps):
            costs[g] = np.where(stage_lb <= limit, cost, math.inf)
        costs[-1] = cost
        table = np.full((p, rows, n_ideals), math.inf)
        table[0, :, n_ideals - 1] = 0.0   # the whole graph: nothing left to add
        if len(src):
            heads, starts = np.unique(src, return_index=True)
            for s in range(1, p):
                reached = costs + table[s - 1][:, dst]
                table[s][:, heads] = np.minimum.reduceat(reached, starts, axis=1)
        self.table = table
        self._rows: dict[tuple[int, int], tuple[list[float], list[float]]] = {}

    def bound(self, s: int, j: int, x: float) -> float:
        rows = self._rows.get((s, j))
        if rows is None:
            sums = [float(v) for v in self.table[s][:, j]]
            # tail[g]: the least over buckets g' >= g whose floor M_{g'-1} lies above x: sum + weight * floor
            tail = [math.inf] * (len(sums) + 1)
            for g in range(len(sums) - 1, 0, -1):
                tail[g] = min(tail[g + 1], sums[g] + self.weight * self.caps[g - 1])
            rows = self._rows[(s, j)] = (sums, tail)
        sums, tail = rows
        g = bisect.bisect_right(self.caps, x)   # the buckets 0..g have floors at or below x
        return min(sums[g] + self.weight * x, tail[g + 1])
