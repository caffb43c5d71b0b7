"""The order of the searches: incumbents from balanced and anchor cuts, then exact searches cheapest first."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from solvers.cuts import CUT_ANCHORS, QUADRATIC_ANCHORS
from solvers.cuts_scheduled import autopartition_cuts, megatron_cuts
from solvers.certificate import certify, contiguous_is_convex
from solvers.errors import InfeasibleError
from solvers.groups import GroupTable, hierarchical_order
from solvers.placement import improve_placement
from solvers.problem import Problem
from solvers.score import Score, score_assignment
from solvers.solution import Solution, Stage, assignment_from_cuts
from solvers.dp.tables import REL_TOL, Tables, balanced_cuts, device_classes, stage_counts
from solvers.dp.deepen import CountDeepening, deepen_counts
from solvers.dp.frontier import Label, Timeout
from solvers.dp.labels import plan_of
from solvers.dp.space import Space
from solvers.dp.hierarchy import TreeCanon, link_tree
from solvers.dp.symmetry import Canon, automorphisms
from solvers.dp.bounds import min_peak_bytes, placement_floor
from solvers.dp.peaks import fits, plan_within

__all__ = ['ANCHOR_SEED_LIMIT', 'MAX_EXACT_PLACEMENT_DEVICES', 'CutShort', 'Search', 'fastest_first', 'infeasible_error', 'offer_replicated', 'solve_dp']


MAX_EXACT_PLACEMENT_DEVICES = 16
"""Beyond this many devices placement is heuristic (hierarchical order + local search)."""


ANCHOR_SEED_LIMIT = 2e7
"""Seed with the anchors' quadratic partitioners only up to ``nodes^2 x stages`` this large."""


@dataclass
class CutShort:
    """A certifying search the deadline stopped: its space, the floors it had, and what it proved."""

    space: Space
    floor: dict[int, float]
    lower: float         # no plan of its space is faster
    by_share: bool       # stopped by its share of the time, not by the solve's deadline: worth another go


class Search:
    """The incumbent and what the searches so far certify about the optimum."""

    def __init__(self, problem: Problem, tables: Tables, table: GroupTable, deadline: float) -> None:
        self.problem, self.tables, self.table, self.deadline = problem, tables, table, deadline
        self.ub = math.inf
        self.incumbent: tuple[int, list[int], list[tuple[int, ...]]] | None = None
        self.cut_short: list[CutShort] = []   # certifying searches the deadline stopped

    @property
    def complete(self) -> bool:
        """Every certifying search finished."""
        return not self.cut_short

    @property
    def lower(self) -> float:
        """The lower bound the searches cut short still prove (inf when none was)."""
        return min((c.lower for c in self.cut_short), default=math.inf)

    def offer(self, p: int, cuts: list[int], groups: list[tuple[int, ...]]) -> None:
        sc = score_assignment(self.problem, assignment_from_cuts(self.tables.order, cuts), groups)
        if sc.feasible and sc.iteration_s < self.ub * (1 - 1e-12):
            self.ub, self.incumbent = sc.iteration_s, (p, list(cuts), list(groups))

    def exact(self, space: Space, certifies: bool, floor: dict[int, float] | None = None,
              share: float = 1.0) -> CutShort | None:
        """Search ``space`` for every stage count (:func:`~solvers.dp.deepen.deepen_counts`: best-first when
        it ``certifies``, else fewest stages first); if cut short and ``certifies``, keep its lower bound.

        ``floor[p]`` is a known lower bound for ``p`` stages (from a relaxation): counts whose
        floor already reaches the incumbent are skipped. ``share`` is the fraction of the
        remaining time this search may take (the rest is left to later searches). Returns the
        :class:`CutShort` it recorded when the deadline stopped it and it ``certifies``.
        """
        floor = floor or {}
        deadline = self.deadline
        if share < 1.0 and math.isfinite(deadline):
            deadline = time.perf_counter() + share * max(0.0, deadline - time.perf_counter())
        counts = [CountDeepening(self.problem, self.tables, p, space, floor.get(p, 0.0))
                  for p in stage_counts(self.problem) if floor.get(p, 0.0) < self.ub * (1 + REL_TOL)
                  and (space.kind != "order" or p <= len(space.order))]   # an order of groups may be short

        def found(count: CountDeepening, label: Label, t: float) -> None:
            cuts, devices = plan_of(label)
            self.ub, self.incumbent = t, (count.p, cuts, [self.table.groups[d].devices for d in devices])

        try:
            deepen_counts(counts, self.ub, deadline, found, best_first=certifies)
        except Timeout:
            if not certifies:
                return None
            # what each count proved is a floor for a second go at this space
            proved = {c.p: c.lower for c in counts if not c.done}
            stopped = CutShort(space, {**floor, **proved}, min(proved.values(), default=math.inf),
                               by_share=deadline < self.deadline)
            self.cut_short.append(stopped)
            return stopped
        return None

    def resume(self) -> None:
        """Run again, with all the time left, the certifying searches their share stopped while later ones
        finished early (one that stops again keeps the better of its two bounds)."""
        for item in [c for c in self.cut_short if c.by_share]:
            if time.perf_counter() >= self.deadline:
                return
            self.cut_short.remove(item)
            again = self.exact(item.space, certifies=True, floor=item.floor)
            if again is not None:
                again.lower = max(again.lower, item.lower)


def fastest_first(problem: Problem) -> list[int]:
    """The hierarchical device order with the fastest devices first (stably: each speed keeps its locality),
    so that the first ``p`` devices of it are ``p`` of the fastest, close together. The identity order when all
    devices have the same speed and ``hierarchical_order`` is the identity."""
    order = hierarchical_order(problem)
    if len({d.speed for d in problem.devices}) == 1:
        return order
    return sorted(order, key=lambda d: -problem.devices[d].speed)


def offer_replicated(search: Search, problem: Problem, tables: Tables, order: list[int]) -> None:
    """Seed the search with every stage a replica group of ``r = 2 .. max_replicas`` devices, consecutive in
    ``order``, and the work split in proportion to the groups' speeds: the plans a replica search starts from.

    Without them it started from one device per stage, and on a 1000-node chain over 16 GPUs (two Titan V
    boxes) with ``max_replicas = 4`` returned 2.395 s, 16 stages of one device, where 4 stages of 4 replicas
    with even cuts take 1.291 s: the search over runs of devices did not finish, and nothing had offered it."""
    n_dev = len(problem.devices)
    for r in range(2, problem.max_replicas + 1):
        for p in stage_counts(problem):
            if p * r > n_dev:
                break
            groups = [tuple(order[k * r:(k + 1) * r]) for k in range(p)]
            speeds = [search.table.groups[search.table.add(g)].speed for g in groups]
            search.offer(p, balanced_cuts(tables, p, speeds), groups)


def orbit_canon(problem: Problem, classes: list[list[int]]) -> Canon | TreeCanon | None:
    """How the placement search keeps one state per orbit: the tree of link classes when the links
    form one (any size of group), else the automorphisms when there are few enough; None when the
    pairwise classes already capture every symmetry."""
    pairwise = 2 ** sum(len(c) > 1 for c in classes)   # at least: the pairwise classes' swaps
    tree = link_tree(problem)
    if tree is not None and tree.symmetries() > pairwise:
        return TreeCanon(tree)
    group = automorphisms(problem)
    return Canon(group) if group is not None and len(group) > pairwise else None


def infeasible_error(problem: Problem, tables: Tables, complete: bool, time_limit_s: float | None,
                     all_placements: bool) -> InfeasibleError:
    """Why no plan of the DP's space was found: none fits (how much memory the fullest stage needs, and where
    there is too little), or, when a search was cut short (``complete`` false), none was found in time.
    ``all_placements``: the searches covered every placement of the DP's space (one, stage ``k`` on device
    ``k``, with ``placement=False``); else only a stage peak above every device's memory proves that none fits."""
    n_dev = len(problem.devices)
    need = min_peak_bytes(problem)
    have = max(d.memory_bytes for d in problem.devices)
    if not complete and need <= have:
        return InfeasibleError(
            f"no plan that fits in memory was found within the time limit of {time_limit_s} s (the smallest "
            f"stage peak, {need:.4g} bytes, would fit on the largest device, {have:.4g} bytes); "
            "raise the time limit or add memory", min_peak_bytes=need, proven=False)
    if need <= have:   # the fullest stage fits the largest device, but not every stage finds room
        least = min(d.memory_bytes for d in problem.devices)
        return InfeasibleError(
            f"no contiguous partition of {tables.n} nodes over {n_dev} devices fits in memory: the best "
            f"partition's fullest stage needs {need:.4g} bytes at its peak, more than the smallest devices have "
            f"(memory from {least:.4g} to {have:.4g} bytes), and no plan puts each stage on a device with "
            "room for it; add devices or memory, or lower micro_batches/activation memory", min_peak_bytes=need,
            proven=complete and all_placements)
    return InfeasibleError(
        f"no contiguous partition of {tables.n} nodes over {n_dev} devices fits in memory: "
        f"the smallest possible stage peak is {need:.4g} bytes, the largest device has {have:.4g} bytes; "
        "add devices, use devices with at least that much memory, or lower micro_batches/activation memory",
        min_peak_bytes=need,
    )


def solve_dp(problem: Problem, placement: bool = True, time_limit_s: float | None = None) -> Solution:
    """Optimal contiguous plan (see the module docstring for the exact search space).

    ``placement=True`` also chooses which device runs each stage: any injective
    mapping for up to 16 devices (interchangeable devices collapsed), found
    after fast incumbents from the hierarchical device order and a local search;
    beyond 16 devices only those heuristics run and the solution says it is not
    certified. ``placement=False`` runs stage ``k`` on device ``k``, the
    topology-blind baseline. With ``max_replicas > 1`` stages may also take runs
    of consecutive devices of the hierarchical order as replica groups.
    ``time_limit_s`` bounds the whole call (with placement: the topology-blind search
    may take 80 % of it, the placement searches the rest); when it stops an exact search
    the solution reports ``optimal: false`` with a proven lower bound and the best plan found.
    """
    started = time.perf_counter()
    deadline = started + time_limit_s if time_limit_s is not None else math.inf
    tables = Tables(problem)
    table = GroupTable(problem)
    n_dev = len(problem.devices)
    identity = list(range(n_dev))
    if problem.max_replicas == 1:
        have = max(d.memory_bytes for d in problem.devices)
        if not any(fits(problem, tables.order, p, have) for p in stage_counts(problem)):
            # no split fits even the largest device: say so now, not once the searches have spent the limit
            raise infeasible_error(problem, tables, True, time_limit_s, all_placements=True)
    search = Search(problem, tables, table, deadline)
    for p in stage_counts(problem):
        search.offer(p, balanced_cuts(tables, p), [(k,) for k in range(p)])
    fast = fastest_first(problem) if placement else identity
    if fast != identity:   # devices of different speeds: the fastest ones, each with a share of the work it can do
        for p in stage_counts(problem):
            search.offer(p, balanced_cuts(tables, p, [problem.devices[d].speed for d in fast[:p]]),
                         [(d,) for d in fast[:p]])
    if problem.max_replicas > 1:
        offer_replicated(search, problem, tables, hierarchical_order(problem) if placement else identity)
    anchor_p = max(stage_counts(problem))
    for cutter, weights in CUT_ANCHORS:  # the anchors' plans are in our space: never end worse than one
        if cutter in QUADRATIC_ANCHORS and tables.n ** 2 * anchor_p > ANCHOR_SEED_LIMIT:
            continue  # their O(n^2 p) DPs would cost more than they save here
        search.offer(anchor_p, cutter(weights(problem), anchor_p), [(k,) for k in range(anchor_p)])
    if tables.n ** 2 * anchor_p <= ANCHOR_SEED_LIMIT:   # its min-max DP is quadratic too
        # its simulator refinement stops at the deadline (so, under a limit too short for it, the
        # anchor itself may end a little better than this seed)
        search.offer(anchor_p, autopartition_cuts(problem, anchor_p, deadline), [(k,) for k in range(anchor_p)])
    search.offer(anchor_p, megatron_cuts(problem, anchor_p), [(k,) for k in range(anchor_p)])
    if search.incumbent is None:   # no balanced plan fits in memory: one within the smallest device, if any
        smallest = min(d.memory_bytes for d in problem.devices)
        for p in stage_counts(problem):
            cuts = plan_within(problem, tables.order, p, smallest)
            if cuts is not None:
                search.offer(p, cuts, [(k,) for k in range(p)])
    exhaustive = placement and n_dev <= MAX_EXACT_PLACEMENT_DEVICES
    classes = device_classes(problem) if placement else [[d] for d in identity]
    blind_is_all = not placement or len(classes) == 1
    order = hierarchical_order(problem) if placement else identity
    if placement and not blind_is_all:
        # ``time_limit_s`` bounds the whole solve: stage k on device k (the topology-blind plan, a strong
        # incumbent, and an anchor that gets a whole limit of its own) may take 80 % of it; the placement
        # searches get what is left. With devices of different speeds, the fastest devices first come
        # before: stage k on device k then puts slow devices among the stages, rarely the best plan, and
        # takes long to prove so under a weaker incumbent.
        mixed = fast not in (identity, order)
        if mixed:
            search.exact(Space("order", table, order=fast), certifies=False, share=0.4)
        search.exact(Space("order", table, order=identity), certifies=False, share=0.5 if mixed else 0.8)
        if order != identity:
            search.exact(Space("order", table, order=order), certifies=False, share=0.5)
    else:
        search.exact(Space("order", table, order=identity), certifies=blind_is_all)
    if placement and not blind_is_all:
        for _ in range(4):  # alternate: better mapping for these cuts, then best cuts for that order
            if search.incumbent is None or time.perf_counter() > deadline:
                break
            p, cuts, groups = search.incumbent
            before = search.ub
            devices, _ = improve_placement(problem, assignment_from_cuts(tables.order, cuts),
                                           [g[0] for g in groups], deadline)
            search.offer(p, cuts, [(d,) for d in devices])
            if search.ub >= before * (1 - 1e-12):
                break
            search.exact(Space("order", table, order=devices + [d for d in order if d not in devices]),
                         certifies=False, share=0.25)
    if problem.max_replicas > 1 and search.incumbent is not None and any(len(g) > 1 for g in search.incumbent[2]):
        # the best cuts for the incumbent's replica groups (the runs' search below rarely finishes at scale)
        groups = search.incumbent[2]
        search.exact(Space("order", table, order=[table.add(g) for g in groups]), certifies=False,
                     share=0.3)
    if problem.max_replicas > 1:
        search.exact(Space("runs", table, order=order, max_replicas=problem.max_replicas), certifies=True,
                     share=0.5 if exhaustive and not blind_is_all else 1.0)
    if exhaustive and not blind_is_all and len(problem.devices) > 1:
        floor = (placement_floor(problem, search.ub, time.perf_counter() + 0.5 * max(0.0, deadline - time.perf_counter()))
                 if search.incumbent is not None else {})
        search.exact(Space("classes", table, classes=classes, canon=orbit_canon(problem, classes)),
                     certifies=True, floor=floor)
    search.resume()
    if search.incumbent is None:
        raise infeasible_error(problem, tables, search.complete, time_limit_s,
                               all_placements=not placement or exhaustive or len(classes) == 1)
    p, cuts, groups = search.incumbent
    stage_of = assignment_from_cuts(tables.order, cuts)
    sc: Score = score_assignment(problem, stage_of, groups)
    stages = [Stage([v for v in tables.order if stage_of[v] == s], [problem.devices[d].id for d in groups[s]])
              for s in range(p)]
    if not placement:
        space = "contiguous stages of a topological order, stage k on device k"
    elif exhaustive:
        space = "contiguous stages of a topological order, any stage-to-device mapping"
    else:
        space = (f"contiguous stages of a topological order; placement by hierarchical order and local search "
                 f"(not certified beyond {MAX_EXACT_PLACEMENT_DEVICES} devices)")
    if problem.max_replicas > 1:
        space += f"; or replica groups of up to {problem.max_replicas} consecutive devices of the hierarchical order"
    # The DP's space holds an optimum of the reference problem only when every placement was
    # searched (or all are alike), convex partitions are contiguous here, and no replicas are allowed
    # (its replica groups are runs of one device order, not every group).
    all_placements = (placement and exhaustive) or len(device_classes(problem)) == 1
    covers = all_placements and problem.max_replicas == 1 and contiguous_is_convex(problem)
    space_done = search.complete and (exhaustive or not placement or blind_is_all)
    sol = Solution(stages, predicted=sc.as_predicted(), solver={"search_space": space,
                                                                "timed_out": not search.complete})
    return certify(problem, sol, method="dp", started=started, exact_over=space, covers_reference=covers,
                   space_optimal=space_done, space_lower_s=min(search.lower, sc.iteration_s))
