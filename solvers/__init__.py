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

METHODS = ("dp",)
"""Solution methods of :func:`solve`."""


def solve(problem: Problem, method: str = "dp") -> Solution:
    """Solve ``problem`` with ``method`` (only ``"dp"`` today)."""
    if method not in METHODS:
        raise InvalidProblemError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    return solve_dp(problem)
