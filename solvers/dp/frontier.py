"""What the two label searches share: the labels and their dominance, and one search's bounds, states and incumbent.

:mod:`solvers.dp.labels` (contiguous cuts of one order) and :mod:`solvers.dp.ideals` (chains of ideals) are
one label setting over two lattices of positions. Both start from the same bounds (:class:`LabelSearch`: the
per-stage cap ``UB / m``, the limit ``UB`` itself, the fastest speed and the balanced slowest stage of
``p`` stages), walk the same frontier of states ``(position, stages so far) -> (used devices, pending
senders) -> Pareto set of`` :class:`Label` s, position by position, map each pending sender to its stage's
slot the same way (:func:`senders`), file a closed stage's labels under the state it leads to, one per orbit
of the topology's symmetries (:meth:`LabelSearch.front`), and keep a plan that beats the incumbent the same
way (:meth:`LabelSearch.improve`). What differs, a stage's time and the bounds on the rest, each search
writes out itself, and so does the update of each label a stage closes: it is the searches' innermost loop,
where a call per label would cost both.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from operator import le
from typing import Iterator

from solvers.problem import Problem
from solvers.dp.space import Space
from solvers.dp.speeds import SpeedRests
from solvers.dp.tables import REL_TOL, Tables

__all__ = ["Label", "LabelSearch", "Timeout", "insert_label", "senders"]


@dataclass(slots=True)   # millions are made in one search: slots make them smaller and faster to read
class Label:
    total: float               # sum of stage times so far (pending stages included)
    max_done: float            # max over stages whose time can no longer grow
    pending_t: tuple           # times of stages that still have pending senders
    parent: "Label | None"
    start: int                 # segment of the stage this label closed: [start, end)
    end: int
    device: int                # device index of that stage (in the frame of the state it entered)
    sigma: tuple | None = None  # the automorphism that mapped that state to its canonical form
    ending: float = 0.0        # total + weight * max_done, set by insert_label (its weight is one per search)


class Timeout(Exception):
    """The deadline passed inside a search."""


def insert_label(front: list[Label], new: Label, weight: float) -> None:
    """Add ``new`` to a Pareto set unless dominated; drop labels it dominates.

    ``a`` dominates ``b`` (same state) when, whatever the future stages add,
    ``a`` ends no worse: ``total + weight * max`` with ``weight = m - 1`` is
    no larger for every future maximum ``X`` iff ``a.total <= b.total`` and
    ``a.total + weight a.max_done <= b.total + weight b.max_done``; pending
    stages grow by the same amounts in both, so theirs must be no larger.
    (Written out inline: this is the search's innermost loop. ``weight`` must be the same for every
    label of ``front``: each label keeps its ``ending``.)
    """
    total, pending = new.total, new.pending_t
    ending = new.ending = total + weight * new.max_done
    if not front:
        front.append(new)
        return
    dominated = False   # does ``new`` dominate any label already there?
    for old in front:
        if old.total <= total and old.ending <= ending and (not pending or all(map(le, old.pending_t, pending))):
            return
        if not dominated and total <= old.total and ending <= old.ending and (
                not pending or all(map(le, pending, old.pending_t))):
            dominated = True
    if dominated:
        front[:] = [old for old in front if not (total <= old.total and ending <= old.ending and (
            not pending or all(map(le, pending, old.pending_t))))]
    front.append(new)


def senders(pending: tuple) -> tuple[dict[int, int], dict[int, int], list[int], dict[int, int]]:
    """A state's pending senders ``(node, stage, device)`` as maps: each node's stage and device, the stages
    that still send (in order), and each such stage's slot in a label's ``pending_t``."""
    pend_stage = {u: a for u, a, _ in pending}
    pend_dev = {u: d for u, _, d in pending}
    pend_stages = sorted(set(pend_stage.values()))
    slot = {a: i for i, a in enumerate(pend_stages)}
    return pend_stage, pend_dev, pend_stages, slot


class LabelSearch:
    """One search for exactly ``p`` stages below ``ub``: the bounds every label search starts from, its
    frontier of states, and what it has found (:attr:`best`, :attr:`best_t`) or cut off (:attr:`pruned`).

    :attr:`cap` and :attr:`ub_limit` fall as plans are found; a search that reads them in a loop holds them
    in locals and writes them back (with :attr:`pruned`) before anything else reads them."""

    __slots__ = ("problem", "tables", "p", "space", "m", "n", "groups", "factor", "cap", "ub_limit",
                 "max_speed", "together", "least_max", "canon", "speed_rests", "frontier", "best", "best_t",
                 "pruned")

    def __init__(self, problem: Problem, tables: Tables, p: int, ub: float, space: Space) -> None:
        self.problem, self.tables, self.p, self.space = problem, tables, p, space
        self.m, self.n = problem.micro_batches, tables.n
        self.groups = space.table.groups
        self.factor = 1.0 + problem.optimizer_state_factor
        self.cap = ub / self.m * (1 + REL_TOL) if math.isfinite(ub) else math.inf   # T >= m max t_s
        self.ub_limit = ub * (1 + REL_TOL) if math.isfinite(ub) else math.inf
        self.max_speed, self.together = space.speeds(p)
        # Every complete plan's slowest stage takes at least the whole work over the speeds of its stages.
        self.least_max = tables.suffix_fb[0] / self.together
        self.canon = space.canon
        # devices of different speeds: the rest's compute at the speeds it can still have (solvers.dp.speeds)
        self.speed_rests = SpeedRests(space, self.m)
        # frontier[(position, k)] maps (used devices, pending senders) to Pareto sets of labels.
        self.frontier: dict[tuple[int, int], dict[tuple, list[Label]]] = {
            (0, 0): {(space.start(), ()): [Label(0.0, 0.0, (), None, 0, 0, -1)]}}
        self.best: Label | None = None
        self.best_t = math.inf
        self.pruned = math.inf   # smallest lower bound of anything cut off by the bound: what a failure proves

    def states(self, positions: int, deadline: float) -> Iterator[tuple[int, int, dict[tuple, list[Label]]]]:
        """``(position, stages so far, its states)`` for each position below ``positions`` in turn (a stage
        leads only to later ones), each taken off the frontier when reached; ``Timeout`` past ``deadline``."""
        frontier = self.frontier
        for j in range(positions):
            if time.perf_counter() > deadline:
                raise Timeout
            for k in range(self.p):
                by_key = frontier.pop((j, k), None)
                if by_key:
                    yield j, k, by_key

    def front(self, end: int, k: int, used: tuple | int, pending: tuple) -> tuple[list[Label], tuple | None]:
        """The Pareto set of the state ``k`` stages ending at ``end`` lead to, and the automorphism that maps
        it to its canonical form (one state per orbit of the topology's automorphisms), or None."""
        key, perm = (used, pending), None
        if self.canon is not None:
            key, perm = self.canon.canonical(used, pending)
        return self.frontier.setdefault((end, k), {}).setdefault(key, []), perm

    def improve(self, label: Label, t: float, ub_limit: float, cap: float) -> tuple[float, float]:
        """A plan of ``t`` below the incumbent: it becomes the incumbent, and the bounds ``ub_limit`` and
        ``cap`` (the caller's current ones) fall to it: returns them."""
        self.best, self.best_t = label, t
        return min(ub_limit, t * (1 + REL_TOL)), min(cap, t / self.m * (1 + REL_TOL))
