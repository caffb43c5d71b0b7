"""Which stage ends a state of the contiguous label search need not look at: the state-free part of its floor.

:func:`solvers.dp.labels.solve_fixed_p` tests every end ``j2`` of a stage that starts at ``j`` against a floor:
the cheapest label's sum, the stage, the rest's work at the fastest speed, ``m - 1`` times the rest's
bottleneck and the transfers the rest must pay. On the 3000-node chain over two 8-GPU boxes that test
rejected 97 % of the ends the search looked at (a stage must be long enough to leave the rest a bottleneck
under the bound). Its part that depends on no label and no device (the bottleneck and transfer tables per
stage count left and end) is one numpy array per count here, and the state's sum plus the work from ``j``
at the fastest speed bounds the rest of it from below, so one vector test finds the first end that may pass.
"""

from __future__ import annotations

import math

import numpy as np

from solvers.dp.tables import Tables

__all__ = ["EndSkip"]


class EndSkip:
    """The first stage end worth looking at from a state, for one search (stage count, speed, micro-batches)."""

    def __init__(self, tables: Tables, p: int, m: int, max_speed: float, bottleneck: list[list[float]],
                 transfers: list[list[float]]) -> None:
        self.tables, self.m, self.max_speed = tables, m, max_speed
        n = tables.n
        self.parts = [np.zeros(n + 1)] + [
            (m - 1) * np.array(bottleneck[s]) + np.array(transfers[s]) if m > 1 else np.array(transfers[s])
            for s in range(1, p)]
        self.prefix_fb = np.concatenate([[0.0], np.cumsum(tables.fb)])

    def first_end(self, j: int, j_max: int, stages_left: int, least_total: float, cap: float,
                  limit: float) -> tuple[int | None, float]:
        """The first end ``j2 > j`` whose floor may be within ``limit`` (None: no end is), and the least lower
        bound of the ends skipped before it (``inf`` when none is), what a failed search proves of them.

        Ends past the cap on the stage's compute alone are skipped too (``T >= m`` times that stage)."""
        if not stages_left:
            return j + 1, math.inf
        prefix, speed = self.prefix_fb, self.max_speed
        base = least_total + self.tables.suffix_fb[j] / speed   # the label's sum, the stage and the rest's work
        last = j_max if not math.isfinite(cap) else min(j_max, int(np.searchsorted(
            prefix, prefix[j] + cap * speed, side="right")) - 1)
        window = self.parts[stages_left][j + 1:last + 1]
        passing = window <= limit * (1 + 1e-12) - base
        first = int(passing.argmax()) if len(window) else 0
        if len(window) and passing[first]:
            return j + 1 + first, base + float(window[:first].min()) if first else math.inf
        skipped = base + float(window.min()) if len(window) else math.inf
        if last < j_max:   # the next end is over the cap
            skipped = min(skipped, self.m * (prefix[last + 1] - prefix[j]) / speed)
        return None, skipped
