"""The search over meshes (pp × dp × tp), schedules, micro-batch counts, recomputation and stage cuts.

For every candidate (:func:`solvers.mesh_candidates.candidates`: each mesh shape of :func:`solvers.mesh.mesh_shapes`, each schedule
it can run, each micro-batch count that divides a dp replica's samples — powers of two and the whole local
batch — without recomputation, and with each stage in the fastest recomputation mode that fits its memory
(:func:`solvers.mesh_candidates.modes`: the whole stage, each repeated block, every other block, or selectively, as
:mod:`fxpipe.runtime.backward.block_recompute` runs them and the node-level costing chooses them per stage) — the step is
screened by a closed form of the
schedule's timeline in the bottleneck stage time ``τ`` (the largest per-micro-batch forward + backward +
pipeline transfers of the ``pp × v`` stages):

* ``gpipe``, ``1f1b``: ``(m + p - 1) τ``; ``interleaved-1f1b``: ``(v m + p - 1) τ`` (Narayanan et al. 2021);
* ``zb-h1``: ``(m + (p - 1) ρ) τ``; ``zb-v``: ``(2 m + (p - 1) ρ) τ``, with ``ρ = (F + B - W) / (F + B + W)``
  over the model (Qi et al. 2023: the bubble is ``(p - 1)(F + B - W)``),

plus data parallel's all-gather and gradient sync of the average device's parameters, charged whole. The
closed form is increasing in ``τ`` and otherwise independent of the cuts (the zero-bubble forms' ``ρ`` is taken
without recomputation), so the cuts that minimise ``τ`` under each stage's memory (:func:`min_max_cuts`, an exact
dynamic program over contiguous cuts and each stage's mode, vectorised) minimise it: the search is exact for
the screening model, which ``tests/test_mesh_search.py`` checks against :func:`solvers.brute.brute_force_mesh`
(every mesh, candidate and cut).

Inside a shape the candidates are solved in the order of a lower bound on their step (the closed form at
the larger of the slowest piece and the average stage), until the bound reaches the best step found
(branch and bound: exact, and a few dynamic programs per shape instead of every candidate's); a shape
whose parameters, gradients and optimizer state alone exceed its devices' memory is not searched.

The best candidate of each of the fastest mesh shapes is then simulated (:func:`solvers.simulate.simulate`: the schedule's
own timeline, the pipeline's transfers on their links, data parallel's sync after each device's last
backward, overlapping the drain, and its all-gather before the first forward: :data:`SIMULATE_MOST`,
:data:`SIMULATE_MARGIN`); the mesh whose simulated step is fastest is the choice, the other shapes keep their
closed form's step. Screening every candidate by simulation would cost 15-130 ms each (hundreds of
candidates at 64 devices); the closed form costs microseconds after the cuts.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from solvers.errors import InfeasibleError
from solvers.layout import Layout
from solvers.mesh import MeshProblem, StageFigures, budget, dp_sync_s, mesh_shapes, owner, state_bytes, \
    stage_held
from solvers.mesh_candidates import (Candidate, Mode, as_chosen, candidates, figures, no_candidate,
                                     recompute_options, stage_memory)
from solvers.schedules import get_schedule, stages_per_worker
from solvers.mesh_cuts import broadcast_s as _broadcast_s, min_max_cuts
from solvers.mesh_simulate import least_simulated_s, simulate_choice

SIMULATE_MOST = 6
"""Shapes simulated at most (the fastest by the closed form first): a simulation of 64 micro-batches over 16
stages takes seconds in Python, the closed form microseconds."""
SIMULATE_MARGIN = 0.05
"""A shape is simulated while its closed-form step is within this share of the fastest simulated step: the
closed form and the simulation differ by the transfers' overlap and uneven stages, a few per cent on the
Llama shapes of ``benchmarks/scale.py``."""

__all__ = ["Candidate", "MeshChoice", "MeshSearch", "choice_layout", "candidates", "evaluate_cuts", "least_simulated_s", "least_step_s", "min_max_cuts",
           "recompute_options", "search_mesh", "simulate_choice"]


@dataclass
class MeshChoice:
    """One candidate with its cuts and predicted step."""

    candidate: Candidate
    samples: int                  # per micro-batch
    cuts: list[int]               # stage s holds pieces cuts[s] .. cuts[s + 1] - 1
    screened_s: float             # the closed form's step
    iteration_s: float            # simulated (the shapes' bests), else the closed form's
    stage_s: list[float]          # per micro-batch
    peak_bytes: list[float]       # per device of the pipeline
    sync_s: tuple[float, float] = (0.0, 0.0)   # data parallel's (before, after) of the first device
    pipeline_s: float = 0.0       # simulated: the last forward or backward's end (without the dp sync)
    bubble: float = 0.0           # idle share of the pipeline's devices' step
    simulated: bool = False
    stage_modes: list[Mode] = field(default_factory=list)   # each stage's recomputation (:func:`modes`)

    @property
    def mesh(self) -> Layout:
        return self.candidate.mesh

    @property
    def recomputation(self) -> str:
        """The stages' modes, sorted and joined (``"never,selective"``), or the candidate's where unrecorded."""
        return ",".join(sorted(set(self.stage_modes))) or self.candidate.recomputation


def choice_layout(choice: MeshChoice, problem: MeshProblem) -> Layout:
    """``choice`` as the run's layout (:class:`solvers.layout.Layout`): its mesh shape with ``problem``'s sequence
    parallelism, the schedule with its stages per device, and each stage's recomputation."""
    m, schedule = choice.mesh, choice.candidate.schedule
    return dataclasses.replace(
        m, sequence_parallel=problem.sequence_parallel if m.tp > 1 else None, schedule=schedule,
        virtual_stages=stages_per_worker(schedule, problem.virtual_stages) if m.pp > 1 else 1,
        recomputation=tuple(choice.stage_modes))


@dataclass
class MeshSearch:
    best: MeshChoice
    shapes: list[MeshChoice]                        # the best of every mesh shape that fits, fastest first
    infeasible: dict[Layout, str] = field(default_factory=dict)   # shape -> why nothing fits
    tried: int = 0
    time_s: float = 0.0


def _closed_form(problem: MeshProblem, cand: Candidate, fig: StageFigures, tau: float) -> float:
    p, m = cand.mesh.pp, cand.micro_batches
    if p == 1:
        return m * tau
    record = get_schedule(cand.schedule)
    f, b, w = sum(fig.fwd_s), sum(fig.bwd_s), sum(fig.weight_s)
    rho = max(0.0, f + b - 2 * w) / (f + b) if f + b > 0 else 0.0
    return record.step_units(p, m, record.stages_per_worker(problem.virtual_stages), rho) * tau


def _screen_sync(problem: MeshProblem, cand: Candidate, fig: StageFigures) -> tuple[float, float]:
    """Data parallel's exposed sync before the cuts are known: a device's share of the parameters, of which its
    share of the root's and one block are gathered before its first forward (:func:`solvers.mesh.gathered_first`)."""
    blocks = [b for b, piece in zip(fig.param_bytes, problem.pieces) if piece.block]
    root = sum(fig.param_bytes) - sum(blocks)
    first = root / cand.mesh.pp + max(blocks, default=0.0)
    before, after = dp_sync_s(problem, cand.mesh, sum(fig.param_bytes) / cand.mesh.pp, first)
    # the blocks' reduce-scatters overlap the backward
    if cand.mesh.dp_mode == "shard" and not get_schedule(cand.schedule).split_backward:
        after = dp_sync_s(problem, cand.mesh, first)[1]
    return before, after


def evaluate_cuts(problem: MeshProblem, cand: Candidate, cuts: list[int],
                  figs: list[tuple[Mode, StageFigures]] | None = None) -> MeshChoice | None:
    """``cand`` with stages ``cuts`` under the screening model, each stage in the fastest of ``cand``'s modes that
    fits its memory; ``None`` when a stage fits in none."""
    samples = problem.batch // (cand.mesh.dp * cand.micro_batches)
    figs = figs or figures(problem, cand, samples)
    k, room = budget(problem, cand.schedule, cand.mesh.pp)
    L = len(problem.pieces)
    limit = room * (1 + 1e-12)
    stage_s, memory, chosen = [], [], []
    for j, (a, i) in enumerate(zip(cuts, cuts[1:])):
        held = stage_held(cand.schedule, j, k, cand.micro_batches)
        fitting = []
        for x, (mode, fig) in enumerate(figs):
            comm = 2 * ((fig.cut_s[a - 1] if a > 0 else 0.0) + (fig.cut_s[i - 1] if i < L else 0.0)) \
                + _broadcast_s(fig, a, k)
            mb = stage_memory(mode, fig, held, a, i)
            if mb <= limit:
                fitting.append((sum(fig.fwd_s[a:i]) + sum(fig.bwd_s[a:i]) + comm, x, mb))
        if not fitting:
            return None
        t, x, mb = min(fitting)
        stage_s.append(t), memory.append(mb), chosen.append(x)
    fig = as_chosen(figs, cuts, chosen)
    sync = _screen_sync(problem, cand, fig)
    # the zero-bubble forms' share rho from the first mode's figures (per stage: none recomputing), so the step
    # depends on the cuts through tau alone and the least tau is the least step
    step = _closed_form(problem, cand, figs[0][1], max(stage_s)) + sum(sync)
    peaks = [0.0] * cand.mesh.pp
    for j, mb in enumerate(memory):
        peaks[owner(cand.schedule, j, cand.mesh.pp)] += mb
    return MeshChoice(cand, samples, list(cuts), step, step, stage_s, peaks, sync,
                      stage_modes=[figs[x][0] for x in chosen])


def solve_candidate(problem: MeshProblem, cand: Candidate,
                    figs: list[tuple[Mode, StageFigures]], memo: dict | None = None) -> MeshChoice | None:
    """The screening model's best cuts of ``cand`` and their step; ``None`` when nothing fits (``memo``: as
    :func:`min_max_cuts`)."""
    k, room = budget(problem, cand.schedule, cand.mesh.pp)
    held = [stage_held(cand.schedule, j, k, cand.micro_batches) for j in range(k)]
    cuts = min_max_cuts(figs, k, room, held, memo)
    return None if cuts is None else evaluate_cuts(problem, cand, cuts, figs)


def search_mesh(problem: MeshProblem) -> MeshSearch:
    """The best mesh, schedule, micro-batches, recomputation and cuts, and the best of every other shape.

    Raises :class:`solvers.InfeasibleError` when no candidate fits memory on any mesh."""
    started = time.perf_counter()
    best_of: dict[Layout, MeshChoice] = {}
    why: dict[Layout, str] = {}
    cache: dict[tuple[Layout, int, str, bool], StageFigures] = {}   # figures' cache
    by_mesh: dict[Layout, list[Candidate]] = {}
    for cand in candidates(problem):
        by_mesh.setdefault(cand.mesh, []).append(cand)
    for mesh in mesh_shapes(problem):
        why[mesh] = "no schedule, micro-batch count or recomputation fits memory"
    tried = 0
    for mesh, cands in by_mesh.items():
        options = recompute_options()
        memo: dict = {}   # min_max_cuts' segments and costs, for this shape's candidates
        # every device of the pipeline holds its stages' parameters, gradients and optimizer state: on average
        # their sum / pp, and the fullest at least that
        if sum(state_bytes(problem, mesh, 1)) / mesh.pp > problem.memory_bytes:
            why[mesh] = "parameters, gradients and optimizer state alone exceed a device's memory"
            continue
        # branch and bound inside the shape: a candidate's step is at least its closed form at the bottleneck's
        # lower bound (:func:`_least_tau`); candidates are solved from the least bound up, until the bound reaches
        # the best step found
        bounded = []
        for cand in cands:
            samples = problem.batch // (mesh.dp * cand.micro_batches)
            for option in options:
                c = Candidate(mesh, cand.schedule, cand.micro_batches, *option)
                figs = figures(problem, c, samples, cache)
                bound = min(_closed_form(problem, c, fig, _least_tau(problem, c, fig)) for _, fig in figs) \
                    + sum(_screen_sync(problem, c, figs[0][1]))
                bounded.append((bound, c.micro_batches, *option, c, figs))
        bounded.sort(key=lambda b: b[:5])
        best: MeshChoice | None = None
        for bound, _, _, _, _, c, figs in bounded:
            if best is not None and bound >= best.screened_s:
                break
            tried += 1
            found = solve_candidate(problem, c, figs, memo)
            if found is not None and (best is None or _rank(found) < _rank(best)):
                best = found
        if best is not None:
            best_of[mesh] = best
    if not by_mesh:   # not memory: no schedule and micro-batch count runs on any shape at all
        raise InfeasibleError("no schedule runs on " + "; ".join(
            f"{mesh.label()} ({no_candidate(problem, mesh)})" for mesh in mesh_shapes(problem)))
    if not best_of:
        least = min((sum(state_bytes(problem, m, 1)) / m.pp for m in why), default=math.nan)
        raise InfeasibleError(
            f"no mesh of {problem.world} devices fits memory with any schedule, micro-batch count or recomputation "
            f"({len(why)} shapes tried): parameters, gradients and optimizer state alone need "
            f"{least / 2**30:.1f} GiB a device on the best shape, before activations, of "
            f"{problem.memory_bytes / 2**30:.1f} GiB; add devices or memory, use an optimizer that keeps less, or "
            "train a smaller batch or shorter sequences", min_peak_bytes=least)
    screened = sorted(best_of.values(), key=lambda c: (c.screened_s, *_simpler(c)[1:]))
    shapes, fastest = [], math.inf
    for c in screened:   # simulated while within SIMULATE_MARGIN of the fastest simulated step, at most SIMULATE_MOST
        simulate_it = len(shapes) < SIMULATE_MOST and c.screened_s <= fastest * (1 + SIMULATE_MARGIN)
        shapes.append(simulate_choice(problem, c) if simulate_it else _estimated(c))
        if simulate_it:
            fastest = min(fastest, shapes[-1].iteration_s)
    shapes.sort(key=lambda c: (not c.simulated, *_simpler(c)))
    for mesh in best_of:
        why.pop(mesh, None)
    return MeshSearch(shapes[0], shapes, why, tried, time.perf_counter() - started)


def _estimated(c: MeshChoice) -> MeshChoice:
    """A shape left unsimulated: its closed form's step and bubble (the idle share of the closed form's
    pipeline)."""
    p, m = c.mesh.pp, c.candidate.micro_batches
    pipe = c.screened_s - sum(c.sync_s)
    work = sum(c.stage_s) * m / p
    return dataclasses.replace(c, iteration_s=c.screened_s, pipeline_s=pipe,
                               bubble=max(0.0, 1.0 - work / pipe) if pipe > 0 else 0.0, simulated=False)


def least_step_s(c: MeshChoice) -> float:
    """A lower bound on ``c``'s simulated step under any schedule: its pipeline devices' average work (every
    micro-batch through every stage, no bubble) after data parallel's sync before the first forward."""
    return c.candidate.micro_batches * sum(c.stage_s) / c.mesh.pp + c.sync_s[0]


def _simpler(c: MeshChoice) -> tuple[float, int, int, bool, bool]:
    """Faster first; ties to fewer stages, less tensor parallelism, replicas, pp outermost."""
    m = c.mesh
    return (c.iteration_s, m.pp, m.tp, m.dp_mode == "shard", m.order != "pp-dp-tp")


def _least_tau(problem: MeshProblem, cand: Candidate, fig: StageFigures) -> float:
    """A lower bound on the bottleneck stage time of any cuts of ``cand``: the slowest piece, the average stage."""
    k, _ = budget(problem, cand.schedule, cand.mesh.pp)
    work = [f + b for f, b in zip(fig.fwd_s, fig.bwd_s)]
    return max(max(work), sum(work) / k)


def _rank(c: MeshChoice) -> tuple[float, int, bool, bool, int]:
    """Faster first; ties to fewer micro-batches, then no recomputation, then whole stages, then fewer stages
    recomputing."""
    return (c.screened_s, c.candidate.micro_batches, c.candidate.recompute, c.candidate.per_block,
            sum(mode != "never" for mode in c.stage_modes))
