"""The label search over chains of ideals as a solver: exact over the whole reference space when the DAG has
few ideals (:mod:`solvers.dp.ideals`), every stage count, any placement up to the topology's symmetries."""

from __future__ import annotations

import math
import time

from solvers.certificate import REFERENCE_SPACE, certify
from solvers.groups import GroupTable
from solvers.problem import Problem
from solvers.score import score_assignment
from solvers.solution import Solution, Stage
from solvers.dp.ideals import solve_ideals_p
from solvers.dp.lattice import MAX_IDEALS, MAX_STEPS, Lattice
from solvers.dp.deepen import deepening
from solvers.dp.frontier import Timeout
from solvers.dp.labels import analytic_lower
from solvers.dp.search import MAX_EXACT_PLACEMENT_DEVICES, orbit_canon
from solvers.dp.space import Space
from solvers.dp.tables import REL_TOL, Tables, device_classes, stage_counts

__all__ = ["FIRST_ROUND_SHARE", "convex_lattice", "few_steps", "solve_convex"]

FIRST_ROUND_SHARE = 0.7
"""Of the time limit, what the first pass over the stage counts may take: a count that would take all of it
cannot starve the later ones, and one cut short has the rest in the second pass."""


def convex_lattice(problem: Problem, incumbent_s: float | None = None, limit: int = MAX_IDEALS) -> Lattice | None:
    """The problem's lattice of ideals when :func:`solve_convex` applies to it, else None: at most ``limit``
    ideals, one device per stage, few enough devices for the exhaustive placement search, and, given the
    iteration time of a plan to beat, at most :data:`MAX_STEPS` stages that could be part of a better one."""
    if problem.max_replicas > 1 or len(problem.devices) > MAX_EXACT_PLACEMENT_DEVICES:
        return None
    lattice = Lattice.build(Tables(problem), limit)
    if lattice is not None and incumbent_s is not None and not few_steps(problem, lattice, incumbent_s):
        return None
    return lattice


def few_steps(problem: Problem, lattice: Lattice, incumbent_s: float) -> bool:
    """Whether at most :data:`MAX_STEPS` stages could be part of a plan faster than ``incumbent_s`` (each stage
    of one takes at most ``incumbent_s / m``, so holds at most that much work at the fastest speed)."""
    if not math.isfinite(incumbent_s):
        return True
    fastest = max(d.speed for d in problem.devices)
    return lattice.count_steps(incumbent_s / problem.micro_batches * fastest, MAX_STEPS) <= MAX_STEPS


def solve_convex(problem: Problem, time_limit_s: float, incumbent: Solution | None = None, floor: float = 0.0,
                 lattice: Lattice | None = None, prove: bool = False) -> Solution | None:
    """Best plan over convex partitions x placements, certified when the search finishes in time.

    ``incumbent`` (a plan of one device per stage) bounds the search from the start and is returned, with
    the certificate, when nothing beats it; ``floor`` is a lower bound on every plan proven elsewhere (the
    first bound of the deepening starts above it). ``prove``: the counts cut short in the first pass are
    searched again under rising bounds (:func:`solvers.dp.deepen.deepening`), each with a fair share of the
    rest, so that each proves what it can by the deadline (for the last phase of a solve: there is no
    other bound to come); else one search each under the incumbent, which certifies sooner when the
    incumbent is optimal. Returns None when the problem is outside this search (:func:`convex_lattice`) or
    when nothing was found in time and there is no incumbent.
    """
    started = time.perf_counter()
    deadline = started + time_limit_s
    lattice = lattice or convex_lattice(problem)
    if lattice is None:
        return None
    tables = lattice.tables
    table = GroupTable(problem)
    classes = device_classes(problem)
    space = Space("classes", table, classes=classes, canon=orbit_canon(problem, classes))
    index = {d.id: i for i, d in enumerate(problem.devices)}
    ub, best = math.inf, None
    if incumbent is not None and all(len(s.devices) == 1 for s in incumbent.stages):
        ub = float(incumbent.predicted["iteration_s"])
        best = ([list(s.nodes) for s in incumbent.stages], [index[s.devices[0]] for s in incumbent.stages])
    search = lambda *args: solve_ideals_p(*args[:2], lattice, *args[2:])  # noqa: E731
    # Stage counts smallest first (their searches are the cheapest, and their plans lower the bound of the
    # rest: on U-Net over the Titan V box 5 stages end in 0.04 s at 0.935 and let 6 end in 1.6 s at 0.899):
    # in a first pass of FIRST_ROUND_SHARE of the time each may take half of what is left of it (the last
    # count all of it), so what an easy count leaves goes to the later ones and none starves them; then the
    # counts cut short again, smallest first, with all the time left (``prove``: each a fair share).
    lower: dict[int, float] = {p: max(analytic_lower(problem, tables, p, space), floor) for p in stage_counts(problem)}
    open_counts = list(lower)
    first_round_end = started + FIRST_ROUND_SHARE * time_limit_s
    for last_round in (False, True):
        todo = list(open_counts)
        for i, p in enumerate(todo):
            now = time.perf_counter()
            if not last_round:   # half of what is left of the first pass; the last count, all of it
                until = now + max(0.0, first_round_end - now) / (1 if i == len(todo) - 1 else 2)
            else:                # a fair share of the rest, or all of it
                until = now + (deadline - now) / (len(todo) - i) if prove else deadline
            proven: dict[int, float] = {p: floor}
            try:
                if math.isfinite(ub) and not (prove and last_round):   # one search: the optimum, or ub proved
                    label, t, _ = solve_ideals_p(problem, tables, lattice, p, ub, space, until)
                else:
                    label, t = deepening(problem, tables, p, ub, space, until, proven, floor, search=search)
            except Timeout:
                lower[p] = max(lower[p], proven[p])
                continue
            open_counts.remove(p)   # nothing below ub in this count any more (or its optimum, now ub)
            if label is not None and t <= ub * (1 + REL_TOL):
                positions, devices = lattice.stages_of(label)
                ub, best = t, ([[tables.order[x] for x in stage] for stage in positions], devices)
        if not open_counts or time.perf_counter() >= deadline:
            break
    complete = not open_counts
    bound = min([lower[p] for p in open_counts], default=math.inf)
    if best is None:
        return None
    stage_nodes, devices = best
    stage_of = {v: s for s, nodes in enumerate(stage_nodes) for v in nodes}
    sc = score_assignment(problem, stage_of, devices)
    stages = [Stage([v for v in problem.order if stage_of[v] == s], [problem.devices[devices[s]].id])
              for s in range(len(devices))]
    return certify(problem, Solution(stages, sc.as_predicted(), {"ideals": len(lattice.ideals)}),
                   method="convex-dp", started=started,
                   exact_over=REFERENCE_SPACE + " (label search over chains of ideals)",
                   covers_reference=True, space_optimal=complete, space_lower_s=min(bound, sc.iteration_s))
