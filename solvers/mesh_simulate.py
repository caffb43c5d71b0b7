"""A mesh search's choice simulated (:func:`simulate_choice`), and a lower bound on that simulated step from the same
figures without simulating (:func:`least_simulated_s`), which lets a caller leave unsimulated the shapes that
cannot beat a step it already has. Torch-free.

The bound: the simulation (:func:`solvers.simulate.simulate`, each device on its own) runs a device's operations
one at a time, each of its stage's forward or backward length; an operation of a stage at or after ``j`` (the
device's first stage) on micro-batch ``b`` follows ``b``'s forwards through the stages before ``j``, and, without a
split backward, precedes ``b``'s backwards through them; data parallel's reduction of the device's stages follows
its last operation. So the step is at least, for every device, the forwards of one micro-batch before its first
stage, all its own operations, and the larger of those backwards and its reductions, after the sync before the
first forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from solvers.mesh import MeshProblem, dp_sync_s, gathered_first, owner, reduced_after_s, regather_s
from solvers.mesh_candidates import as_chosen, figures
from solvers.schedules import KINDS, ONE_STAGE, get_schedule
from solvers.simulate import simulate

__all__ = ["least_simulated_s", "simulate_choice"]


def _inputs(problem: MeshProblem, choice: Any) -> dict[str, Any]:
    """What :func:`simulate_choice` simulates: per stage the forward and backward of a micro-batch, the weight
    passes' shares, the transfers, data parallel's reductions after and its sync before the first forward."""
    cand, cuts = choice.candidate, choice.cuts
    figs = figures(problem, cand, choice.samples)
    fig = as_chosen(figs, cuts, [[m for m, _ in figs].index(mode) for mode in choice.stage_modes])
    p, k = cand.mesh.pp, len(cuts) - 1
    fwd = [sum(fig.fwd_s[a:i]) for a, i in zip(cuts, cuts[1:])]
    bwd = [sum(fig.bwd_s[a:i]) for a, i in zip(cuts, cuts[1:])]
    share = [min(1.0, sum(fig.weight_s[a:i]) / b) if b > 0 else 0.0 for a, i, b in zip(cuts, cuts[1:], bwd)]
    sends = {(j, j + 1): fig.cut_s[cuts[j + 1] - 1] + (fig.broadcast_s if j == 0 else 0.0) for j in range(k - 1)}
    sends.update({(0, j): fig.broadcast_s for j in range(2, k) if fig.broadcast_s})
    params = [sum(fig.param_bytes[a:i]) for a, i in zip(cuts, cuts[1:])]
    schedule = cand.schedule if p > 1 else ONE_STAGE
    split = get_schedule(schedule).split_backward
    after = [reduced_after_s(problem, cand.mesh, fig.param_bytes, a, i, bwd[j], split)
             for j, (a, i) in enumerate(zip(cuts, cuts[1:]))]
    first = sum(b for j, b in enumerate(params) if owner(cand.schedule, j, p) == 0)
    before = dp_sync_s(problem, cand.mesh, first, gathered_first(problem, fig.param_bytes, cuts[0], cuts[1]))[0]
    if p == 1:   # FSDP alone: the blocks resharded after each pass, gathered again for every micro-batch's passes
        blocks = sum(b for b, piece in zip(fig.param_bytes, problem.pieces) if piece.block)
        before += cand.micro_batches * (regather_s(problem, cand.mesh, blocks, fwd[0])
                                        + regather_s(problem, cand.mesh, blocks, bwd[0]))
    return dict(fwd=fwd, bwd=bwd, share=share, sends=sends, after=after, before=before, schedule=schedule,
                split=split, p=p, k=k, m=cand.micro_batches)


def least_simulated_s(problem: MeshProblem, choice: Any) -> float:
    """A lower bound on :func:`simulate_choice`'s step for ``choice`` (module docstring)."""
    x = _inputs(problem, choice)
    fwd, bwd, m, schedule, p = x["fwd"], x["bwd"], x["m"], x["schedule"], x["p"]
    most = 0.0
    for w in range(p):
        own = [j for j in range(x["k"]) if owner(schedule, j, p) == w]
        if not own:
            continue
        j = min(own)
        work = m * sum(fwd[s] + bwd[s] for s in own)
        drain = 0.0 if x["split"] else sum(bwd[:j])
        most = max(most, sum(fwd[:j]) + work + max(drain, sum(x["after"][s] for s in own)))
    return most + x["before"]


def simulate_choice(problem: MeshProblem, choice: Any) -> Any:
    """``choice`` (a :class:`solvers.mesh_search.MeshChoice`) with its step simulated: the schedule's own timeline,
    the pipeline's transfers on their links, data parallel's sync after each device's last backward, overlapping
    the drain, and its all-gather before the first forward."""
    x = _inputs(problem, choice)
    fwd, bwd, p, k, m = x["fwd"], x["bwd"], x["p"], x["k"], x["m"]
    sim = simulate(fwd, bwd, m, x["schedule"], sends=x["sends"], allreduce_s=x["after"], workers=p,
                   weight_share=x["share"] if x["split"] else 0.5)
    work = [sum(fwd[j] + bwd[j] for j in range(k) if owner(x["schedule"], j, p) == w) * m for w in range(p)]
    pipe = sim.iteration_s
    compute_end = max((e.end for e in sim.timeline if e.kind in KINDS), default=0.0)
    bubble = 1.0 - sum(work) / (p * compute_end) if compute_end > 0 else 0.0
    return dataclasses.replace(choice, iteration_s=pipe + x["before"], sync_s=(x["before"], max(x["after"]) if x["after"] else 0.0),
                               pipeline_s=compute_end, bubble=bubble, simulated=True)
