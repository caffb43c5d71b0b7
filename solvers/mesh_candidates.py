"""The candidates the mesh search screens, and each stage's recomputation modes and memory.

A candidate (:class:`Candidate`) is a mesh shape, a schedule it can run and a micro-batch count
(:func:`candidates`; :func:`no_candidate` says why a shape has none), tried without recomputation and with each
stage in the fastest of its modes that fits (:func:`recompute_options`, :func:`modes`). :func:`figures` gives the
pieces' figures under each mode (:func:`solvers.mesh.stage_figures`), :func:`as_chosen` one set of them with each
stage's chosen mode, and :func:`stage_memory` a stage's memory at its peak under a mode (:func:`held_bytes`):
what :mod:`solvers.mesh_search`'s dynamic program over the cuts weighs. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from solvers.layout import Layout
from solvers.mesh import MeshProblem, StageFigures, budget, mesh_shapes, stage_figures
from solvers.schedules import ONE_STAGE, REGISTRY, check_schedule, get_schedule

__all__ = ["Candidate", "Mode", "as_chosen", "candidates", "figures", "held_bytes", "held_terms", "micro_batch_counts", "modes",
           "no_candidate", "recompute_options", "stage_memory"]


@dataclass(frozen=True)
class Candidate:
    mesh: Layout
    schedule: str
    micro_batches: int
    recompute: bool = False
    per_block: bool = False   # with recompute: each repeated block checkpointed on its own, not whole stages
    per_stage: bool = False   # with recompute: each stage the fastest of the modes that fits (:func:`modes`)

    @property
    def recomputation(self) -> str:
        """``"never"``, ``"always"`` (whole stages), ``"blocks"`` (each block) or ``"per stage"``."""
        if self.per_stage:
            return "per stage"
        return "blocks" if self.recompute and self.per_block else "always" if self.recompute else "never"


Mode = str
"""A stage's recomputation: one of :data:`solvers.mesh.MODES`."""


def modes(problem: MeshProblem, cand: Candidate) -> list[Mode]:
    """The recomputation modes each stage of ``cand`` may take: its one mode, or, per stage, none, the whole stage
    and, where there are blocks and no split backward, each block, every other block and selective (the runtime
    runs no per-block mode under a split backward: :func:`fxpipe.planning.memory_model.refuse_with_schedule`), the
    fastest that fits being the stage's."""
    if not cand.per_stage:
        return [cand.recomputation]
    split = get_schedule(cand.schedule).split_backward and cand.mesh.pp > 1
    if split or not any(p.block for p in problem.pieces):
        return ["never", "always"]
    return ["never", "always", "blocks", "blocks:2", "selective"]


def micro_batch_counts(problem: MeshProblem, dp: int) -> list[int]:
    """Micro-batch counts of one dp replica's ``batch / dp`` samples: the problem's own, or powers of two that
    divide it and the whole (one sample each), at most ``most_micro_batches``."""
    local = problem.batch // dp
    if problem.micro_batch_counts:
        return [m for m in problem.micro_batch_counts if 1 <= m <= local and local % m == 0]
    most = min(local, problem.most_micro_batches or local)
    counts = {m for m in (2 ** k for k in range(int(math.log2(most)) + 1)) if local % m == 0}
    if local <= most:
        counts.add(local)
    return sorted(counts)


def _schedules(problem: MeshProblem, mesh: Layout) -> tuple[str, ...]:
    return problem.schedules if mesh.pp > 1 else (ONE_STAGE,)   # one stage: accumulation, one in flight


def _refusal(problem: MeshProblem, mesh: Layout, schedule: str, m: int | None) -> str | None:
    """Why ``schedule`` does not run ``m`` micro-batches on ``mesh`` (``None``: it does): more stages than the
    model's pieces, or (``m`` given) a count the schedule cannot group, or one micro-batch in a pipeline but under
    GPipe."""
    k, _ = budget(problem, schedule, mesh.pp)
    if k > len(problem.pieces):
        return f"{schedule} needs {k} stages of the model's {len(problem.pieces)} pieces, which are never cut"
    if m is None:
        return None
    try:
        check_schedule(schedule, k, mesh.pp, m)
    except ValueError as exc:
        return f"{schedule}: {exc}"
    if mesh.pp > 1 and m == 1 and not get_schedule(schedule).single_batch:
        alone = ", ".join(n for n, r in REGISTRY.items() if r.single_batch)
        return f"{schedule}: one micro-batch (only {alone} runs one in a pipeline)"
    return None


def candidates(problem: MeshProblem) -> Iterator[Candidate]:
    """Every (mesh, schedule, micro-batches) the search screens, without recomputation (module docstring)."""
    for mesh in mesh_shapes(problem):
        for schedule in _schedules(problem, mesh):
            for m in micro_batch_counts(problem, mesh.dp):
                if _refusal(problem, mesh, schedule, m) is None:
                    yield Candidate(mesh, schedule, m)


def no_candidate(problem: MeshProblem, mesh: Layout) -> str:
    """Why :func:`candidates` gives ``mesh`` none: per schedule, its stages beyond the model's pieces, else the
    refusal of its first micro-batch count."""
    reasons = []
    for schedule in _schedules(problem, mesh):
        for m in [None, *micro_batch_counts(problem, mesh.dp)]:
            refused = _refusal(problem, mesh, schedule, m)
            if refused:
                reasons.append(refused)
                break
    return "; ".join(reasons)


def recompute_options() -> list[tuple[bool, bool, bool]]:
    """(recompute, per_block, per_stage) triples a candidate is tried with: no recomputation, and each stage in
    the fastest of :func:`modes` that fits its memory, as the node-level costing chooses per stage
    (:func:`fxpipe.planning.memory_model.choose_checkpoints`) from the same modes, so the search's step is close to
    the node level's and below it where they differ (issue 47 part 6: with whole stages only, the 405B plan on 64
    nodes ranked the layout the node level found fastest after its choice)."""
    return [(False, False, False), (True, False, True)]


def held_bytes(mode: Mode, held: tuple[tuple[int, int], ...], state, act, kept, inputs, rebuilt, work=0.0, loss=0.0):
    """A stage's memory in ``mode`` holding ``held`` (:func:`solvers.mesh.stage_held`): its parameters, gradients
    and optimizer state ``state``; per micro-batch between forward and backward its activations ``act``, or
    recomputing, its input (``inputs``; the block inputs ``kept`` per block); per micro-batch between a split
    backward's input and weight passes twice what the weight pass differentiates (the activations and, about as
    large, the gradients at the weight frontier; per block, of the block inputs), and, recomputing, the one
    micro-batch rebuilt at a time (the stage's activations, or the largest block's ``rebuilt``), with a backward's
    transient on top, as the node-level memory model charges it (:meth:`solvers.activation_memory.StageBytes.estimate`):
    an operation's output and its gradient (``work``) and, on the stage computing it, the loss's buffers
    (``loss``) or the rebuilt activations, whichever is larger. Works on numbers and on arrays of segments alike."""
    forward, pending, extra = held_terms(mode, act, kept, inputs, rebuilt)
    most = None
    for f, w in held:
        now = f * forward + w * pending if w else f * forward
        most = now if most is None else np.maximum(most, now)
    return state + most + work + np.maximum(loss, extra)


def held_terms(mode: Mode, act, kept, inputs, rebuilt):
    """(bytes a micro-batch keeps from forward to backward, bytes one pending a split backward's weight pass keeps,
    the rebuilt micro-batch's bytes) of a stage in ``mode``: :func:`held_bytes`'s terms."""
    if mode == "never":
        return act, 2 * act, 0.0
    if mode == "always":
        return inputs, 2 * act, act
    return kept, 2 * kept, rebuilt


def stage_memory(mode: Mode, fig: StageFigures, held: tuple[tuple[int, int], ...], a: int, i: int) -> float:
    inputs = fig.cut_bytes[a - 1] if a > 0 else 0.0
    return float(held_bytes(mode, held, sum(fig.state_bytes[a:i]), sum(fig.act_bytes[a:i]),
                             sum(fig.kept_bytes[a:i]), inputs, fig.rebuilt_bytes, fig.work_bytes,
                             fig.loss_bytes if i == len(fig.act_bytes) else 0.0))


def figures(problem: MeshProblem, cand: Candidate, samples: int,
             cache: dict | None = None) -> list[tuple[Mode, StageFigures]]:
    """The pieces' figures under each of ``cand``'s modes (``cache``: by mesh, samples and mode)."""
    cache = {} if cache is None else cache
    out = []
    for mode in modes(problem, cand):
        key = (cand.mesh, samples, mode, get_schedule(cand.schedule).split_backward and cand.mesh.pp > 1)
        if key not in cache:
            cache[key] = stage_figures(problem, cand.mesh, samples, mode, split=key[-1])
        out.append((mode, cache[key]))
    return out


def as_chosen(figs: list[tuple[Mode, StageFigures]], cuts: list[int], chosen: list[int]) -> StageFigures:
    """One set of figures whose pieces carry their stage's chosen mode's (``chosen[j]``: an index into ``figs``)."""
    first = figs[chosen[0]][1]
    per_piece = [figs[c][1] for c, a, i in zip(chosen, cuts, cuts[1:]) for _ in range(a, i)]
    pick = {name: [getattr(f, name)[x] for x, f in enumerate(per_piece)]
            for name in ("fwd_s", "bwd_s", "weight_s", "state_bytes", "param_bytes", "act_bytes")}
    return StageFigures(**pick, cut_s=first.cut_s, cut_bytes=first.cut_bytes, kept_bytes=first.kept_bytes,
                        rebuilt_bytes=first.rebuilt_bytes, broadcast_s=first.broadcast_s, work_bytes=first.work_bytes,
                        loss_bytes=first.loss_bytes)
