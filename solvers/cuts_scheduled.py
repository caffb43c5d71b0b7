"""Anchor cutters that read the whole problem: PyTorch's proposed auto-partitioner and Megatron-LM's split.

Written from the published descriptions (no code copied); both cut ``problem.order`` into
contiguous stages for stage ``k`` on device ``k``, like the other anchors (:mod:`solvers.cuts`).

* :func:`autopartition_cuts`: pytorch/pytorch#179212 (``auto_partition`` in
  ``torch.distributed.pipelining``, from torchtitan#2113): per-layer forward and backward
  costs (from FLOPs; here the problem's ``fwd_s``/``bwd_s``), one scalar communication cost
  per stage boundary from one bandwidth for the whole machine, an exact DP that minimises
  the slowest stage, then refinement of the cuts against a schedule simulator
  (:func:`solvers.simulate.simulate` with the problem's schedule and micro-batch count).
* :func:`megatron_cuts`: Megatron-LM's even split of layers over stages with fewer layers
  on the first and last stages (``--decoder-first-pipeline-num-layers`` /
  ``--decoder-last-pipeline-num-layers``, which make room for the embedding and the
  loss). Megatron leaves the two counts to the user; here they are tuned as a user
  would by measuring, among fractions of the even count, by the reference score.
"""

from __future__ import annotations

import math
import statistics
import time

from solvers.cuts import minmax_cuts, node_weights, uniform_cuts
from solvers.problem import Problem
from solvers.schedules import get_schedule
from solvers.score import score_assignment
from solvers.simulate import simulate
from solvers.solution import assignment_from_cuts

__all__ = ["autopartition_cuts", "megatron_cuts", "PROBLEM_CUTTERS"]

REFINE_SIMULATIONS = 60
"""Most schedule simulations the auto-partitioner's refinement runs (each costs milliseconds at 16 stages)."""
MEGATRON_FRACTIONS = (1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25)
"""First/last stage sizes tried, as fractions of the even per-stage count."""


def _scalar_comm_s(problem: Problem) -> float:
    """One boundary's cost (forward and gradient, one way each) from one bandwidth and latency
    for the whole machine (the medians over device pairs) and the mean edge size."""
    d = len(problem.devices)
    pairs = [(i, j) for i in range(d) for j in range(d) if i != j]
    if not pairs or not problem.edges:
        return 0.0
    bw = statistics.median(problem.bandwidth_Bps[i][j] for i, j in pairs)
    lat = statistics.median(problem.latency_s[i][j] for i, j in pairs)
    nbytes = statistics.fmean(e.bytes for e in problem.edges)
    return 2.0 * (nbytes / bw + lat)


def _simulated_s(fwd: list[float], bwd: list[float], cuts: list[int], comm: float, problem: Problem) -> float:
    bounds = [0] + cuts + [len(fwd)]
    p = len(bounds) - 1
    f = [sum(fwd[bounds[k]:bounds[k + 1]]) for k in range(p)]
    b = [sum(bwd[bounds[k]:bounds[k + 1]]) for k in range(p)]
    sends = {(k, k + 1): comm / 2 for k in range(p - 1)}
    # one stage per worker here: a schedule with several stages per worker (interleaved, ZB-V) is judged by
    # its one-stage-per-worker form, since the anchor's cuts do not know which worker holds which stage
    schedule = get_schedule(problem.schedule).one_stage
    return simulate(f, b, problem.micro_batches, schedule, sends=sends).iteration_s


def autopartition_cuts(problem: Problem, parts: int, deadline: float = math.inf) -> list[int]:
    """The DP's min-max cuts (each boundary a stage touches costs the scalar), refined by the simulator.

    ``deadline`` (``time.perf_counter()``) stops the refinement early: the DP seeds its search with these
    cuts within its own time limit."""
    nodes = problem.node_map()
    fwd = [nodes[v].fwd_s for v in problem.order]
    bwd = [nodes[v].bwd_s for v in problem.order]
    n = len(fwd)
    if n <= parts:
        return uniform_cuts(fwd, parts)
    comm = _scalar_comm_s(problem)
    weights = [f + b for f, b in zip(fwd, bwd)]
    # a middle stage pays two boundaries, an end stage one: the DP sees that as an offset per stage
    offsets = [comm * ((k > 0) + (k < parts - 1)) for k in range(parts)]
    cuts = minmax_cuts(weights, parts, offsets)
    best = _simulated_s(fwd, bwd, cuts, comm, problem)
    budget = REFINE_SIMULATIONS
    improved = True
    while improved and budget > 0:   # first-improvement moves of one cut by one node
        improved = False
        for i in range(len(cuts)):
            for step in (-1, 1):
                moved = cuts[:i] + [cuts[i] + step] + cuts[i + 1:]
                lo = moved[i - 1] if i > 0 else 0
                hi = moved[i + 1] if i + 1 < len(moved) else n
                if not lo < moved[i] < hi or budget <= 0 or time.perf_counter() > deadline:
                    continue
                budget -= 1
                t = _simulated_s(fwd, bwd, moved, comm, problem)
                if t < best * (1 - 1e-12):
                    cuts, best, improved = moved, t, True
    return cuts


def megatron_cuts(problem: Problem, parts: int) -> list[int]:
    """Even node counts over the middle stages, the first and last stages a tuned fraction of that."""
    n = len(problem.order)
    if parts <= 2 or n <= parts:
        return uniform_cuts(node_weights(problem, "time"), parts)
    even = n / parts
    best: tuple[float, list[int]] | None = None
    for ff in MEGATRON_FRACTIONS:
        for fl in MEGATRON_FRACTIONS:
            first, last = max(1, round(even * ff)), max(1, round(even * fl))
            middle = n - first - last
            if middle < parts - 2:
                continue
            cuts = [first] + [first + c for c in uniform_cuts([0.0] * middle, parts - 2)] + [n - last]
            sc = score_assignment(problem, assignment_from_cuts(problem.order, cuts), list(range(parts)))
            key = sc.iteration_s if sc.feasible else float("inf")
            if best is None or key < best[0]:
                best = (key, cuts)
    assert best is not None   # ff = fl = 1 always leaves room
    return best[1]


PROBLEM_CUTTERS = {"pytorch-auto": autopartition_cuts, "megatron": megatron_cuts}
"""Anchor name -> cutter ``(problem, parts) -> cuts``."""
