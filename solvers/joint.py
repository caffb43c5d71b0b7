"""Joint search over the number of stages, micro-batches and schedule.

The mini-batch is fixed; splitting it into ``m`` micro-batches changes every
per-micro-batch cost. Where the caller has costs profiled at each micro-batch
size (fxpipe can re-profile), it passes one problem per ``m``; otherwise
:func:`rescale` derives them from one problem with a first-order model: compute
time, activation and tensor bytes are proportional to the micro-batch size,
except a fixed per-node overhead (kernel launches) that is not; latencies and
parameters do not scale. Every variant is solved exactly (the DP, or the
default method) and the table of what was tried comes back with the best plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

from solvers.errors import InfeasibleError, InvalidProblemError
from solvers.problem import SCHEDULES, Edge, Node, Problem
from solvers.solution import Solution

__all__ = ["Trial", "rescale", "joint_search", "format_trials"]


@dataclass
class Trial:
    micro_batches: int
    schedule: str
    stages: int | None          # as asked (None: free)
    iteration_s: float          # reference score; inf when infeasible
    used_stages: int            # stages of the plan found (0 when infeasible)
    optimal: bool
    solve_s: float
    solution: Solution | None


def rescale(problem: Problem, micro_batches: int, node_overhead_s: float = 0.0) -> Problem:
    """``problem`` for the same mini-batch cut into ``micro_batches`` micro-batches.

    Per-node time ``t`` becomes ``o + (t - o) x m / m'`` with ``o = min(t, node_overhead_s)``;
    activation and edge bytes scale by ``m / m'``.
    """
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise InvalidProblemError(f"micro-batch counts must be integers >= 1, got {micro_batches!r}")
    f = problem.micro_batches / micro_batches

    def time_of(t: float) -> float:
        o = min(t, node_overhead_s)
        return o + (t - o) * f

    nodes = [Node(n.id, time_of(n.fwd_s), time_of(n.bwd_s), n.param_bytes, n.act_bytes * f) for n in problem.nodes]
    edges = [Edge(e.src, e.dst, e.bytes * f) for e in problem.edges]
    return replace(problem, nodes=nodes, edges=edges, micro_batches=micro_batches, order=[])


def joint_search(
    problem: Problem | dict[int, Problem],
    micro_batches: Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    stages: Sequence[int | None] = (None,),
    method: str = "dp",
    time_limit_s: float = 10.0,
    node_overhead_s: float = 0.0,
) -> tuple[Solution, Problem, list[Trial]]:
    """Best plan over every (micro-batches, schedule, stages) combination, and the table of trials.

    ``problem`` is one problem (rescaled to each count in ``micro_batches``; default: its
    own count) or a dict ``{m: problem costed at that micro-batch size}``. Returns the
    best solution, the problem variant it solves, and every trial in the order tried.
    """
    from solvers import solve

    if isinstance(problem, dict):
        variants = dict(problem)
        if micro_batches is not None and set(micro_batches) != set(variants):
            raise InvalidProblemError("give micro_batches or a dict of problems keyed by micro-batch count, not both")
    else:
        counts = list(micro_batches) if micro_batches is not None else [problem.micro_batches]
        variants = {m: rescale(problem, m, node_overhead_s) for m in counts}
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise InvalidProblemError(f"schedules must be among {', '.join(SCHEDULES)}, got {list(schedules)}")
    trials: list[Trial] = []
    best: tuple[float, Solution, Problem] | None = None
    for m, base in sorted(variants.items()):
        for schedule in schedules:
            for count in stages:
                variant = replace(base, schedule=schedule, stages=count, micro_batches=m, order=[])
                started = time.perf_counter()
                try:
                    sol = solve(variant, method, time_limit_s)
                except InfeasibleError:
                    trials.append(Trial(m, schedule, count, math.inf, 0, True, time.perf_counter() - started, None))
                    continue
                t = sol.predicted["iteration_s"]
                trials.append(Trial(m, schedule, count, t, len(sol.stages), bool(sol.solver.get("optimal")),
                                    time.perf_counter() - started, sol))
                if best is None or t < best[0]:
                    best = (t, sol, variant)
    if best is None:
        raise InfeasibleError("no combination of micro-batches, schedule and stages fits in memory",
                              min_peak_bytes=math.nan)
    return best[1], best[2], trials


def format_trials(trials: list[Trial]) -> str:
    """The table of a joint search, best first marked with ``*``."""
    finite = [t.iteration_s for t in trials if math.isfinite(t.iteration_s)]
    best = min(finite) if finite else math.nan
    lines = ["  micro-batches  schedule  stages  iteration ms  vs best  optimal  solve s",
             "  -------------  --------  ------  ------------  -------  -------  -------"]
    for t in trials:
        mark = "*" if t.iteration_s == best else " "
        it = f"{t.iteration_s * 1e3:12.3f}" if math.isfinite(t.iteration_s) else "  infeasible"
        rel = f"{t.iteration_s / best:6.3f}x" if math.isfinite(t.iteration_s) else "      -"
        asked = "free" if t.stages is None else str(t.stages)
        lines.append(f"{mark} {t.micro_batches:13d}  {t.schedule:8s}  {t.used_stages:2d}/{asked:<3s}  {it}  {rel}  "
                     f"{'yes' if t.optimal else 'no':7s}  {t.solve_s:7.3f}")
    return "\n".join(lines)
