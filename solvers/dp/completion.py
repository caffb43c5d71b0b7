"""A lower bound on what the rest of a plan adds to ``sum t + (m - 1) max t``, joint in the sum and the max.

The label search's other bounds take the rest's sum and its slowest stage apart: the sum at the cheapest
cuts anywhere after the cut (and only node ``c``'s own inputs paid at a cut ``c``), the slowest stage at the
best balance. No plan has both. The optimum trades them: it cuts where the balance needs, not where tensors
are small, and on a residual chain every cut is crossed by skips besides node ``c``'s inputs. On the
3000-node chain over two 8-GPU boxes the separate bounds lie some 15 ms below every real completion, where a
certificate must close 0.5 ms: 4.4 million labels stayed alive.

The bound is parametric in the rest's slowest stage. For a grid ``M_0 < ... < M_{G-1}`` up to the slowest
stage a plan under the search's bound can have, and ``M_G = inf``, ``C_g[s][j]`` is the least sum of what
``s`` stages covering ``[j, n)`` take (compute at the fastest speed; what crosses each start over the
cheapest link, both ways and both ends) among the partitions whose stages each stay within ``M_g`` and fit
the largest device's memory. A completion whose slowest stage lies in ``(M_{g-1}, M_g]`` adds at least
``C_g[s][j]`` to the sum and makes the maximum exceed ``M_{g-1}``, so a label with sum ``S`` and slowest
stage ``x`` ends at least at ``S + min_g (C_g[s][j] + (m - 1) max(x, M_{g-1}))`` — a proven bound for any
completion, since the last cap is none. Each row of ``C_g`` is a min-plus step over a window of stage ends
(a stage's compute is a difference of prefix sums), taken for every start at once with a sparse table of
range minima.
"""

from __future__ import annotations

import bisect
import math
import weakref

import numpy as np

from solvers.problem import Problem
from solvers.dp.tables import Tables

__all__ = ["Completion", "completion_for"]


GRID = 16
"""Values of the slowest stage the bound is taken at (finer: tighter and slower to build; on the 3000-node
chain 12 values leave 7 % more labels than 96, and cost an eighth as much to build)."""


def _range_min(values: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``min(values[left[i]:right[i] + 1])`` for every ``i`` (``inf`` where ``left > right``): a sparse
    table of minima over power-of-two spans, two lookups per query."""
    n = len(values)
    levels = [values]
    width = 1
    while 2 * width <= n:
        prev = levels[-1]
        levels.append(np.minimum(prev[:-width], prev[width:]))
        width *= 2
    out = np.full(len(left), math.inf)
    ok = right >= left
    if not ok.any():
        return out
    lo, hi = left[ok], right[ok]
    level = np.log2(hi - lo + 1).astype(int)
    res = np.empty(len(lo))
    for k in range(int(level.min()), int(level.max()) + 1):
        sel = level == k
        if sel.any():
            table = levels[k]
            res[sel] = np.minimum(table[lo[sel]], table[hi[sel] - (1 << k) + 1])
    out[ok] = res
    return out


class Completion:
    """``bound(s, j, x)``: the least that ``s`` stages covering ``[j, n)`` add to the objective, given a
    slowest stage so far of ``x`` (``inf`` when no such completion fits in memory)."""

    def __init__(self, problem: Problem, tables: Tables, p: int, speed: float, low: float, high: float) -> None:
        n = tables.n
        self.weight = problem.micro_batches - 1
        # the last value is no cap at all: a completion slower than the grid is still bounded (by the least
        # sum with no cap and a slowest stage above the grid), so every value the bound gives is proven
        grid = [low + (high - low) * g / (GRID - 1) for g in range(GRID)] if high > low else [high]
        grid.append(math.inf)
        self.high = high
        # lo[g]: what the slowest stage must exceed when it is in (M_{g-1}, M_g]
        self.lo = [-math.inf] + grid[:-1]
        pre = np.concatenate([[0.0], np.cumsum(tables.fb)]) / speed
        # Two costs of entering a stage at j: node j's own inputs (what any stage starting there receives),
        # and every tensor crossing the cut (what it receives once it holds ``span`` positions: no edge
        # reaches further). Each is charged four one-way transfers over the cheapest link, half of them to
        # the receiving stage's time, half to the senders'.
        enter = np.array(tables.enter_lb[:n + 1])
        crossing = np.array(tables.crossing_lb[:n + 1])
        crossing[n] = 0.0   # nothing crosses the end (the table's running sum leaves rounding there)
        span = tables.span
        factor = 1.0 + problem.optimizer_state_factor
        pre_param = np.concatenate([[0.0], np.cumsum(tables.param)]) * factor
        pre_act = np.concatenate([[0.0], np.cumsum(tables.act)])
        room = max(d.memory_bytes for d in problem.devices)
        starts = np.arange(n)
        # A stage ending at b sends at least node b's input from b - 1 (it holds b - 1), and once it holds
        # ``span`` positions, everything that crosses b. reach[b] is the least of pre + send over the ends
        # from b on, so the ends whose reach fits a start's budget form a prefix holding every end it can take.
        send_own = np.zeros(n + 1)
        for b in range(1, n):
            send_own[b] = sum(cost for u, cost in tables.sent_to[b] if u == b - 1)
        reach_short = np.minimum.accumulate((pre + send_own)[::-1])[::-1]
        reach_long = np.minimum.accumulate((pre + crossing / 2.0)[::-1])[::-1]
        short_last = np.minimum(starts + span - 1, n)   # the ends that may leave a skip unreceived
        long_first = starts + span
        # mem_end[s - 1]: for the first of the last s stages, the furthest end its memory allows, per start
        mem_end = []
        for s in range(1, p + 1):
            scale = problem.inflight(p - s, p) / problem.max_replicas
            cost = pre_param + pre_act * scale   # memory of [a, b) is cost[b] - cost[a], growing with b
            mem_end.append(np.searchsorted(cost, cost[:n] + room, side="right") - 1)
        # sums[s, j, g]: C_g for s stages from j
        self.sums = np.full((p, n + 1, len(grid)), math.inf)
        self.sums[0, n, :] = 0.0
        for g, m_g in enumerate(grid):
            if m_g == math.inf:
                end_short = end_long = np.full(n, n)
            else:
                end_short = np.searchsorted(reach_short, pre[:n] + (m_g - enter[:n] / 2.0), side="right") - 1
                end_long = np.searchsorted(reach_long, pre[:n] + (m_g - crossing[:n] / 2.0), side="right") - 1
            for s in range(1, p):
                value = pre + self.sums[s - 1, :, g]   # a stage [j, j') adds pre[j'] - pre[j] and what enters at j
                fits = np.minimum(mem_end[s - 1], n)
                short = _range_min(value, starts + 1, np.minimum(np.minimum(end_short, short_last), fits))
                long = _range_min(value, long_first, np.minimum(end_long, fits))
                self.sums[s, :n, g] = np.minimum(short + enter[:n], long + crossing[:n]) - pre[:n]
        # beyond[s, j, g]: the least of C_h + weight * lo_h over h >= g, what a slowest stage below lo_g leaves
        lo = np.array(self.lo[1:] + [math.inf])
        above = self.sums[:, :, 1:] + self.weight * lo[:-1]
        beyond = np.minimum.accumulate(above[:, :, ::-1], axis=2)[:, :, ::-1]
        self.beyond = np.concatenate([beyond, np.full((p, n + 1, 1), math.inf)], axis=2)

    def bound(self, s: int, j: int, x: float) -> float:
        if s == 0:
            return 0.0
        g = bisect.bisect_right(self.lo, x) - 1   # lo[g] <= x < lo[g + 1]
        here = self.sums[s, j, g] + self.weight * x
        later = self.beyond[s, j, g]
        return float(here if here < later else later)


_BUILT: "weakref.WeakKeyDictionary[Tables, dict[tuple, Completion]]" = weakref.WeakKeyDictionary()


def completion_for(problem: Problem, tables: Tables, p: int, speed: float, low: float,
                   high: float) -> Completion:
    """The bound for ``p`` stages, kept between the searches of one solve: deepening asks for it under
    rising bounds, and one built for a larger ``high`` is valid (if a little looser) for any smaller. A
    rebuild leaves room for the next rises."""
    built = _BUILT.setdefault(tables, {})
    key = (p, speed, low)
    hit = built.get(key)
    if hit is None or hit.high < high:
        hit = built[key] = Completion(problem, tables, p, speed, low, low + 1.5 * (high - low))
    return hit
