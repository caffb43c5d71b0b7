"""Brute force over the DP's search space: the ground truth the tests compare against."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

from solvers.dp import stage_counts
from solvers.groups import hierarchical_order
from solvers.problem import Problem
from solvers.score import Score, score_assignment
from solvers.solution import assignment_from_cuts

if TYPE_CHECKING:
    from solvers.mesh import MeshProblem

__all__ = ["brute_force_contiguous", "brute_force_convex", "brute_force_mesh", "brute_force_reference",
           "brute_force_replicated"]


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


def brute_force_reference(problem: Problem) -> Score | None:
    """Best feasible score over the reference space of ``shared/problem-format.md``: every convex
    partition on every injective stage-to-device mapping; or None. Exponential: tiny problems only."""
    order = problem.order
    best: Score | None = None
    for p in stage_counts(problem):
        mappings = list(itertools.permutations(range(len(problem.devices)), p))
        for stages in itertools.product(range(p), repeat=len(order)):
            stage_of = dict(zip(order, stages))
            if len(set(stages)) != p or any(stage_of[e.src] > stage_of[e.dst] for e in problem.edges):
                continue
            for devices in mappings:
                sc = score_assignment(problem, stage_of, list(devices))
                if sc.feasible and (best is None or sc.iteration_s < best.iteration_s):
                    best = sc
    return best


def _run_lengths(p: int, devices: int, max_r: int):
    """Every way to give ``p`` stages ``1..max_r`` devices each, ``devices`` at most in all."""
    for lengths in itertools.product(range(1, max_r + 1), repeat=p):
        if sum(lengths) <= devices:
            yield lengths


def brute_force_replicated(problem: Problem) -> Score | None:
    """Best feasible score over the DP's space with replicas: every contiguous partition
    with any injective single-device mapping, or with stages on runs of consecutive devices
    of the hierarchical order (up to ``max_replicas`` each); or None."""
    best = brute_force_contiguous(problem, placement=True)
    order, n = problem.order, len(problem.order)
    dev_order = hierarchical_order(problem)
    for p in stage_counts(problem):
        for cuts in itertools.combinations(range(1, n), p - 1):
            stage_of = assignment_from_cuts(order, cuts)
            for lengths in _run_lengths(p, len(dev_order), problem.max_replicas):
                starts = list(itertools.accumulate((0,) + lengths[:-1]))
                groups = [tuple(dev_order[s:s + r]) for s, r in zip(starts, lengths)]
                sc = score_assignment(problem, stage_of, groups)
                if sc.feasible and (best is None or sc.iteration_s < best.iteration_s):
                    best = sc
    return best


def brute_force_mesh(problem: "MeshProblem") -> dict:
    """The best screened step of every mesh shape over every candidate of :func:`solvers.mesh_search.candidates`,
    with and without recomputation (whole stages, each block, the fastest that fits per stage), and every contiguous cut into its stages: mesh -> the best
    :class:`solvers.mesh_search.MeshChoice` (shapes where nothing fits are absent). Exponential: tiny problems."""
    from solvers.mesh import budget
    from solvers.mesh_candidates import Candidate, candidates, recompute_options
    from solvers.mesh_search import evaluate_cuts

    L = len(problem.pieces)
    best: dict = {}
    for cand in candidates(problem):
        k, _ = budget(problem, cand.schedule, cand.mesh.pp)
        for option in recompute_options():
            c = Candidate(cand.mesh, cand.schedule, cand.micro_batches, *option)
            for inner in itertools.combinations(range(1, L), k - 1):
                found = evaluate_cuts(problem, c, [0, *inner, L])
                if found is not None and (cand.mesh not in best or found.screened_s < best[cand.mesh].screened_s):
                    best[cand.mesh] = found
    return best
