"""Torch-free pipeline planning: problems, the reference score and exact solvers.

Reads and writes the JSON of ``fxpipe-problem/1`` and ``fxpipe-solution/1``.
Nothing here imports torch.
"""

from solvers.brute import brute_force_contiguous
from solvers.certificate import contiguous_is_convex
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

METHODS = ("auto", "dp", "ilp", "exact")
"""Solution methods of :func:`solve`; ``auto`` is the default of the command line."""


def solve(problem: Problem, method: str = "dp", time_limit_s: float = 10.0) -> Solution:
    """Solve ``problem``; ``solver`` fields as :mod:`solvers.certificate` defines them.

    * ``"dp"``: exact over contiguous stages of one topological order, with placement
      (and replica groups for ``fxpipe-problem/2``); its exact searches stop after
      ``time_limit_s`` and then report a proven lower bound and gap.
    * ``"ilp"``: best convex partition within ``time_limit_s`` (stage ``k`` on device ``k``,
      one device per stage).
    * ``"exact"``: convex partitions on every placement (:mod:`solvers.exact`), within
      ``time_limit_s``; for small and medium problems.
    * ``"auto"``: the DP, then the exact decomposition (or, with too many placements, the
      ILP on the DP's placement); the best plan any phase found, certified as far as the
      phases together prove (:mod:`solvers.auto`).

    ``time_limit_s`` bounds the whole solve, whatever the method (building an ILP included).
    """
    if method not in METHODS:
        raise InvalidProblemError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if method == "dp":
        try:
            return solve_dp(problem, time_limit_s=time_limit_s)
        except InfeasibleError as exc:
            if contiguous_is_convex(problem):
                raise
            raise InfeasibleError(f"{exc}. Method 'dp' searches contiguous stages of one topological order "
                                  "only; a convex partition outside them may fit: method 'auto' (the default) "
                                  "searches those too", min_peak_bytes=exc.min_peak_bytes,
                                  proven=exc.proven) from exc
    if method == "auto":
        from solvers.auto import solve_auto
        return solve_auto(problem, time_limit_s)
    from solvers.dp.tables import device_classes
    from solvers.ilp import ilp_available, solve_ilp

    if not ilp_available():
        raise SolverError(f"method {method!r} needs HiGHS: pip install highspy")
    if method == "ilp":
        try:
            return solve_ilp(problem, time_limit_s)
        except InfeasibleError as exc:
            if len(device_classes(problem)) == 1:   # every placement is alike: the one searched is all of them
                raise
            raise InfeasibleError(f"{exc}. Method 'ilp' searches that one placement only; another may fit: "
                                  "method 'auto' (the default) or 'exact' searches the others",
                                  min_peak_bytes=exc.min_peak_bytes, proven=exc.proven) from exc
    from solvers.exact import solve_exact
    sol = solve_exact(problem, time_limit_s)
    if sol is None:
        raise InfeasibleError(f"the exact search found no plan within its time limit of {time_limit_s} s; "
                              "raise the time limit or use method 'auto' (the DP first)", min_peak_bytes=None,
                              proven=False)
    return sol
