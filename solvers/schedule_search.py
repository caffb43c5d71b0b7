"""The search behind ``schedule="auto"`` and ``chunks="auto"``: every schedule × micro-batch count, judged
by the simulator.

The caller (fxpipe's planner) knows how to make a plan for one candidate — a
partition solved exactly for that schedule's memory model at that micro-batch
size, its checkpointing chosen — and reports its simulated iteration time
(:mod:`solvers.simulate`: each schedule's real bubble, its transfers, ZB-H1's and
ZB-V's split backward, interleaving's extra hops) and predicted peak memory. This
module says which candidates there are, evaluates them all (the grid is small:
five schedules × ``log2`` of the batch) and picks the fastest feasible one, ties
going to fewer micro-batches (less per-micro-batch overhead not modelled) and then
to the simpler schedule (the order of :data:`solvers.schedules.SCHEDULES`).

The search is a branch and bound over the candidates: :func:`lower_bound` says, from the whole model's
forward and backward time at a candidate's micro-batch size, a time no plan of that candidate can beat (its
work spread perfectly over the workers, one micro-batch's path through every stage, and GPipe's and 1F1B's
fill and drain). Candidates are solved from the smallest bound up, and one whose bound is above the best plan
found is not solved: it could not be chosen. An 8B-parameter model on 8 GPUs solves 5 of its 14 candidates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from solvers.errors import InfeasibleError
from solvers.problem import Problem
from solvers.score import score
from solvers.solution import Solution
from solvers.schedules import REGISTRY, SCHEDULES, check_schedule, get_schedule

__all__ = ["Candidate", "Trial", "chunk_choices", "candidates", "lower_bound", "search", "format_trials",
           "reuse"]

# the schedule whose memory model holds at most as many micro-batches on every stage: 1F1B's p - s is at most
# ZB-H1's p and GPipe's m, and the reference score's time does not depend on the schedule


@dataclass(frozen=True)
class Candidate:
    schedule: str
    micro_batches: int


@dataclass
class Trial:
    candidate: Candidate
    iteration_s: float           # simulated; inf when infeasible
    peak_bytes: float            # the largest worker's predicted peak (0 when infeasible)
    checkpoint: str              # the checkpointing the plan chose ("" when infeasible)
    feasible: bool
    note: str = ""               # why it is infeasible, or why it was not solved
    result: Any = None           # the caller's plan
    lower_bound_s: float = 0.0   # no plan of this candidate is faster (:func:`lower_bound`)
    skipped: bool = False        # not solved: its lower bound is above the best plan found


def chunk_choices(batch: int, workers: int, most: int | None = None) -> list[int]:
    """Micro-batch counts to try for a batch of ``batch`` samples: powers of two up to ``most`` (default
    ``4 x workers``, at most the batch: every micro-batch keeps a sample), and ``most`` itself."""
    top = max(1, min(batch, 4 * workers if most is None else most))
    counts = {top}
    k = 1
    while k < top:
        counts.add(k)
        k *= 2
    return sorted(counts)


def candidates(workers: int, counts: Sequence[int], schedules: Sequence[str] = SCHEDULES,
               virtual_stages: int = 2, stages: int | None = None) -> list[Candidate]:
    """Every (schedule, micro-batch count) that can run on ``workers`` workers: shapes a schedule cannot run
    (interleaved with a count that is not a multiple of the workers, several stages per worker on one
    worker, or a fixed ``stages`` the schedule cannot have) are left out."""
    out = []
    # the looser memory model first (its plan may be reused, :func:`reuse`); the choice's ties use SCHEDULES
    looser = {r.looser for r in REGISTRY.values()}
    for schedule in sorted(schedules, key=lambda s: s not in looser):
        record = get_schedule(schedule)
        v = record.stages_per_worker(virtual_stages)
        if record.multi_stage and (workers < 2 or (stages is not None and stages != v * workers)):
            continue   # on one worker it is a single-worker schedule with more hand-overs
        for m in counts:
            if m == 1 and not record.single_batch:   # one micro-batch: every schedule runs the stages in turn
                continue
            try:
                check_schedule(schedule, v * workers, workers, m)
            except ValueError:
                continue
            out.append(Candidate(schedule, m))
    return out


def lower_bound(schedule: str, micro_batches: int, forward_s: float, backward_s: float,
                speeds: Sequence[float]) -> float:
    """A time no plan of ``schedule`` with ``micro_batches`` micro-batches beats, as :mod:`solvers.simulate` times
    it. ``forward_s``/``backward_s``: the whole model's times for one micro-batch at speed 1 (the sum of every
    node's, recomputation left out); ``speeds``: the workers' (one device per stage).

    With ``T`` the whole model's time for one micro-batch, ``S`` the sum of the speeds and ``v`` the fastest:
    every worker's operations run one at a time, so some worker is busy ``m T / S``; one micro-batch's forwards
    and input-gradient backwards run in turn through every stage (a split backward defers at most half its
    time to ``W``: :func:`solvers.simulate.weight_shares`). Under GPipe and 1F1B, whose stages are one per
    worker and whose backward is whole, stage ``s`` (time ``t_s`` per micro-batch) starts after one forward
    through the stages before it, runs ``m`` forwards and backwards, and its last backward then passes those
    stages again: the iteration is at least ``max_s (sum_{j<s} t_j + m t_s)``. Over every split of ``T`` that
    maximum is least when all its terms are equal, ``t_s = (C / m) r^s`` with ``r = (m - 1) / m``, the fastest
    workers first: ``C = m T / sum_s v_s r^s`` (speeds in decreasing order; ``T / (1 - r^p)`` for ``p`` equal
    workers of speed 1). Transfers and recomputation only add time."""
    if micro_batches < 1 or not speeds or min(speeds) <= 0:
        raise ValueError(f"need micro_batches >= 1 and positive speeds, got {micro_batches} and {list(speeds)}")
    m, total, fastest = micro_batches, forward_s + backward_s, max(speeds)
    everyone = sum(speeds)
    record = get_schedule(schedule)
    deferred = 0.5 if record.split_backward else 0.0
    bound = max(m * total / everyone, (forward_s + (1.0 - deferred) * backward_s) / fastest)
    if record.fill_drain:
        r = (m - 1) / m
        bound = max(bound, m * total / sum(v * r ** s for s, v in enumerate(sorted(speeds, reverse=True))))
    return bound


def search(cands: Sequence[Candidate], evaluate: Callable[[Candidate], Trial],
           bound: Callable[[Candidate], float] | None = None, tolerance: float = 0.0) -> tuple[Trial, list[Trial]]:
    """Evaluate the candidates; return the best feasible trial and one trial per candidate, in ``cands``' order.

    ``tolerance``: times within that fraction of the fastest are taken as equal (the noise of measured costs),
    and among them the fewest micro-batches (the least per-micro-batch overhead), then the first schedule of
    :data:`SCHEDULES`, is chosen, so plans whose costs differ by noise resolve the same way on every run (0: the
    fastest, ties broken alike).

    ``evaluate`` returns a :class:`Trial` or raises :class:`solvers.InfeasibleError` or ``MemoryError``
    (recorded as infeasible with the message). With ``bound`` (a candidate's :func:`lower_bound`) they are
    evaluated from the smallest bound up, and one whose bound is above the best feasible time found is
    skipped (a trial with ``skipped`` set): it cannot be chosen. Raises ``InfeasibleError`` listing why when
    none fits.
    """
    bounds = {c: (bound(c) if bound is not None else 0.0) for c in cands}
    done: dict[Candidate, Trial] = {}
    least = math.inf   # the smallest peak any candidate needed, for the error
    best_s = math.inf
    for cand in sorted(cands, key=lambda c: bounds[c]):   # stable: ties keep the looser schedule first
        if bounds[cand] > best_s * (1 + tolerance + 1e-9):
            done[cand] = Trial(cand, math.inf, 0.0, "", False, f"not solved: at least {bounds[cand] * 1e3:.4g} "
                               f"ms, above the best, {best_s * 1e3:.4g} ms",
                               lower_bound_s=bounds[cand], skipped=True)
            continue
        started = time.perf_counter()
        try:
            trial = evaluate(cand)
        except (InfeasibleError, MemoryError) as exc:
            trial = Trial(cand, math.inf, 0.0, "", False, str(exc).split("\n")[0])
            need = getattr(exc, "min_peak_bytes", None)
            least = min(least, need) if isinstance(need, (int, float)) and math.isfinite(need) else least
        trial.note = trial.note or f"{time.perf_counter() - started:.3f} s"
        trial.lower_bound_s = bounds[cand]
        done[cand] = trial
        if trial.feasible:
            best_s = min(best_s, trial.iteration_s)
    trials = [done[c] for c in cands]
    feasible = [t for t in trials if t.feasible]
    if not feasible:
        reasons = "; ".join(f"{t.candidate.schedule} x{t.candidate.micro_batches}: {t.note}" for t in trials[-2:])
        raise InfeasibleError(f"no schedule and micro-batch count fits in memory; with the most micro-batches: "
                              f"{reasons}", min_peak_bytes=least if math.isfinite(least) else math.nan)
    rank = {s: k for k, s in enumerate(SCHEDULES)}
    fastest = min(t.iteration_s for t in feasible)
    near = [t for t in feasible if t.iteration_s <= fastest * (1 + tolerance)]
    return min(near, key=lambda t: (t.candidate.micro_batches, rank[t.candidate.schedule], t.iteration_s)), trials


def reuse(problem: Problem, looser: Solution | None) -> Solution | None:
    """``looser`` — the exact solution of the same problem under the looser schedule's memory model
    (:attr:`solvers.schedules.Schedule.looser`) —
    if it fits ``problem``'s memory too: then it is optimal for ``problem`` as well (same objective, a feasible
    set that contains ``problem``'s), with the same certificate. ``None`` when it does not fit."""
    if looser is None:
        return None
    found = score(problem, looser)
    if not found.feasible:
        return None
    out = Solution([s for s in looser.stages], solver=dict(looser.solver))
    out.predicted = found.as_predicted()
    return out


def format_trials(trials: Sequence[Trial], best: Trial | None = None) -> list[str]:
    """The trials as table rows (schedule, chunks, checkpoint, predicted time, peak memory, feasible), the
    chosen one marked ``*``."""
    lines = ["  schedule          chunks  checkpoint      iteration ms  peak MiB  feasible",
             "  ----------------  ------  --------------  ------------  --------  --------"]
    for t in trials:
        mark = "*" if t is best else " "
        it = f"{t.iteration_s * 1e3:12.3f}" if math.isfinite(t.iteration_s) else f"{'-':>12s}"
        peak = f"{t.peak_bytes / 2**20:8.1f}" if t.feasible else f"{'-':>8s}"
        said = "yes" if t.feasible else t.note if t.skipped else "no: " + t.note
        lines.append(f"{mark} {t.candidate.schedule:16s}  {t.candidate.micro_batches:6d}  {t.checkpoint or '-':14s}  "
                     f"{it}  {peak}  {said}")
    return lines
