"""The mesh search's cuts (:func:`min_max_cuts`): the pieces into contiguous stages minimising the slowest stage,
every stage within its memory in the fastest of its recomputation modes that fits, by an exact dynamic program over
the cuts (vectorised over each stage's segments), with what one search's candidates share kept in a memo.

A stage's memory in a mode (:func:`solvers.mesh_candidates.held_bytes`) holding ``f`` micro-batches from forward to
backward (and none between a split backward's passes) is ``base + f × forward`` over a segment, so a segment fits
such a stage while ``f`` is at most ``(limit - base) / forward`` (:func:`_most_held`): one matrix per figures, mode
and memory, shared by every candidate and stage holding any ``f``, in place of one memory matrix per stage. Before
the dynamic program a candidate no cuts can fit is refused by the stages' reach (:func:`_may_fit`: how far the
pieces can be covered stage after stage, with each stage's most micro-batches held; a necessary condition), which
costs a row per stage: most candidates the search solves on a large model fit no cuts (Qwen3-235B-A22B on 256
devices: 1612 of 2048). Torch-free.
"""

from __future__ import annotations

import math

import numpy as np

from solvers.mesh import StageFigures
from solvers.mesh_candidates import Mode, held_bytes, held_terms

__all__ = ["broadcast_s", "min_max_cuts"]


def min_max_cuts(figs: list[tuple[Mode, StageFigures]], k: int, room: float,
                 held: list[tuple[tuple[int, int], ...]], memo: dict | None = None) -> list[int] | None:
    """Cuts of the pieces into ``k`` contiguous stages minimising the largest stage time, every stage ``j`` within
    ``room`` bytes holding ``held[j]`` micro-batches (:func:`solvers.mesh.stage_held`) in the fastest of the modes
    ``figs`` that fits; ``None`` when no cuts fit. Exact (dynamic program). ``memo`` (one search's) keeps each
    mode's segment figures and each stage's cost matrix by what they are made of, for the candidates that share
    them (the same figures under another schedule, or its no-recomputation mode inside per-stage recomputation)."""
    L = len(figs[0][1].fwd_s)
    if k > L:
        return None
    memo = {} if memo is None else memo
    limit = room * (1 + 1e-12)
    if not _may_fit(memo, figs, k, held, limit):
        return None
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    choice = []
    costs: dict[tuple[tuple[int, int], ...], np.ndarray] = {}   # by what a stage holds: stages share them
    for j in range(k):
        cost = costs.get(held[j])
        if cost is None:
            cost = np.full((L + 1, L + 1), np.inf)
            for mode, fig in figs:
                cost = np.minimum(cost, _mode_cost(memo, mode, fig, k, held[j], limit))
            costs[held[j]] = cost
        total = np.maximum(best[:, None], cost)
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(L + 1)]
        choice.append(arg)
    if not math.isfinite(best[L]):
        return None
    cuts, i = [L], L
    for j in reversed(range(k)):
        i = int(choice[j][i])
        cuts.append(i)
    return cuts[::-1]


def _segments(memo: dict, fig: StageFigures, k: int) -> tuple:
    """Per segment ``a:i`` of the pieces (``[a, i]``), its time (``inf`` where not ``a < i``) and the sums
    :func:`solvers.mesh_candidates.held_bytes` weighs, for ``fig`` in a pipeline of ``k`` stages."""
    key = ("segments", id(fig), k)
    if key not in memo:
        L = len(fig.fwd_s)
        zero = np.zeros(1)
        a_idx, i_idx = np.arange(L + 1)[:, None], np.arange(L + 1)[None, :]
        T = np.concatenate([zero, np.cumsum(np.add(fig.fwd_s, fig.bwd_s))])
        cut = np.concatenate([zero, np.asarray(fig.cut_s, dtype=float), zero])  # at position a: a cut before a
        sent = np.array([broadcast_s(fig, a, k) for a in range(L + 1)])[:, None]
        seg_t = np.where(a_idx < i_idx, T[None, :] - T[:, None] + 2 * (cut[:, None] + cut[None, :]) + sent, np.inf)
        sums = []
        for name in ("state_bytes", "act_bytes", "kept_bytes"):
            S = np.concatenate([zero, np.cumsum(getattr(fig, name))])
            sums.append(S[None, :] - S[:, None])
        inb = np.concatenate([zero, np.asarray(fig.cut_bytes, dtype=float), zero])[:, None]
        loss = np.where(i_idx == L, fig.loss_bytes, 0.0)
        memo[key] = (fig, seg_t, *sums, inb, loss)   # fig kept: its id names it while the memo lives
    return memo[key][1:]


def _mode_cost(memo: dict, mode: Mode, fig: StageFigures, k: int, held: tuple[tuple[int, int], ...],
               limit: float) -> np.ndarray:
    """Each segment's time in ``mode`` where a stage of it holding ``held`` fits ``limit`` bytes, else ``inf``."""
    seg_t = _segments(memo, fig, k)[0]
    if len(held) == 1 and held[0][1] == 0:   # f micro-batches from forward to backward, none pending a weight pass
        return np.where(_most_held(memo, mode, fig, limit) >= held[0][0], seg_t, np.inf)
    _, seg_s, seg_a, seg_k, inb, loss = _segments(memo, fig, k)
    mem = held_bytes(mode, held, seg_s, seg_a, seg_k, inb, fig.rebuilt_bytes, fig.work_bytes, loss)
    return np.where(mem <= limit, seg_t, np.inf)   # seg_t: inf where not valid


def _most_held(memo: dict, mode: Mode, fig: StageFigures, limit: float) -> np.ndarray:
    """Per segment ``[a, i]``, the most micro-batches a stage of it in ``mode`` may hold from forward to backward
    within ``limit`` bytes (module docstring; ``-inf`` where ``a >= i`` or none fits)."""
    key = ("held", id(fig), mode, limit)
    if key not in memo:
        _, seg_s, seg_a, seg_k, inb, loss = _segments(memo, fig, 1)
        forward = np.broadcast_to(held_terms(mode, seg_a, seg_k, inb, fig.rebuilt_bytes)[0], seg_s.shape)
        room = limit - held_bytes(mode, ((0, 0),), seg_s, seg_a, seg_k, inb, fig.rebuilt_bytes, fig.work_bytes, loss)
        with np.errstate(divide="ignore", invalid="ignore"):
            most = np.where(forward > 0, room / forward, np.where(room >= 0, np.inf, -np.inf))
        n = seg_s.shape[0]
        memo[key] = np.where(np.arange(n)[:, None] < np.arange(n)[None, :], most, -np.inf)
    return memo[key]


def _may_fit(memo: dict, figs: list[tuple[Mode, StageFigures]], k: int, held: list[tuple[tuple[int, int], ...]],
             limit: float) -> bool:
    """False where no cuts of the pieces into ``k`` stages fit (module docstring): the positions the first ``j``
    stages can reach lie in ``[j, reach]``, each stage ``j`` holding at least its most micro-batches from forward to
    backward in its most frugal mode; true leaves the answer to the dynamic program."""
    key = ("most", tuple(id(fig) for _, fig in figs), tuple(mode for mode, _ in figs), limit)
    if key not in memo:
        memo[key] = np.maximum.reduce([_most_held(memo, mode, fig, limit) for mode, fig in figs])
    most = memo[key]
    L = most.shape[0] - 1
    reach = 0
    for j in range(k):
        f = max(f for f, _ in held[j])
        rows = most[j:reach + 1] >= f
        if not rows.any():
            return False
        reach = int(np.nonzero(rows.any(axis=0))[0].max())
    return reach >= L


def broadcast_s(fig: StageFigures, a: int, k: int) -> float:
    """A stage's share of the first piece's sends to every later stage (``MeshProblem.broadcast_bytes``): the
    first stage sends to the ``k - 1`` others, each other receives once; forward and gradient."""
    return 2 * fig.broadcast_s * ((k - 1) if a == 0 else 1) if k > 1 else 0.0
