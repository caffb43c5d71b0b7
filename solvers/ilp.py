"""Integer programme (PuLP + HiGHS) over every convex partition of a DAG.

Where the DP cuts one topological order into contiguous pieces, this model
lets each node take any stage as long as every edge goes to the same or a
later stage, so parallel branches (Inception-style) can be split side by side.
Stage ``s`` runs on device ``devices[s]`` (the DP chooses the placement; the
ILP is warm-started from the DP's plan).

Variables, for a fixed number of stages ``p``:

* ``x[v, s]`` binary: node ``v`` in stage ``s`` (each node in one stage, each
  stage non-empty, cumulative precedence ``sum_{t<=s} x[w,t] <= sum_{t<=s} x[u,t]``
  for every edge ``u -> w``);
* ``r[u, b, k]`` binary: stage ``b`` receives ``u``'s tensor at byte level ``k``
  or more (the reference score sends one tensor per receiving stage, sized by
  the largest edge into it: levels make that maximum linear);
* ``q[u, a, b, k]`` in [0, 1]: ``x[u, a] AND r[u, b, k]``, which prices the
  transfer by the link ``a -> b``;
* ``t_s`` the stage times and ``M >= t_s``; objective ``sum t_s + (m - 1) M``,
  with the schedule-aware memory limit per stage. This is exactly the
  reference score of ``fxpipe-problem/1``.

HiGHS reports the incumbent, its dual bound and the gap; a time limit bounds the solve.
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pulp

from solvers.certificate import TOL, certify
from solvers.dp.tables import device_classes
from solvers.errors import InfeasibleError, SolverError
from solvers.problem import Problem
from solvers.score import score_assignment, transfer_cost_s
from solvers.solution import Solution, Stage

__all__ = ["GAP_REL", "PlacementRun", "run_placement", "solve_ilp", "ilp_available"]

GAP_REL = 1e-8
"""HiGHS stops when incumbent and bound are this close (its default, 1e-4, would certify 0.01 % off)."""


def ilp_available() -> bool:
    return "HiGHS" in pulp.listSolvers(onlyAvailable=True)


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what C code writes to stdout to stderr: HiGHS prints its banner on the first
    ``Highs()`` of a process, before any option can silence it, and stdout carries the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


HIGHS_TIME_SHARE = 0.85
"""Of the time left to a solve when HiGHS starts, the least HiGHS itself may run (see :class:`_WarmHiGHS`)."""

READ_BACK_S = (0.2, 2e-5)
"""What a model of ``c`` columns keeps back from HiGHS, at most, for HiGHS's last node past its limit and pulp's
reading: ``0.2 s + 2e-5 s x c`` (measured: 0.05 s after HiGHS for 9 135 columns, 0.19 s for 30 203; a 24-layer
transformer x 8 stages ran 0.5 s past its limit, then 0.5 s reading). A share alone kept 1.3 s of a 10 s solve
back from 9 135 columns, and GPT-24 over 4 NVLink GPUs, whose ILP needs about 7.6 s, was certified or not by chance."""


class _WarmHiGHS(pulp.HiGHS):
    """pulp's HiGHS, silent on stdout, with the variables' initial values passed as a MIP start.

    ``deadline`` (a ``time.perf_counter()`` instant) sets HiGHS's time limit when it starts running, not
    when the solver object is made: pulp passes the model to HiGHS first, which takes seconds for a large
    one, and a limit set before that would let the whole solve run past the deadline by as long. HiGHS
    gets what is left but a margin for its last node and the reading back (:data:`READ_BACK_S`, at most
    :data:`HIGHS_TIME_SHARE` of what is left): it checks its clock between nodes of the branch and
    bound, and pulp then reads the solution back (on a 24-layer transformer x 8 stages: 0.5 s past its
    limit, then 0.5 s reading)."""

    def __init__(self, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def createAndConfigureSolver(self, lp: pulp.LpProblem) -> None:
        with _stdout_to_stderr():
            super().createAndConfigureSolver(lp)

    def callSolver(self, lp: pulp.LpProblem) -> None:
        import highspy

        variables = lp.variables()
        if all(v.varValue is not None for v in variables):
            start = highspy.HighsSolution()
            start.col_value = [float(v.varValue) for v in variables]
            start.value_valid = True
            lp.solverModel.setSolution(start)
        left = self.deadline - time.perf_counter()
        keep = min((1.0 - HIGHS_TIME_SHARE) * left, READ_BACK_S[0] + READ_BACK_S[1] * lp.solverModel.getNumCol())
        lp.solverModel.setOptionValue("time_limit", max(1e-3, left - keep))
        lp.solverModel.run()


class _OutOfTime(Exception):
    """Building the model ran past the deadline (a large model takes seconds in pulp)."""


def _model(problem: Problem, p: int, devices: list[int], start: dict[str, int] | None,
           cutoff: float | None = None, deadline: float = math.inf):
    nodes = problem.node_map()
    ids = problem.order
    m = problem.micro_batches
    factor = 1.0 + problem.optimizer_state_factor
    lp = pulp.LpProblem("fxpipe_partition", pulp.LpMinimize)
    x = {(v, s): lp.add_variable(f"x_{i}_{s}", cat="Binary") for i, v in enumerate(ids) for s in range(p)}
    for v in ids:
        lp += pulp.lpSum(x[v, s] for s in range(p)) == 1
    for s in range(p):
        lp += pulp.lpSum(x[v, s] for v in ids) >= 1
    consumers: dict[str, dict[str, float]] = {}
    for i, e in enumerate(problem.edges):
        if i % 64 == 0 and time.perf_counter() > deadline:
            raise _OutOfTime
        for s in range(p - 1):
            lp += (pulp.lpSum(x[e.dst, t] for t in range(s + 1))
                   <= pulp.lpSum(x[e.src, t] for t in range(s + 1)))
        byw = consumers.setdefault(e.src, {})
        byw[e.dst] = max(byw.get(e.dst, 0.0), e.bytes)
    # Transfers, priced per byte level so that the largest edge into a stage sets the size.
    out_cost = {s: [] for s in range(p)}
    in_cost = {s: [] for s in range(p)}
    r_vars: dict[tuple, pulp.LpVariable] = {}
    q_vars: dict[tuple, pulp.LpVariable] = {}
    index = {v: i for i, v in enumerate(ids)}
    levels_of = {u: sorted(set(byw.values())) for u, byw in consumers.items()}
    for u, byw in consumers.items():
        if time.perf_counter() > deadline:
            raise _OutOfTime
        levels = levels_of[u]
        iu = index[u]
        for b in range(1, p):
            prev = 0.0
            for k, level in enumerate(levels):
                r = r_vars[u, b, k] = lp.add_variable(f"r_{iu}_{b}_{k}", cat="Binary")
                for w, nbytes in byw.items():
                    if nbytes >= level:
                        lp += r >= x[w, b] - x[u, b]
                for a in range(b):
                    da, db = devices[a], devices[b]
                    if k == 0:
                        c = transfer_cost_s(problem, level, da, db)
                    else:
                        c = (level - prev) / problem.bandwidth_Bps[da][db]
                    if c <= 0:
                        continue
                    q = q_vars[u, a, b, k] = lp.add_variable(f"q_{iu}_{a}_{b}_{k}", 0, 1)
                    lp += q >= x[u, a] + r - 1
                    out_cost[a].append(2.0 * c * q)
                    in_cost[b].append(2.0 * c * q)
                prev = level
    t = [lp.add_variable(f"t_{s}", 0) for s in range(p)]
    big = lp.add_variable("max_t", 0)
    for s in range(p):
        dev = problem.devices[devices[s]]
        compute = pulp.lpSum((nodes[v].fwd_s + nodes[v].bwd_s) / dev.speed * x[v, s] for v in ids)
        lp += t[s] == compute + pulp.lpSum(out_cost[s]) + pulp.lpSum(in_cost[s])
        lp += big >= t[s]
        inflight = problem.inflight(s, p)
        need = {v: nodes[v].param_bytes * factor + nodes[v].act_bytes * inflight for v in ids}
        # Written as a share of the device's memory (a row of bytes up to 1e9 or more beside seconds of
        # compute is badly scaled: HiGHS's presolve then returned a plan that broke the cutoff and called it a
        # solve error), and left out where even every node at once fits: it could never bind.
        if sum(need.values()) > dev.memory_bytes > 0:
            lp += pulp.lpSum(need[v] / dev.memory_bytes * x[v, s] for v in ids if need[v] > 0) <= 1.0
        elif dev.memory_bytes <= 0:   # no memory: only nodes that need none
            lp += pulp.lpSum(x[v, s] for v in ids if need[v] > 0) <= 0
    lp += pulp.lpSum(t) + (m - 1) * big
    if cutoff is not None and math.isfinite(cutoff):   # only plans better than the incumbent are wanted
        lp += pulp.lpSum(t) + (m - 1) * big <= cutoff
    if start is not None:
        _set_start(problem, p, devices, start, x, r_vars, q_vars, consumers, levels_of, t, big)
    return lp, x


def _set_start(problem, p, devices, start, x, r_vars, q_vars, consumers, levels_of, t, big) -> None:
    """Initial values of every variable from a feasible ``node -> stage`` map."""
    for (v, s), var in x.items():
        var.setInitialValue(1 if start[v] == s else 0)
    for (u, b, k), var in r_vars.items():
        level = levels_of[u][k]
        hit = start[u] != b and any(start[w] == b and nbytes >= level for w, nbytes in consumers[u].items())
        var.setInitialValue(1 if hit else 0)
    for (u, a, b, k), var in q_vars.items():
        var.setInitialValue(1 if start[u] == a and r_vars[u, b, k].varValue == 1 else 0)
    sc = score_assignment(problem, start, devices)
    for s in range(p):
        t[s].setInitialValue(sc.stage_s[s])
    big.setInitialValue(max(sc.stage_s))


@dataclass
class PlacementRun:
    stage_of: dict[str, int] | None   # best partition found (None: none, or none below the cutoff)
    lower_s: float                    # proven: no partition on this placement is faster (inf: none fits)
    finished: bool                    # the solve proved its answer (not stopped by the time limit)


def run_placement(problem: Problem, devices: list[int], time_limit_s: float,
                  start: dict[str, int] | None = None, cutoff: float | None = None) -> PlacementRun:
    """Best convex partition with stage ``s`` on ``devices[s]``, faster than ``cutoff`` if given.

    ``time_limit_s`` covers building the model as well as solving it."""
    p = len(devices)
    deadline = time.perf_counter() + time_limit_s
    try:
        lp, x = _model(problem, p, devices, start, cutoff, deadline)
    except _OutOfTime:
        return PlacementRun(None, 0.0, False)
    remaining = deadline - time.perf_counter()
    if remaining <= 0:
        return PlacementRun(None, 0.0, False)
    lp.solve(_WarmHiGHS(msg=False, gapRel=GAP_REL, gapAbs=0.0, deadline=deadline))
    status = str(lp.solverModel.getModelStatus())
    remaining = deadline - time.perf_counter()
    if status.endswith("kSolveError") and remaining > 0:
        # HiGHS 1.16's presolve can reduce a model to nothing and post-solve a point that breaks a row
        # (seen on the cutoff row of a model that no plan below the cutoff satisfies), then call it a
        # solve error; the same model without presolve is solved
        lp.solve(_WarmHiGHS(msg=False, gapRel=GAP_REL, gapAbs=0.0, presolve="off", deadline=deadline))
        status = str(lp.solverModel.getModelStatus())
    info: Any = lp.solverModel.getInfo()
    if status.endswith("kInfeasible"):   # nothing fits (or nothing beats the cutoff)
        return PlacementRun(None, cutoff if cutoff is not None and math.isfinite(cutoff) else math.inf, True)
    finished = status.endswith("kOptimal")
    bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else 0.0
    if info.primal_solution_status != 2:  # no feasible solution found in time
        return PlacementRun(None, bound, finished)
    stage_of = {v: max(range(p), key=lambda s, v=v: x[v, s].varValue or 0.0) for v in problem.order}
    return PlacementRun(stage_of, bound, finished)


def solve_ilp(problem: Problem, time_limit_s: float = 30.0, warm_start: Solution | None = None,
              devices: list[int] | None = None) -> Solution:
    """Best convex partition found within ``time_limit_s`` (optimal when the gap is 0).

    ``devices`` maps stage ``s`` to a device index (default: the warm start's
    mapping, else stage ``s`` on device ``s``).
    """
    if not ilp_available():
        raise SolverError("the ILP needs HiGHS: pip install highspy")
    started = time.perf_counter()
    device_index = {d.id: i for i, d in enumerate(problem.devices)}
    start_map = None
    if warm_start is not None:
        start_map = {n: s for s, st in enumerate(warm_start.stages) for n in st.nodes}
        if devices is None:
            devices = [device_index[st.devices[0]] for st in warm_start.stages]
    counts = [problem.stages] if problem.stages is not None else \
        list(range(1, min(len(problem.devices), len(problem.nodes)) + 1))
    best: tuple[float, dict[str, int], list[int]] | None = None
    lower = math.inf
    proven = True
    for p in counts:
        remaining = time_limit_s - (time.perf_counter() - started)
        if remaining <= 0:  # stage counts left untried: nothing bounds them
            proven = False
            lower = 0.0
            break
        stage_devices = devices if devices is not None and len(devices) == p else list(range(p))
        start = start_map if start_map is not None and len(warm_start.stages) == p else None
        run = run_placement(problem, stage_devices, remaining, start)
        proven = proven and run.finished
        lower = min(lower, run.lower_s)
        if run.stage_of is not None:
            sc = score_assignment(problem, run.stage_of, stage_devices)
            if sc.feasible and (best is None or sc.iteration_s < best[0]):
                best = (sc.iteration_s, run.stage_of, stage_devices)
    if best is None:
        if proven:
            placed = (f"stage s on device {[problem.devices[d].id for d in devices]}[s]" if devices is not None
                      else "stage s on device s")
            raise InfeasibleError(
                f"no convex partition with {placed} fits in memory; add devices "
                "or memory, or lower micro_batches/activation memory", min_peak_bytes=math.nan)
        raise InfeasibleError("the ILP found no feasible convex partition within its time limit of "
                              f"{time_limit_s} s; raise the time limit", min_peak_bytes=math.nan, proven=False)
    t_best, stage_of, stage_devices = best
    lower = min(lower, t_best)
    sc = score_assignment(problem, stage_of, stage_devices)
    stages = [Stage([v for v in problem.order if stage_of[v] == s], [problem.devices[stage_devices[s]].id])
              for s in range(len(stage_devices))]
    alike = len(device_classes(problem)) == 1   # then this placement is as good as any
    space = ("convex partitions of the DAG, any placement (all devices alike)" if alike else
             f"convex partitions of the DAG, stage s on device {[problem.devices[d].id for d in stage_devices]}[s]")
    return certify(problem, Solution(stages, sc.as_predicted(), {"time_limit_s": time_limit_s}),
                   method="ilp", started=started, exact_over=space,
                   covers_reference=alike and problem.max_replicas == 1,
                   space_optimal=proven and lower >= t_best * (1 - TOL), space_lower_s=lower)
