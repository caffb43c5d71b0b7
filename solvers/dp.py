"""Exact dynamic programme over contiguous stages of a topological order.

Search space: the nodes in ``problem.order`` are cut into ``p`` contiguous,
non-empty stages (``p`` is ``problem.stages`` or, when that is null, every
value from 1 to the number of devices), and each stage runs on its own device:
any injective stage-to-device mapping (topology-aware placement, up to
:data:`MAX_EXACT_PLACEMENT_DEVICES` devices), or stage ``k`` on device ``k``
with ``placement=False``. With ``max_replicas > 1`` (format version 2) a stage
may instead take a run of consecutive devices of the hierarchical device order
as a replica group. Within that space the programme returns a solution with
the smallest *reference* iteration time ``sum t_s + (m - 1) max t_s`` that
meets the schedule-aware memory limit, exactly, for any link matrix, device
speeds and skip connections — or, when ``time_limit_s`` stops it first, its
best plan with a proven lower bound (``optimal: false``, ``gap``).

The searches run cheapest first, each one's optimum bounding the next: stage
``k`` on device ``k``, the hierarchical device order, a local search over the
mapping alternated with exact cutting, replica runs, then every mapping under
a best-link relaxation that skips stage counts which cannot win. The anchors'
plans seed the incumbent (their quadratic partitioners only up to
:data:`ANCHOR_SEED_LIMIT`), so no anchor partitioner beats the result. With
placement, ``time_limit_s`` applies twice: once to the stage-``k``-on-device-``k``
search (as the topology-blind baseline gets it, so that it never beats ours),
and once to all the placement searches together.

Why a label-setting DP rather than the textbook ``(position, stage)`` table:
a stage's time includes its outgoing transfers, one per *later stage* that
consumes a tensor, so it depends on cuts that are made after the stage is
closed, and the objective mixes a sum with a maximum. A state here is
``(cut position, stages so far, pending senders)`` where the pending senders
are the nodes before the cut whose consumers lie after it, with their stage.
Each state keeps the Pareto set of labels ``(sum of stage times, max of
finished stage times, times of stages that can still grow)``; a label is
dropped only when another is no worse in every coordinate, which keeps the
search exact. Two bounds prune it: every stage of an optimal plan takes at
most ``UB / m`` (because ``T >= m max t_s``), and a label whose lower bound
already exceeds the incumbent ``UB`` is dropped. For chains and the short
skips of residual networks the pending set holds one or two nodes, so the
search is close to the quadratic DP; long skips (U-Net) enlarge it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from solvers.errors import InfeasibleError
from solvers.groups import GroupTable, allreduce_s, hierarchical_order
from solvers.placement import improve_placement
from solvers.problem import Problem
from solvers.score import Score, score_assignment
from solvers.solution import Solution, Stage, assignment_from_cuts

__all__ = ["solve_dp", "stage_counts", "min_peak_bytes", "device_classes", "MAX_EXACT_PLACEMENT_DEVICES"]

_REL_TOL = 1e-9
MAX_EXACT_PLACEMENT_DEVICES = 16
"""Beyond this many devices placement is heuristic (hierarchical order + local search)."""
ANCHOR_SEED_LIMIT = 2e7
"""Seed with the anchors' quadratic partitioners only up to ``nodes^2 x stages`` this large."""


@dataclass
class _Label:
    total: float               # sum of stage times so far (pending stages included)
    max_done: float            # max over stages whose time can no longer grow
    pending_t: tuple           # times of stages that still have pending senders
    parent: "_Label | None"
    start: int                 # segment of the stage this label closed: [start, end)
    end: int
    device: int                # device index of that stage


def stage_counts(problem: Problem) -> list[int]:
    """The numbers of stages the search covers."""
    if problem.stages is not None:
        return [problem.stages]
    return list(range(1, min(len(problem.devices), len(problem.nodes)) + 1))


def _fastest_link(problem: Problem) -> tuple[float, float]:
    """Largest bandwidth and smallest latency between two distinct devices (inf, 0 for one device)."""
    others = [(i, j) for i in range(len(problem.devices)) for j in range(len(problem.devices)) if i != j]
    return (max((problem.bandwidth_Bps[i][j] for i, j in others), default=math.inf),
            min((problem.latency_s[i][j] for i, j in others), default=0.0))


class _Tables:
    """Position-indexed views of the problem shared by the DP and its bounds."""

    def __init__(self, problem: Problem) -> None:
        nodes = problem.node_map()
        self.order = problem.order
        pos = {node_id: i for i, node_id in enumerate(self.order)}
        n = self.n = len(self.order)
        self.fb = [nodes[v].fwd_s + nodes[v].bwd_s for v in self.order]
        self.param = [nodes[v].param_bytes for v in self.order]
        self.act = [nodes[v].act_bytes for v in self.order]
        self.last_use = [-1] * n
        self.inputs: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        for e in problem.edges:
            u, w = pos[e.src], pos[e.dst]
            self.inputs[w].append((u, e.bytes))
            self.last_use[u] = max(self.last_use[u], w)
        self.suffix_fb = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            self.suffix_fb[i] = self.suffix_fb[i + 1] + self.fb[i]
        # A stage that starts at position c receives at least the inputs of node c that
        # come from before c, each over the fastest link: 4 one-way transfers in the sum
        # (forward and gradient, charged to both ends). Different boundaries have
        # different receiving stages, so these bounds add up without double counting.
        bw_max, lat_min = _fastest_link(problem)
        bw_max *= problem.max_replicas
        self.enter_lb = [0.0] * (n + 1)
        for c in range(1, n):
            first: dict[int, float] = {}
            for u, nbytes in self.inputs[c]:
                first[u] = max(first.get(u, 0.0), nbytes)
            self.enter_lb[c] = 4.0 * sum(b / bw_max + lat_min for b in first.values())
        # cheapest[c]: the smallest enter bounds among positions > c, ascending (at most 16 kept).
        self.cheapest: list[list[float]] = [[] for _ in range(n + 1)]
        for c in range(n - 2, -1, -1):
            self.cheapest[c] = sorted(self.cheapest[c + 1] + [self.enter_lb[c + 1]])[:16]

    def future_transfer_lb(self, cut: int, boundaries: int) -> float:
        """Least transfer time the sum must still pay for ``boundaries`` cuts, the first at ``cut``."""
        if boundaries <= 0:
            return 0.0
        more = self.cheapest[cut][:boundaries - 1]
        return self.enter_lb[cut] + sum(more) if len(more) == boundaries - 1 else math.inf


def _balanced_cuts(tables: _Tables, p: int) -> list[int]:
    """Cut positions that split compute evenly: a cheap incumbent for pruning."""
    total = tables.suffix_fb[0]
    cuts, acc, k = [], 0.0, 1
    for i in range(tables.n):
        acc += tables.fb[i]
        if k < p and acc >= total * k / p and i + 1 < tables.n and len(cuts) < p - 1:
            cuts.append(i + 1)
            k += 1
    while len(cuts) < p - 1:  # degenerate costs: fill with the last free positions
        cand = [c for c in range(1, tables.n) if c not in cuts]
        cuts.append(max(c for c in cand))
        cuts.sort()
    return cuts


def device_classes(problem: Problem) -> list[list[int]]:
    """Groups of interchangeable devices: swapping two of a group changes no cost.

    Devices ``i`` and ``j`` are interchangeable when they have the same speed and
    memory and exchanging them leaves both link matrices unchanged. Exchanges are
    automorphisms, so this is an equivalence relation; the search then only ever
    takes the lowest unused device of a group, which loses no solution (any plan
    can be relabelled within groups into one that does, at the same cost).
    """
    bw, lat, devs = problem.bandwidth_Bps, problem.latency_s, problem.devices
    n = len(devs)

    def swappable(i: int, j: int) -> bool:
        if (devs[i].speed, devs[i].memory_bytes) != (devs[j].speed, devs[j].memory_bytes):
            return False
        for mat in (bw, lat):
            if mat[i][j] != mat[j][i]:
                return False
            for x in range(n):
                if x not in (i, j) and (mat[i][x] != mat[j][x] or mat[x][i] != mat[x][j]):
                    return False
        return True

    classes: list[list[int]] = []
    for d in range(n):
        for group in classes:
            if swappable(group[0], d):
                group.append(d)
                break
        else:
            classes.append([d])
    return classes


class _Timeout(Exception):
    """The deadline passed inside a search."""


class _Space:
    """Which device group stage ``k`` may take, given the devices used so far.

    * ``"order"``: stage ``k`` on device ``order[k]`` (``order = 0, 1, ...`` is topology-blind).
    * ``"classes"``: any unused device, one per group of interchangeable devices
      (any injective mapping, up to relabelling).
    * ``"runs"``: the next ``r = 1..max_replicas`` devices of ``order`` as one replica group.
    """

    def __init__(self, kind: str, table: GroupTable, order: list[int] | None = None,
                 classes: list[list[int]] | None = None, max_replicas: int = 1) -> None:
        self.kind, self.table, self.order, self.classes = kind, table, order, classes
        self.max_replicas = max_replicas
        n = len(table.problem.devices)
        self._runs: dict[tuple[int, int], int] = {}
        if kind == "runs":
            for start in range(n):
                for r in range(1, min(max_replicas, n - start) + 1):
                    self._runs[(start, r)] = table.add(tuple(order[start:start + r]))

    def start(self) -> tuple:
        return (0,) * len(self.classes) if self.kind == "classes" else ()

    def candidates(self, used: tuple, k: int, p: int) -> list[tuple[int, tuple]]:
        if self.kind == "order":
            return [(self.order[k], used)]
        if self.kind == "classes":
            return [(group[used[c]], used[:c] + (used[c] + 1,) + used[c + 1:])
                    for c, group in enumerate(self.classes) if used[c] < len(group)]
        taken = used[0] if used else 0
        room = len(self.order) - taken - (p - k - 1)
        return [(self._runs[(taken, r)], (taken + r,)) for r in range(1, min(self.max_replicas, room) + 1)]

    def speeds(self, p: int) -> tuple[float, float]:
        """(fastest stage speed, largest total speed of ``p`` stages) over this space."""
        devs = self.table.problem.devices
        if self.kind == "order":
            sp = [devs[d].speed for d in self.order[:p]]
            return max(sp), sum(sp)
        if self.kind == "classes":
            sp = sorted((d.speed for d in devs), reverse=True)[:p]
            return max(sp), sum(sp)
        return max(self.table.groups[g].speed for g in self._runs.values()), sum(d.speed for d in devs)


def _solve_fixed_p(problem: Problem, tables: _Tables, p: int, ub: float, space: _Space,
                   deadline: float) -> tuple[_Label | None, float, float]:
    """Best label for exactly ``p`` stages with iteration time below ``ub``, its time, and the
    smallest lower bound of the labels the bound cut off (a proven bound when none is found)."""
    n, m = tables.n, problem.micro_batches
    groups = space.table.groups
    factor = 1.0 + problem.optimizer_state_factor
    cap = ub / m * (1 + _REL_TOL) if math.isfinite(ub) else math.inf
    ub_limit = ub * (1 + _REL_TOL) if math.isfinite(ub) else math.inf
    max_speed = space.speeds(p)[0]
    # frontier[(j, k)] maps (used devices, pending senders) to Pareto sets of labels.
    frontier: dict[tuple[int, int], dict[tuple, list[_Label]]] = {
        (0, 0): {(space.start(), ()): [_Label(0.0, 0.0, (), None, 0, 0, -1)]}
    }
    best: _Label | None = None
    best_t = math.inf
    pruned = math.inf   # smallest lower bound of anything cut off by the bound: what a failure proves
    for j in range(n):
        if time.perf_counter() > deadline:
            raise _Timeout
        for k in range(p):
            by_key = frontier.pop((j, k), None)
            if not by_key:
                continue
            inflight = problem.inflight(k, p)
            last_stage = k == p - 1
            stages_left = p - k - 1
            j_max = n - stages_left
            for (used, pending), labels in by_key.items():
                pend_stage = {u: a for u, a, _ in pending}
                pend_dev = {u: d for u, _, d in pending}
                pend_stages = sorted(set(pend_stage.values()))
                slot = {a: i for i, a in enumerate(pend_stages)}
                for d, new_used in space.candidates(used, k, p):
                    group = groups[d]
                    act_scale = inflight / group.replicas
                    for label in labels:
                        compute = params = acts = 0.0
                        recv: dict[int, float] = {}        # pending node -> bytes received
                        recv_cost: dict[int, float] = {}   # pending node -> 2 x one-way time
                        comm_in = 0.0
                        alive_seg: list[int] = []
                        for j2 in range(j + 1, j_max + 1):
                            x = j2 - 1
                            compute += tables.fb[x]
                            params += tables.param[x]
                            acts += tables.act[x]
                            for u, nbytes in tables.inputs[x]:
                                if u < j and nbytes >= recv.get(u, -1.0):
                                    recv[u] = nbytes
                                    c = 2.0 * space.table.transfer_s(nbytes, pend_dev[u], d)
                                    comm_in += c - recv_cost.get(u, 0.0)
                                    recv_cost[u] = c
                            if params * factor + acts * act_scale > group.memory_bytes:
                                break
                            ar = allreduce_s(group, params) / m
                            t_k = compute / group.speed + comm_in + ar
                            alive_seg = [u for u in alive_seg if tables.last_use[u] >= j2]
                            if tables.last_use[x] >= j2:
                                alive_seg.append(x)
                            # Grow the pending stages by what they sent to this stage.
                            grown = list(label.pending_t)
                            for u, c in recv_cost.items():
                                grown[slot[pend_stage[u]]] += c
                            new_pending = tuple(
                                [(u, a, da) for u, a, da in pending if tables.last_use[u] >= j2]
                                + [(u, k, d) for u in alive_seg]
                            )
                            still = {a for _, a, _ in new_pending}
                            max_done = label.max_done
                            for a, t_a in zip(pend_stages, grown):
                                if a not in still:
                                    max_done = max(max_done, t_a)
                            if k not in still:
                                max_done = max(max_done, t_k)
                            new_t = tuple(
                                [t_a for a, t_a in zip(pend_stages, grown) if a in still]
                                + ([t_k] if k in still else [])
                            )
                            biggest = max((max_done, *new_t))
                            if biggest > cap:
                                pruned = min(pruned, m * biggest)  # T >= m max t_s
                                break  # every quantity here only grows with j2
                            total = label.total + compute / group.speed + 2.0 * comm_in + ar
                            rest = tables.suffix_fb[j2] / max_speed
                            future_max = rest / stages_left if stages_left else 0.0
                            if total + rest + (m - 1) * biggest > ub_limit:
                                pruned = min(pruned, total + rest + (m - 1) * biggest)
                                break  # grows with j2
                            bound = total + rest + (m - 1) * max(biggest, future_max)
                            if stages_left:
                                bound += tables.future_transfer_lb(j2, stages_left)
                            if bound > ub_limit:
                                pruned = min(pruned, bound)
                                continue  # may shrink with j2: a longer stage may still do
                            if last_stage and j2 < n:
                                continue
                            new_label = _Label(total, max_done, new_t, label, j, j2, d)
                            if j2 == n:
                                t_iter = total + (m - 1) * max_done
                                if t_iter < best_t:
                                    best, best_t = new_label, t_iter
                                    ub_limit = min(ub_limit, t_iter * (1 + _REL_TOL))
                                    cap = min(cap, t_iter / m * (1 + _REL_TOL))
                                continue
                            _insert(frontier.setdefault((j2, k + 1), {}).setdefault((new_used, new_pending), []),
                                    new_label, m - 1)
    return best, best_t, pruned


def _deepening(problem: Problem, tables: _Tables, p: int, ub: float, space: _Space,
               deadline: float, proven: dict[int, float]) -> tuple[_Label | None, float]:
    """Run the search under growing bounds ``G``, starting just above a lower bound.

    A search bounded by ``G`` finds the optimum whenever it is ``<= G`` (only
    labels whose lower bound exceeds ``G`` are pruned), so the first bound
    that yields a solution yields the optimal one, and tight bounds prune hard.
    ``proven[p]`` records the best lower bound on ``p`` stages proven so far,
    which is what a timed-out search can still certify.
    """
    lower = _analytic_lower(problem, tables, p, space)
    proven[p] = lower
    if lower > ub * (1 + _REL_TOL):
        return None, math.inf
    bound = lower * 1.02
    for _ in range(60):   # past that many failed bounds, one search at the incumbent
        bound = min(bound, ub)
        label, t, pruned = _solve_fixed_p(problem, tables, p, bound, space, deadline)
        if label is not None:
            proven[p] = t
            return label, t
        proven[p] = min(pruned, ub)   # nothing at or below the bound; all else was pruned above it
        if bound >= ub:
            return None, math.inf
        # Step at least to what the failed search proved; close to the incumbent, search at it
        # (a search just below costs nearly as much).
        bound = max(pruned, bound * 1.15)
        if bound >= 0.95 * ub:
            bound = ub
    label, t, _ = _solve_fixed_p(problem, tables, p, ub, space, deadline)
    proven[p] = t if label is not None else ub
    return label, t


def _insert(front: list[_Label], new: _Label, weight: float) -> None:
    """Add ``new`` to a Pareto set unless dominated; drop labels it dominates.

    ``a`` dominates ``b`` (same state) when, whatever the future stages add,
    ``a`` ends no worse: ``total + weight * max`` with ``weight = m - 1`` is
    no larger for every future maximum ``X`` iff ``a.total <= b.total`` and
    ``a.total + weight a.max_done <= b.total + weight b.max_done``; pending
    stages grow by the same amounts in both, so theirs must be no larger.
    """
    def leq(a: _Label, b: _Label) -> bool:
        return (a.total <= b.total
                and a.total + weight * a.max_done <= b.total + weight * b.max_done
                and all(x <= y for x, y in zip(a.pending_t, b.pending_t)))
    for old in front:
        if leq(old, new):
            return
    front[:] = [old for old in front if not leq(new, old)]
    front.append(new)


def min_peak_bytes(problem: Problem) -> float:
    """Smallest over the search space of the largest per-device peak memory of a stage.

    With ``max_replicas > 1`` a stage may spread its activations over a replica
    group of consecutive devices, so the programme also tracks devices used.
    """
    tables = _Tables(problem)
    n, factor, d = tables.n, 1.0 + problem.optimizer_state_factor, len(problem.devices)
    reps = range(1, problem.max_replicas + 1)
    best = math.inf
    for p in stage_counts(problem):
        # prev[(j, used)]: min over plans of stages 0..k-1 covering [0, j) on `used` devices of the max peak
        prev = {(0, 0): 0.0}
        for k in range(p):
            cur: dict[tuple[int, int], float] = {}
            inflight = problem.inflight(k, p)
            for (j, used), v0 in prev.items():
                params = acts = 0.0
                for j2 in range(j + 1, n + 1):
                    params += tables.param[j2 - 1]
                    acts += tables.act[j2 - 1]
                    for r in reps:
                        if used + r + (p - k - 1) > d:
                            break
                        v = max(v0, params * factor + acts * inflight / r)
                        if v < cur.get((j2, used + r), math.inf):
                            cur[(j2, used + r)] = v
            prev = cur
        best = min([best] + [v for (j, _), v in prev.items() if j == n])
    return best


def _analytic_lower(problem: Problem, tables: _Tables, p: int, space: _Space) -> float:
    fastest, together = space.speeds(p)
    total = tables.suffix_fb[0]
    return total / fastest + (problem.micro_batches - 1) * total / together


class _Search:
    """The incumbent and what the searches so far certify about the optimum."""

    def __init__(self, problem: Problem, tables: _Tables, table: GroupTable, deadline: float) -> None:
        self.problem, self.tables, self.table, self.deadline = problem, tables, table, deadline
        self.ub = math.inf
        self.incumbent: tuple[int, list[int], list[tuple[int, ...]]] | None = None
        self.lower = math.inf          # lower bound from searches cut short by the deadline
        self.complete = True

    def offer(self, p: int, cuts: list[int], groups: list[tuple[int, ...]]) -> None:
        sc = score_assignment(self.problem, assignment_from_cuts(self.tables.order, cuts), groups)
        if sc.feasible and sc.iteration_s < self.ub * (1 - 1e-12):
            self.ub, self.incumbent = sc.iteration_s, (p, list(cuts), list(groups))

    def exact(self, space: _Space, certifies: bool, floor: dict[int, float] | None = None,
              share: float = 1.0) -> None:
        """Search ``space`` for every stage count; if cut short and ``certifies``, keep its lower bound.

        ``floor[p]`` is a known lower bound for ``p`` stages (from a relaxation): counts whose
        floor already reaches the incumbent are skipped. ``share`` is the fraction of the
        remaining time this search may take (the rest is left to later searches).
        """
        floor = floor or {}
        deadline = self.deadline
        if share < 1.0 and math.isfinite(deadline):
            deadline = time.perf_counter() + share * max(0.0, deadline - time.perf_counter())
        counts = stage_counts(self.problem)
        for i, p in enumerate(counts):
            if floor.get(p, 0.0) >= self.ub * (1 + _REL_TOL):
                continue
            proven: dict[int, float] = {}
            try:
                label, t = _deepening(self.problem, self.tables, p, self.ub, space, deadline, proven)
            except _Timeout:
                if certifies:
                    self.complete = False
                    rest = [max(proven.get(p, 0.0), floor.get(p, 0.0))] + [
                        max(_analytic_lower(self.problem, self.tables, q, space), floor.get(q, 0.0))
                        for q in counts[i + 1:]]
                    self.lower = min([self.lower] + rest)
                return
            if label is not None and t <= self.ub * (1 + _REL_TOL):
                cuts, groups = [], []
                while label is not None and label.parent is not None:
                    if label.start > 0:
                        cuts.append(label.start)
                    groups.append(self.table.groups[label.device].devices)
                    label = label.parent
                self.ub, self.incumbent = t, (p, sorted(cuts), groups[::-1])


def _placement_floor(problem: Problem, ub: float, deadline: float) -> dict[int, float]:
    """Lower bounds per stage count for every single-device mapping, from a relaxation.

    Every link is made as fast as the fastest link of the problem, so no
    mapping costs less than the relaxed optimum; with identical devices the
    relaxation is one search over stage ``k`` on device ``k``. A count whose
    relaxed optimum is not below ``ub`` gets ``ub``.
    """
    d = len(problem.devices)
    bw, lat = _fastest_link(problem)
    relaxed = replace(problem, order=[], max_replicas=1,
                      bandwidth_Bps=[[0.0 if i == j else bw for j in range(d)] for i in range(d)],
                      latency_s=[[0.0 if i == j else lat for j in range(d)] for i in range(d)])
    tables, table = _Tables(relaxed), GroupTable(relaxed)
    space = _Space("classes", table, classes=device_classes(relaxed))
    floor: dict[int, float] = {}
    for p in stage_counts(relaxed):
        proven: dict[int, float] = {}
        try:
            label, t = _deepening(relaxed, tables, p, ub, space, deadline, proven)
        except _Timeout:
            floor[p] = proven.get(p, 0.0)
            break
        floor[p] = t if label is not None else ub
    return floor


def solve_dp(problem: Problem, placement: bool = True, time_limit_s: float | None = None) -> Solution:
    """Optimal contiguous plan (see the module docstring for the exact search space).

    ``placement=True`` also chooses which device runs each stage: any injective
    mapping for up to 16 devices (interchangeable devices collapsed), found
    after fast incumbents from the hierarchical device order and a local search;
    beyond 16 devices only those heuristics run and the solution says it is not
    certified. ``placement=False`` runs stage ``k`` on device ``k``, the
    topology-blind baseline. With ``max_replicas > 1`` stages may also take runs
    of consecutive devices of the hierarchical order as replica groups.
    ``time_limit_s`` stops the exact searches (with placement: the topology-blind
    search, then the placement searches, each within the limit); the solution then
    reports ``optimal: false`` with a proven lower bound.
    """
    started = time.perf_counter()
    deadline = started + time_limit_s if time_limit_s is not None else math.inf
    tables = _Tables(problem)
    table = GroupTable(problem)
    n_dev = len(problem.devices)
    identity = list(range(n_dev))
    search = _Search(problem, tables, table, deadline)
    from solvers.anchors import CUT_ANCHORS, QUADRATIC_ANCHORS  # the anchors import this module
    for p in stage_counts(problem):
        search.offer(p, _balanced_cuts(tables, p), [(k,) for k in range(p)])
    anchor_p = max(stage_counts(problem))
    for cutter, weights in CUT_ANCHORS:  # the anchors' plans are in our space: never end worse than one
        if cutter in QUADRATIC_ANCHORS and tables.n ** 2 * anchor_p > ANCHOR_SEED_LIMIT:
            continue  # their O(n^2 p) DPs would cost more than they save here
        search.offer(anchor_p, cutter(weights(problem), anchor_p), [(k,) for k in range(anchor_p)])
    exhaustive = placement and n_dev <= MAX_EXACT_PLACEMENT_DEVICES
    classes = device_classes(problem) if placement else [[d] for d in identity]
    blind_is_all = not placement or len(classes) == 1
    order = hierarchical_order(problem) if placement else identity
    if placement and not blind_is_all:
        # Stage k on device k gets the whole limit, as the topology-blind baseline would (so it
        # is never better than ours); the placement searches then get a limit of their own.
        search.exact(_Space("order", table, order=identity), certifies=False)
        if time_limit_s is not None:
            search.deadline = time.perf_counter() + time_limit_s
        deadline = search.deadline
        if order != identity:
            search.exact(_Space("order", table, order=order), certifies=False, share=0.5)
    else:
        search.exact(_Space("order", table, order=identity), certifies=blind_is_all)
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
            search.exact(_Space("order", table, order=devices + [d for d in order if d not in devices]),
                         certifies=False, share=0.25)
    if problem.max_replicas > 1:
        search.exact(_Space("runs", table, order=order, max_replicas=problem.max_replicas), certifies=True,
                     share=0.5 if exhaustive and not blind_is_all else 1.0)
    if exhaustive and not blind_is_all and len(problem.devices) > 1:
        floor = (_placement_floor(problem, search.ub, time.perf_counter() + 0.5 * max(0.0, deadline - time.perf_counter()))
                 if search.incumbent is not None else {})
        search.exact(_Space("classes", table, classes=classes), certifies=True, floor=floor)
    if search.incumbent is None:
        need = min_peak_bytes(problem)
        have = max(d.memory_bytes for d in problem.devices)
        if not search.complete and need <= have:
            raise InfeasibleError(
                f"no plan that fits in memory was found within the time limit of {time_limit_s} s (the smallest "
                f"stage peak, {need:.4g} bytes, would fit on the largest device, {have:.4g} bytes); "
                "raise the time limit or add memory", min_peak_bytes=need)
        raise InfeasibleError(
            f"no contiguous partition of {tables.n} nodes over {n_dev} devices fits in memory: "
            f"the smallest possible stage peak is {need:.4g} bytes, the largest device has {have:.4g} bytes; "
            "add devices, use devices with at least that much memory, or lower micro_batches/activation memory",
            min_peak_bytes=need,
        )
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
    certified = search.complete and (exhaustive or not placement or blind_is_all)
    if certified:
        lower = sc.iteration_s
    elif search.complete:   # placement beyond exact reach: only the compute bound holds
        classes_space = _Space("classes", table, classes=[[d] for d in identity])
        lower = min(_analytic_lower(problem, tables, q, classes_space) for q in stage_counts(problem))
    else:
        lower = min(search.lower, sc.iteration_s)
    return Solution(
        stages,
        predicted=sc.as_predicted(),
        solver={"method": "dp", "optimal": certified, "lower_bound_s": lower,
                "gap": (sc.iteration_s - lower) / sc.iteration_s if sc.iteration_s > 0 else 0.0,
                "time_s": time.perf_counter() - started, "search_space": space,
                "timed_out": not search.complete},
    )
