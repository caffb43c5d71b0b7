"""Local search over stage-to-device mappings for fixed stages.

A fast incumbent for the exact placement search, and the placement used where
that search is not attempted (more than 16 devices): starting from a mapping,
move a stage to an unused device or swap the devices of two stages while the
reference score improves (steepest descent). Nothing here is claimed optimal;
the DP in :mod:`solvers.dp` alternates it with exact cutting over the device
order it finds.
"""

from __future__ import annotations

import time

from solvers.problem import Problem
from solvers.score import Score, score_assignment

__all__ = ["improve_placement"]


def _key(sc: Score) -> float:
    return sc.iteration_s if sc.feasible else float("inf")


def improve_placement(problem: Problem, stage_of: dict[str, int], devices: list[int],
                      deadline: float = float("inf")) -> tuple[list[int], Score]:
    """The best mapping reachable from ``devices`` by improving moves and swaps, and its score."""
    current = list(devices)
    best = score_assignment(problem, stage_of, current)
    p, n = len(current), len(problem.devices)
    while time.perf_counter() < deadline:
        unused = [d for d in range(n) if d not in current]
        moves = [(a, b) for a in range(p) for b in range(a + 1, p)] + [(a, -1 - u) for a in range(p) for u in unused]
        chosen, chosen_score = None, best
        for a, b in moves:
            trial = list(current)
            if b >= 0:
                trial[a], trial[b] = trial[b], trial[a]
            else:
                trial[a] = -1 - b
            sc = score_assignment(problem, stage_of, trial)
            if _key(sc) < _key(chosen_score) * (1 - 1e-12):
                chosen, chosen_score = trial, sc
        if chosen is None:
            break
        current, best = chosen, chosen_score
    return current, best
