"""Rising bounds: a stage count's searches under growing upper bounds, and the counts of one space in turn.

A search bounded by ``G`` finds the optimum whenever it is ``<= G`` (only labels whose lower bound
exceeds ``G`` are pruned), so the first bound that yields a solution yields the optimal one, and tight
bounds prune hard. The bounds of one count rise from just above its lower bound by steps that grow 1.5
times: the searches that fail are cheap and the one that succeeds overshoots by at most one step.

Across the stage counts of one space, :func:`deepen_counts` either searches each count to its end, fewest
stages first (which finds plans soonest where many counts have loose bounds), or, for a search that certifies,
always raises the count whose proven bound is the smallest. One after another, a count the deadline stopped
left the later ones at their analytic bounds: on GPT-2 (24 layers) over the Titan V box the search over the
DP's space proved nothing above 1.765 s under a 2.345 s plan, in 10 s and in 60 s alike, because 8 stages,
where the plan is, was never reached; best-first it proves 1.884 s in 10 s, the least bound of all counts,
which rose evenly. On U-Net, a chain (the DP's space holds an optimum), over the Titan V box with its devices
listed across the sockets, the DP's certified gap went from 58 % to 37 % with the same plan.
"""

from __future__ import annotations

import math
from typing import Callable

from solvers.problem import Problem
from solvers.dp.frontier import Label
from solvers.dp.labels import analytic_lower, solve_fixed_p
from solvers.dp.space import Space
from solvers.dp.tables import REL_TOL, Tables

__all__ = ["FIRST_STEP", "MAX_FAILED_BOUNDS", "CountDeepening", "deepen_counts", "deepening"]

FIRST_STEP = 1e-3
"""The first bound is this far above the lower bound (relative); each failure makes the step 1.5 times larger."""

MAX_FAILED_BOUNDS = 60
"""Past this many failed bounds, one search at the incumbent."""

SearchFn = Callable[..., tuple[Label | None, float, float]]


class CountDeepening:
    """One stage count's rising bounds; each :meth:`advance` runs one search (and may raise ``Timeout``)."""

    def __init__(self, problem: Problem, tables: Tables, p: int, space: Space, floor: float = 0.0,
                 search: SearchFn | None = None) -> None:
        self.problem, self.tables, self.p, self.space = problem, tables, p, space
        self.search = search or solve_fixed_p
        self.lower = max(analytic_lower(problem, tables, p, space), floor)   # no plan of p stages is faster
        self.step = FIRST_STEP
        self.bound = self.lower * (1 + self.step)
        self.failed = 0
        self.done = False    # the count's optimum was found, or nothing in it is below the incumbent

    def advance(self, ub: float, deadline: float) -> tuple[Label | None, float]:
        """Search under the next bound (never above ``ub``): the count's optimum when it is below the bound,
        else ``(None, inf)`` with :attr:`lower` raised to what the failed search proved."""
        if self.lower > ub * (1 + REL_TOL):
            self.done = True
            return None, math.inf
        bound = ub if self.failed >= MAX_FAILED_BOUNDS else min(self.bound, ub)
        label, t, pruned = self.search(self.problem, self.tables, self.p, bound, self.space, deadline)
        if label is not None:
            self.lower, self.done = t, True
            return label, t
        self.lower = max(self.lower, min(pruned, ub))   # nothing at or below the bound; all else cut above it
        self.done = bound >= ub
        self.failed += 1
        self.step *= 1.5
        self.bound = max(pruned, bound) * (1 + self.step)
        return None, math.inf


def deepening(problem: Problem, tables: Tables, p: int, ub: float, space: Space,
              deadline: float, proven: dict[int, float], floor: float = 0.0,
              search: SearchFn | None = None) -> tuple[Label | None, float]:
    """One count's searches to the end: its optimum when below ``ub``, else ``(None, inf)``.

    ``proven[p]`` records the best lower bound on ``p`` stages proven so far, which is what a timed-out
    search can still certify. ``floor`` is a lower bound known from elsewhere (a relaxation): the first
    bound starts above it. ``search`` is the search run under each bound, with
    :func:`~solvers.dp.labels.solve_fixed_p`'s arguments (that function when None).
    """
    count = CountDeepening(problem, tables, p, space, floor, search)
    proven[p] = count.lower
    while not count.done:
        label, t = count.advance(ub, deadline)
        proven[p] = count.lower   # the optimum when found; else what the failed searches proved
        if label is not None:
            return label, t
    return None, math.inf


def deepen_counts(counts: list[CountDeepening], ub: float, deadline: float,
                  found: Callable[[CountDeepening, Label, float], None], best_first: bool = True) -> float:
    """Search the counts until each found its optimum or proved none below the incumbent ``ub``; ``found``
    is told each plan that lowers ``ub``. Returns the final ``ub``. A ``Timeout`` propagates; the counts
    not :attr:`~CountDeepening.done` then hold what they proved.

    ``best_first``: always raise the count with the smallest proven bound (then the fewest stages), so a
    stopped search proves the most it can. Else each count to its end in the given order, which finds
    plans sooner where many counts have loose bounds (Inception-v3 over 16 GPUs: best-first raised 12
    counts from 0.33 s together and none reached the 0.39 s plan the counts one by one found)."""
    while True:
        open_counts = [c for c in counts if not c.done]
        if not open_counts:
            return ub
        count = min(open_counts, key=lambda c: (c.lower, c.p)) if best_first else open_counts[0]
        label, t = count.advance(ub, deadline)
        if label is not None and t <= ub * (1 + REL_TOL):
            ub = t
            found(count, label, t)
