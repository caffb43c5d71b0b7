"""Run fxpipe's solver and the anchor partitioners on problems and tabulate the reference scores."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from solvers.anchors import ANCHORS, anchor_solution
from solvers.errors import InfeasibleError
from solvers.problem import Problem
from solvers.score import score

__all__ = ["Row", "compare", "format_table", "geometric_means"]


@dataclass
class Row:
    problem: str
    method: str
    iteration_s: float        # reference score; inf when infeasible
    feasible: bool
    relative: float           # iteration_s / fxpipe's iteration_s (>= 1 means fxpipe is no worse)
    gap: float | None         # gap certified over the reference space (convex partitions, any placement)
    solve_s: float
    space_optimal: bool | None = None   # the method finished the space it searches exactly


def compare(problems: list[Problem], fxpipe_method: str = "dp", anchors: list[str] | None = None,
            time_limit_s: float = 10.0, progress=None) -> list[Row]:
    """Score fxpipe (``solve(problem, fxpipe_method, time_limit_s)``) and each anchor on every problem."""
    from solvers import solve  # the package's default entry point

    rows: list[Row] = []
    for problem in problems:
        if progress is not None:
            progress(problem.name)
        results = []
        started = time.perf_counter()
        try:
            sol = solve(problem, fxpipe_method, time_limit_s)
            sc = score(problem, sol)
            results.append(("fxpipe", sc.iteration_s if sc.feasible else math.inf, sc.feasible,
                            sol.solver.get("gap"), time.perf_counter() - started, sol.solver.get("space_optimal")))
        except InfeasibleError:
            results.append(("fxpipe", math.inf, False, None, time.perf_counter() - started, None))
        for name in anchors if anchors is not None else list(ANCHORS):
            started = time.perf_counter()
            sol = anchor_solution(problem, name)
            sc = score(problem, sol)
            results.append((name, sc.iteration_s if sc.feasible else math.inf, sc.feasible, None,
                            time.perf_counter() - started, None))
        base = results[0][1]
        for name, t, ok, gap, secs, space_optimal in results:
            rel = t / base if math.isfinite(base) and base > 0 else math.nan
            rows.append(Row(problem.name, name, t, ok, rel, gap, secs, space_optimal))
    return rows


def geometric_means(rows: list[Row]) -> dict[str, float]:
    """Per method, the geometric mean of ``relative`` over problems where both sides are feasible."""
    logs: dict[str, list[float]] = {}
    for r in rows:
        if math.isfinite(r.relative) and r.relative > 0:
            logs.setdefault(r.method, []).append(math.log(r.relative))
    return {m: math.exp(sum(v) / len(v)) for m, v in logs.items()}


def format_table(rows: list[Row]) -> str:
    head = ["problem", "method", "iteration ms", "vs fxpipe", "feasible", "gap", "space exact", "solve s"]
    body = [[r.problem, r.method, f"{r.iteration_s * 1e3:.3f}" if math.isfinite(r.iteration_s) else "infeasible",
             f"{r.relative:.3f}x" if math.isfinite(r.relative) else "-", "yes" if r.feasible else "no",
             f"{r.gap:.2%}" if r.gap is not None else "-",
             {None: "-", True: "yes", False: "no"}[r.space_optimal], f"{r.solve_s:.3f}"] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
    means = geometric_means(rows)
    lines.append("")
    lines.append("gap: certified over the reference space (convex partitions, any placement); "
                 "space exact: the solver finished the space it searches exactly (solver.exact_over)")
    lines.append("geometric mean of iteration time relative to fxpipe (feasible problems): "
                 + ", ".join(f"{m} {v:.3f}x" for m, v in means.items()))
    return "\n".join(lines)
