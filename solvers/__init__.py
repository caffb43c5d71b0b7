"""Torch-free pipeline planning: problems, the reference score and exact solvers.

Reads and writes the JSON of ``fxpipe-problem/1`` and ``fxpipe-solution/1``.
Nothing here imports torch.
"""

from solvers.brute import brute_force_contiguous
from solvers.dp import min_peak_bytes, solve_dp
from solvers.errors import InfeasibleError, InvalidProblemError, SolverError
from solvers.problem import Device, Edge, Node, Problem
from solvers.score import Score, score, score_assignment
from solvers.solution import Solution, Stage

__all__ = [
    "Device", "Edge", "InfeasibleError", "InvalidProblemError", "Node", "Problem", "Score",
    "Solution", "SolverError", "Stage", "brute_force_contiguous", "min_peak_bytes", "score",
    "METHODS", "score_assignment", "solve", "solve_dp",
]

METHODS = ("auto", "dp", "ilp")
"""Solution methods of :func:`solve`; ``auto`` is the default of the command line."""


def solve(problem: Problem, method: str = "dp", time_limit_s: float = 10.0) -> Solution:
    """Solve ``problem``.

    * ``"dp"``: exact over contiguous stages of one topological order, with placement
      (and replica groups for ``fxpipe-problem/2``); its exact searches stop after
      ``time_limit_s`` and then report a proven lower bound and gap.
    * ``"ilp"``: best convex partition within ``time_limit_s`` (stage ``k`` on device ``k``,
      one device per stage).
    * ``"auto"``: the DP, then the ILP warm-started from it (same placement) within
      another ``time_limit_s``; never worse than the DP, optimal over convex partitions
      for that placement when its gap closes. The ILP is skipped when the DP's plan
      has replica groups.
    """
    if method not in METHODS:
        raise InvalidProblemError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if method == "dp":
        return solve_dp(problem, time_limit_s=time_limit_s)
    from solvers.ilp import ilp_available, solve_ilp

    if method == "ilp":
        return solve_ilp(problem, time_limit_s)
    dp = solve_dp(problem, time_limit_s=time_limit_s)
    if not ilp_available():
        dp.solver["note"] = "ILP skipped: HiGHS (highspy) is not installed"
        return dp
    if any(len(s.devices) > 1 for s in dp.stages):
        dp.solver["note"] = "ILP skipped: the DP's plan has replica groups, the ILP models one device per stage"
        return dp
    ilp = solve_ilp(problem, time_limit_s, warm_start=dp)
    best = ilp if ilp.predicted["iteration_s"] < dp.predicted["iteration_s"] else dp
    best.solver = {**best.solver, "method": "auto", "chosen": "ilp" if best is ilp else "dp",
                   "dp_iteration_s": dp.predicted["iteration_s"], "dp_optimal": dp.solver["optimal"],
                   "dp_gap": dp.solver["gap"], "dp_search_space": dp.solver["search_space"],
                   "ilp_gap": ilp.solver["gap"],
                   "optimal": ilp.solver["optimal"] and dp.solver["optimal"],
                   "lower_bound_s": min(ilp.solver["lower_bound_s"], dp.solver["lower_bound_s"],
                                        best.predicted["iteration_s"])}
    return best
