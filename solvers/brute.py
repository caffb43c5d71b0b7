"""Brute force over the DP's search space: the ground truth the tests compare against."""

from __future__ import annotations

import itertools
import math

from solvers.dp import stage_counts
from solvers.problem import Problem
from solvers.score import Score, score_assignment
from solvers.solution import assignment_from_cuts

__all__ = ["brute_force_contiguous", "brute_force_convex"]


def brute_force_contiguous(problem: Problem, placement: bool = False) -> Score | None:
    """Best feasible score over every contiguous partition, or None.

    Stage ``k`` runs on device ``k``, or, with ``placement``, on every injective
    mapping of stages to devices.
    """
    order, n = problem.order, len(problem.order)
    best: Score | None = None
    for p in stage_counts(problem):
        mappings = (itertools.permutations(range(len(problem.devices)), p) if placement
                    else [tuple(range(p))])
        mappings = list(mappings)
        for cuts in itertools.combinations(range(1, n), p - 1):
            stage_of = assignment_from_cuts(order, cuts)
            for devices in mappings:
                sc = score_assignment(problem, stage_of, list(devices))
                if sc.feasible and (best is None or sc.iteration_s < best.iteration_s):
                    best = sc
    return best if best is None or math.isfinite(best.iteration_s) else None


def brute_force_convex(problem: Problem) -> Score | None:
    """Best feasible score over every convex partition (each edge to the same or a later
    stage, no stage empty), stage ``k`` on device ``k``; or None. Exponential: tiny problems only."""
    order = problem.order
    best: Score | None = None
    for p in stage_counts(problem):
        for stages in itertools.product(range(p), repeat=len(order)):
            stage_of = dict(zip(order, stages))
            if len(set(stages)) != p or any(stage_of[e.src] > stage_of[e.dst] for e in problem.edges):
                continue
            sc = score_assignment(problem, stage_of, list(range(p)))
            if sc.feasible and (best is None or sc.iteration_s < best.iteration_s):
                best = sc
    return best
