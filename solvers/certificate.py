"""What a solution's ``solver`` fields certify, filled in one place so they never contradict.

``shared/problem-format.md``: "optimal" means no feasible solution of the
*reference* problem (any convex partition, any placement of stages on distinct
devices) has a smaller reference ``T``; ``lower_bound_s`` and ``gap`` refer to
that whole space; ``time_s`` is the whole solve. A solver that searched a
smaller space exactly says so in ``exact_over`` (``space_optimal``: whether it
finished that search; ``covers_reference``: whether that space holds an optimum
of the reference problem, so that its bound is the whole space's); its own bound proves nothing about the
rest of the space, so only a bound that holds everywhere is reported then:
:func:`compute_lower_bound`, which every plan obeys whatever its partition
and placement.

Invariants (tested for every solver path): ``0 <= lower_bound_s <= T``,
``gap == (T - lower_bound_s) / T``, ``optimal`` iff ``gap == 0`` (and then
``lower_bound_s == T``).
"""

from __future__ import annotations

import math
import time
from typing import Any

from solvers.problem import Problem
from solvers.solution import Solution

__all__ = ["REFERENCE_SPACE", "certify", "compute_lower_bound", "contiguous_is_convex", "TOL"]

REFERENCE_SPACE = "convex partitions of the DAG, any placement of stages on distinct devices"
TOL = 1e-7   # relative: a bound this close to T certifies T (HiGHS stops at a gap of 1e-8)


def contiguous_is_convex(problem: Problem) -> bool:
    """Whether every convex partition is contiguous in ``problem.order``.

    True when consecutive nodes of the order are joined by edges (the order is a
    Hamiltonian path, as in a chain or a residual chain): stage indices cannot
    decrease along that path, so each stage is one run of the order.
    """
    edges = {(e.src, e.dst) for e in problem.edges}
    order = problem.order
    return all((order[i], order[i + 1]) in edges for i in range(len(order) - 1))


def compute_lower_bound(problem: Problem) -> float:
    """A lower bound on ``T`` over the whole reference space, from compute alone.

    With ``W`` the total forward+backward work, a plan of ``p`` stages has
    ``sum t_s >= W / F`` (all work at the fastest group speed ``F``) and
    ``max t_s >= max(W / S_p, w_max / F)`` (``S_p``: the most speed ``p`` stages
    can hold; ``w_max``: the heaviest node). Transfers, all-reduces and memory
    only add, so the minimum over stage counts bounds every feasible plan.
    """
    work = [n.fwd_s + n.bwd_s for n in problem.nodes]
    total, heaviest = sum(work), max(work)
    speeds = sorted((d.speed for d in problem.devices), reverse=True)
    r = problem.max_replicas
    fastest = sum(speeds[:r])
    counts = [problem.stages] if problem.stages is not None else range(1, min(len(speeds), len(work)) + 1)
    m = problem.micro_batches
    return min(total / fastest + (m - 1) * max(total / sum(speeds[:min(len(speeds), p * r)]), heaviest / fastest)
               for p in counts)


def certify(problem: Problem, solution: Solution, *, method: str, started: float, exact_over: str,
            covers_reference: bool, space_optimal: bool, space_lower_s: float = 0.0,
            global_lower_s: float = 0.0, **extra: Any) -> Solution:
    """Set ``solution.solver`` from what the search proved; returns ``solution``.

    ``exact_over``: the space searched exactly; ``covers_reference``: whether that
    space contains an optimum of the reference problem; ``space_optimal``: whether
    the search of that space finished; ``space_lower_s``: its proven bound when it
    did not finish; ``global_lower_s``: a bound already proven over the whole reference
    space (by earlier phases). ``time_s`` runs from ``started`` (``time.perf_counter()``) to now.
    """
    t = float(solution.predicted["iteration_s"])
    lower = max(compute_lower_bound(problem), global_lower_s)
    if covers_reference:
        lower = max(lower, t if space_optimal else space_lower_s)
    lower = min(max(lower, 0.0), t) if math.isfinite(t) else 0.0
    optimal = math.isfinite(t) and lower >= t * (1 - TOL)
    if optimal:
        lower = t
    gap = (t - lower) / t if t > 0 and math.isfinite(t) else 0.0
    solution.solver = {**{k: v for k, v in solution.solver.items()
                          if k not in ("optimal", "lower_bound_s", "gap", "time_s")},
                       **extra, "method": method, "optimal": optimal, "lower_bound_s": lower, "gap": gap,
                       "exact_over": exact_over, "space_optimal": bool(space_optimal or optimal),
                       "covers_reference": bool(covers_reference),
                       "reference": REFERENCE_SPACE, "time_s": time.perf_counter() - started}
    return solution
