"""``schedule="auto"`` and ``chunks="auto"``: one plan per candidate, the solvers' search picks.

For every (schedule, micro-batch count) of :func:`solvers.schedule_search.candidates`
this makes the plan a compile with exactly those arguments would make — the
partition solved for that schedule's memory model, its checkpointing chosen
(``checkpoint="auto"``), costs scaled to that micro-batch size
(:func:`fxpipe.cost.rescale.scaled_costs`) — and reports its simulated iteration
time (the schedule's own timeline, :func:`solvers.simulate.simulate_solution`) and
its predicted peak memory (:mod:`fxpipe.planning.memory_model`). The choice is
:func:`solvers.schedule_search.search`'s, which skips a candidate whose lower bound
(:func:`solvers.schedule_search.lower_bound`, from the summed node costs at its micro-batch size) is above the
best plan found; the table of what was tried goes into ``plan.solver["search"]`` and :meth:`fxpipe.Plan.summary`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import solvers
from fxpipe.cost.rescale import NODE_OVERHEAD_S, scaled_costs
from fxpipe.errors import InfeasiblePlanError
from fxpipe.planning.lowering import solver_order
from fxpipe.planning.memory_model import predict_worker_memory
from fxpipe.planning.plan import Plan
from fxpipe.planning.planner import Planner
from solvers.schedule_search import Candidate, Trial, candidates, lower_bound, search
from solvers.schedules import SCHEDULES, stages_per_worker
from solvers.simulate import simulate_solution

__all__ = ["AutoChoice", "plan_auto", "search_rows"]


@dataclass
class AutoChoice:
    plan: Plan
    planner: Planner                 # the chosen candidate's: calibration re-plans with it
    costs: dict[str, Any]            # the costs at the chosen micro-batch size
    trials: list[Trial]
    best: Trial


def plan_auto(base: Planner, costs: dict[str, Any], profiled_chunks: int, counts: Sequence[int],
              schedules: Sequence[str] = SCHEDULES, virtual_stages: int = 2,
              overhead_s: float = NODE_OVERHEAD_S, tolerance: float = 0.0) -> AutoChoice:
    """The best plan over ``schedules`` × ``counts`` micro-batches. ``base`` is the planner of one stage per
    device; ``costs`` were profiled on micro-batches of the batch cut in ``profiled_chunks``; ``overhead_s`` is
    a node's forward time that does not scale with the micro-batch (:func:`fxpipe.cost.rescale.scaled_costs`);
    ``tolerance``: the relative noise of measured costs, within which plans count as equally fast
    (:func:`solvers.schedule_search.search`)."""
    workers = len(base.devices)
    made: dict[Candidate, tuple[Planner, dict[str, Any]]] = {}
    solved: dict[tuple[str, int, bool], Any] = {}   # shared by the candidates' planners
    scaled_at: dict[int, dict[str, Any]] = {}       # the costs at each micro-batch count
    in_problem = [n.name for n in solver_order(base.gm)]
    speeds = list(base.speeds) if base.speeds is not None else [1.0] * workers

    def at(chunks: int) -> dict[str, Any]:
        if chunks not in scaled_at:
            scaled_at[chunks] = scaled_costs(costs, profiled_chunks, chunks, overhead_s)
        return scaled_at[chunks]

    def bound(cand: Candidate) -> float:
        scaled = at(cand.micro_batches)
        return lower_bound(cand.schedule, cand.micro_batches, sum(scaled[n].fwd_s for n in in_problem),
                           sum(scaled[n].bwd_s for n in in_problem), speeds)

    def evaluate(cand: Candidate) -> Trial:
        v = stages_per_worker(cand.schedule, virtual_stages)
        planner = dataclasses.replace(base, schedule=cand.schedule, chunks=cand.micro_batches, virtual_stages=v,
                                      solved=solved)
        scaled = at(cand.micro_batches)
        try:
            plan = planner.plan(scaled)
        except InfeasiblePlanError as exc:
            raise solvers.InfeasibleError(str(exc), min_peak_bytes=exc.min_peak_bytes) from exc
        except ValueError as exc:
            if v == 1 or len(schedules) == 1:   # the user's own stages= or schedule=: their error to see
                raise
            # the search's own shape (v stages per device) this graph cannot have: not a candidate
            raise solvers.InfeasibleError(str(exc), min_peak_bytes=math.nan) from exc
        problem = solvers.Problem.from_dict(plan.problem)
        solution = solvers.Solution([solvers.Stage(list(st.nodes), list(devs)) for st, devs
                                     in zip(plan.stages, plan.solver["stage_devices"])])
        simulated = simulate_solution(problem, solution, cand.schedule, workers=plan.workers,
                                      recompute_share=plan.predicted.get("recompute_share", 0.0))
        plan.predicted["iteration_s"] = simulated.iteration_s
        plan.predicted["throughput_samples_per_s"] = plan.batch_size / simulated.iteration_s
        predicted = predict_worker_memory(plan)
        peak = max(w.peak_bytes for w in predicted)
        over = [(w.worker, w.peak_bytes) for w in predicted if w.peak_bytes > planner.memory_bytes[w.worker]]
        if over:   # the partition fits the solver's per-stage model but not the schedule walked per worker
            w, need = over[0]
            raise solvers.InfeasibleError(f"worker {w} is predicted to peak at {need / 2**20:.1f} MiB and has "
                                          f"{planner.memory_bytes[w] / 2**20:.1f} MiB", min_peak_bytes=need)
        made[cand] = (planner, scaled)
        modes = sorted({st.checkpoint for st in plan.stages if st.checkpoint}) or [plan.checkpoint]
        return Trial(cand, simulated.iteration_s, peak, ",".join(modes), True, result=plan)

    try:
        best, trials = search(candidates(workers, counts, schedules, virtual_stages, stages=base.stages), evaluate,
                              bound, tolerance)
    except solvers.InfeasibleError as exc:
        raise InfeasiblePlanError(str(exc), exc.min_peak_bytes) from exc
    planner, scaled = made[best.candidate]
    planner = dataclasses.replace(planner, solved=None)   # re-plans (calibration) have other costs: solve them
    return AutoChoice(best.result, planner, scaled, trials, best)


def search_rows(trials: Sequence[Trial], best: Trial | None = None) -> list[dict[str, Any]]:
    """The trials as plan data (``plan.solver["search"]``), for the summary and the saved plan."""
    return [{"schedule": t.candidate.schedule, "chunks": t.candidate.micro_batches, "checkpoint": t.checkpoint,
             "iteration_s": t.iteration_s if t.feasible else None, "peak_bytes": t.peak_bytes if t.feasible else None,
             "feasible": None if t.skipped else t.feasible, "chosen": t is best, "lower_bound_s": t.lower_bound_s,
             **({} if t.feasible else {"why": t.note})}
            for t in trials]
