"""Exact over the whole reference space for small and medium problems: convex partitions x placements.

The ILP of :mod:`solvers.ilp` is exact over convex partitions for one placement.
This decomposition runs it once per placement, which together covers every
convex partition on every injective stage-to-device mapping, and proves the
optimum of the reference problem. Three things keep it small:

* symmetry: devices of one class (:func:`solvers.dp.device_classes`: same speed,
  memory and links, so swapping them is an automorphism of the problem) are
  interchangeable, so a placement is a sequence of classes, the ``k``-th use of a
  class taking its ``k``-th device;
* bounds: a placement whose compute bound (work at its fastest stage's speed, the
  maximum at least the work over its total speed) already reaches the incumbent
  is never solved;
* cutoff: each ILP only looks for plans better than the incumbent, so a placement
  that cannot win is closed by an infeasibility proof.

The DP's plan is the first incumbent, and its placement is solved first.
"""

from __future__ import annotations

import math
import time
from typing import Iterator

from solvers.certificate import REFERENCE_SPACE, TOL, certify
from solvers.dp.tables import device_classes, stage_counts
from solvers.errors import InfeasibleError, SolverError
from solvers.ilp import run_placement
from solvers.problem import Problem
from solvers.score import score_assignment
from solvers.solution import Solution, Stage

__all__ = ["MAX_PLACEMENTS", "placements", "solve_exact"]

MAX_PLACEMENTS = 5000
"""Beyond this many placements (up to symmetry) the decomposition is not attempted."""


def placements(problem: Problem, limit: int = MAX_PLACEMENTS) -> list[tuple[int, ...]] | None:
    """Every placement up to symmetry, for every stage count; None when more than ``limit``."""
    classes = device_classes(problem)
    out: list[tuple[int, ...]] = []

    def extend(prefix: list[int], used: list[int], p: int) -> Iterator[tuple[int, ...]]:
        if len(prefix) == p:
            yield tuple(prefix)
            return
        for c, group in enumerate(classes):
            if used[c] < len(group):
                used[c] += 1
                prefix.append(group[used[c] - 1])
                yield from extend(prefix, used, p)
                prefix.pop()
                used[c] -= 1

    for p in stage_counts(problem):
        for placement in extend([], [0] * len(classes), p):
            out.append(placement)
            if len(out) > limit:
                return None
    return out


def _placement_bound(problem: Problem, devices: tuple[int, ...]) -> float:
    """No plan on ``devices`` is faster: compute alone, as in :func:`solvers.certificate.compute_lower_bound`."""
    work = [n.fwd_s + n.bwd_s for n in problem.nodes]
    speeds = [problem.devices[d].speed for d in devices]
    total, fastest = sum(work), max(speeds)
    return total / fastest + (problem.micro_batches - 1) * max(total / sum(speeds), max(work) / fastest)


def solve_exact(problem: Problem, time_limit_s: float, incumbent: Solution | None = None,
                candidates: list[tuple[int, ...]] | None = None) -> Solution | None:
    """Best plan over the reference space (certified when every placement is closed in time).

    Returns None when no plan was found in time; raises :class:`InfeasibleError` when
    every placement was proven to have no feasible convex partition.
    """
    started = time.perf_counter()
    deadline = started + time_limit_s
    index = {d.id: i for i, d in enumerate(problem.devices)}
    ub, best = math.inf, None
    first: tuple[int, ...] | None = None
    start_map = None
    if incumbent is not None and all(len(s.devices) == 1 for s in incumbent.stages):
        ub = float(incumbent.predicted["iteration_s"])
        first = tuple(index[s.devices[0]] for s in incumbent.stages)
        start_map = {n: k for k, s in enumerate(incumbent.stages) for n in s.nodes}
        best = (ub, start_map, list(first))
    todo = candidates if candidates is not None else placements(problem)
    if todo is None:
        raise SolverError(
            f"{len(problem.devices)} devices give more than {MAX_PLACEMENTS} placements (up to symmetry) for the "
            "exact search; use method 'auto' (the DP, then the ILP on its placement) or fix 'stages'")
    order = sorted(todo, key=lambda devs: _placement_bound(problem, devs))
    if first is not None:   # the DP's own placement first: convex cuts that beat its contiguous ones
        order = [first] + [devs for devs in order if devs != first]
    lower, finished = math.inf, True
    for devs in order:
        bound = _placement_bound(problem, devs)
        if bound >= ub * (1 - TOL / 10):
            lower = min(lower, bound)
            continue
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            finished, lower = False, min(lower, bound)
            continue
        run = run_placement(problem, list(devs), remaining, start_map if devs == first else None,
                            cutoff=ub * (1 - TOL / 10) if math.isfinite(ub) else None)
        finished = finished and run.finished
        lower = min(lower, max(run.lower_s, bound))
        if run.stage_of is not None:
            sc = score_assignment(problem, run.stage_of, list(devs))
            if sc.feasible and sc.iteration_s < ub:
                ub, best = sc.iteration_s, (sc.iteration_s, run.stage_of, list(devs))
    if best is None:
        if finished:
            raise InfeasibleError(
                f"no convex partition of the {len(problem.nodes)} nodes fits in memory on any placement over "
                f"{len(problem.devices)} devices; add devices or memory, or lower micro_batches/activation memory",
                min_peak_bytes=math.nan)
        return None
    _, stage_of, devices = best
    sc = score_assignment(problem, stage_of, devices)
    stages = [Stage([v for v in problem.order if stage_of[v] == s], [problem.devices[devices[s]].id])
              for s in range(len(devices))]
    return certify(problem, Solution(stages, sc.as_predicted(), {"placements": len(order)}), method="exact",
                   started=started, exact_over=REFERENCE_SPACE + " (convex-partition ILP per placement)",
                   covers_reference=problem.max_replicas == 1, space_optimal=finished,
                   space_lower_s=min(lower, ub))
