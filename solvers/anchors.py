"""The partitioners in use elsewhere, reimplemented on fxpipe's costs to be scored beside it.

Each is a faithful reimplementation of the published idea (no code copied);
all cut the same topological order into contiguous stages and place stage
``k`` on device ``k`` (topology-blind), using ``problem.stages`` stages or one
per device. None of them looks at memory; their plans are scored as they are.

* ``uniform``: equal node counts (DeepSpeed ``partition_method="uniform"``).
* ``parameters``: DeepSpeed's ``"parameters"`` method: a DP over prefixes that
  keeps, per (prefix, parts), the split with the smallest max-minus-min spread
  of parameter counts (greedy in its choice of state, as DeepSpeed's is).
* ``block``: torchgpipe's ``balance_by_time``: blocks of compute time with the
  smallest maximum block (the objective of Bárány et al.'s algorithm,
  arXiv:1308.2452, solved exactly here by a min-max DP).
* ``pippy``: PiPPy's ``split_into_equal_size``: walk the nodes, cut when the
  running parameter size reaches total / stages.
* ``pytorch-auto``: PyTorch's proposed automatic partitioner (pytorch/pytorch#179212):
  min-max DP over per-layer costs with one scalar communication cost, refined against
  a schedule simulator (:mod:`solvers.cuts_scheduled`).
* ``megatron``: Megatron-LM's even split with fewer layers on the first and last
  stages, the two counts tuned by the reference score (:mod:`solvers.cuts_scheduled`).
* ``blind``: fxpipe's own exact DP with the devices in the order given
  (topology-blind placement): the anchor for topology-aware placement.
"""

from __future__ import annotations

import time
from typing import Callable

from solvers.cuts import equal_size_cuts, minmax_cuts, node_weights, spread_cuts, uniform_cuts
from solvers.cuts_scheduled import PROBLEM_CUTTERS
from solvers.dp import solve_dp
from solvers.problem import Problem
from solvers.score import score_assignment
from solvers.solution import Solution, Stage, assignment_from_cuts

__all__ = ["ANCHORS", "anchor_solution", "uniform_cuts", "spread_cuts", "minmax_cuts", "equal_size_cuts"]


def _parts(problem: Problem) -> int:
    return problem.stages or min(len(problem.devices), len(problem.nodes))


def _solution_from_cuts(problem: Problem, cuts: list[int], method: str, started: float) -> Solution:
    order, p = problem.order, len(cuts) + 1
    stage_of = assignment_from_cuts(order, cuts)
    sc = score_assignment(problem, stage_of, list(range(p)))
    stages = [Stage([v for v in order if stage_of[v] == s], [problem.devices[s].id]) for s in range(p)]
    return Solution(stages, sc.as_predicted(),
                    {"method": method, "optimal": False, "time_s": time.perf_counter() - started})


def _cut_anchor(name: str, field: str, cutter: Callable[[list[float], int], list[int]]):
    def run(problem: Problem) -> Solution:
        started = time.perf_counter()
        return _solution_from_cuts(problem, cutter(node_weights(problem, field), _parts(problem)), name, started)
    return run


def _problem_anchor(name: str):
    def run(problem: Problem) -> Solution:
        started = time.perf_counter()
        return _solution_from_cuts(problem, PROBLEM_CUTTERS[name](problem, _parts(problem)), name, started)
    return run


BLIND_TIME_LIMIT_S = 10.0
"""The blind anchor's exact search stops here (its plan is then its best so far)."""


def _blind(problem: Problem) -> Solution:
    sol = solve_dp(problem, placement=False, time_limit_s=BLIND_TIME_LIMIT_S)
    sol.solver["method"] = "blind"
    return sol


ANCHORS: dict[str, Callable[[Problem], Solution]] = {
    "uniform": _cut_anchor("uniform", "time", uniform_cuts),
    "parameters": _cut_anchor("parameters", "params", spread_cuts),
    "block": _cut_anchor("block", "time", minmax_cuts),
    "pippy": _cut_anchor("pippy", "params", equal_size_cuts),
    "pytorch-auto": _problem_anchor("pytorch-auto"),
    "megatron": _problem_anchor("megatron"),
    "blind": _blind,
}


def anchor_solution(problem: Problem, name: str) -> Solution:
    """The plan anchor ``name`` makes for ``problem``, with its reference score."""
    if name not in ANCHORS:
        raise ValueError(f"unknown anchor {name!r}; expected one of {', '.join(ANCHORS)}")
    return ANCHORS[name](problem)
