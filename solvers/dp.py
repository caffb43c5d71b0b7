"""Exact dynamic programme over contiguous stages of a topological order.

Search space: the nodes in ``problem.order`` are cut into ``p`` contiguous,
non-empty stages (``p`` is ``problem.stages`` or, when that is null, every
value from 1 to the number of devices), and each stage runs on its own device:
any injective stage-to-device mapping (topology-aware placement), or stage
``k`` on device ``k`` with ``placement=False``. Within that space the programme
returns a solution with
the smallest *reference* iteration time ``sum t_s + (m - 1) max t_s`` that
meets the schedule-aware memory limit, exactly, for any link matrix, device
speeds and skip connections.

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
from dataclasses import dataclass

from solvers.errors import InfeasibleError
from solvers.problem import Problem
from solvers.score import Score, score_assignment, transfer_cost_s
from solvers.solution import Solution, Stage, assignment_from_cuts

__all__ = ["solve_dp", "stage_counts", "min_peak_bytes", "device_classes"]

_REL_TOL = 1e-9


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


def _solve_fixed_p(problem: Problem, tables: _Tables, p: int, ub: float,
                   classes: list[list[int]] | None) -> tuple[_Label | None, float]:
    """Best label for exactly ``p`` stages with iteration time below ``ub``, and its time.

    ``classes`` None places stage ``k`` on device ``k``; otherwise each stage takes
    the lowest unused device of any group of interchangeable devices.
    """
    n, m = tables.n, problem.micro_batches
    factor = 1.0 + problem.optimizer_state_factor
    cap = ub / m * (1 + _REL_TOL) if math.isfinite(ub) else math.inf
    ub_limit = ub * (1 + _REL_TOL) if math.isfinite(ub) else math.inf
    usable = range(p) if classes is None else range(len(problem.devices))
    max_speed = max(problem.devices[d].speed for d in usable)
    start_used = () if classes is None else (0,) * len(classes)
    # frontier[(j, k)] maps (used devices per group, pending senders) to Pareto sets of labels.
    frontier: dict[tuple[int, int], dict[tuple, list[_Label]]] = {
        (0, 0): {(start_used, ()): [_Label(0.0, 0.0, (), None, 0, 0, -1)]}
    }
    best: _Label | None = None
    best_t = math.inf
    for j in range(n):
        for k in range(p):
            by_key = frontier.pop((j, k), None)
            if not by_key:
                continue
            inflight = problem.inflight(k, p)
            last_stage = k == p - 1
            j_max = n - (p - k - 1)
            for (used, pending), labels in by_key.items():
                pend_stage = {u: a for u, a, _ in pending}
                pend_dev = {u: d for u, _, d in pending}
                pend_stages = sorted(set(pend_stage.values()))
                slot = {a: i for i, a in enumerate(pend_stages)}
                if classes is None:
                    candidates = [(k, used)]
                else:
                    candidates = [(group[used[c]], used[:c] + (used[c] + 1,) + used[c + 1:])
                                  for c, group in enumerate(classes) if used[c] < len(group)]
                for d, new_used in candidates:
                    dev = problem.devices[d]
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
                                    c = 2.0 * transfer_cost_s(problem, nbytes, pend_dev[u], d)
                                    comm_in += c - recv_cost.get(u, 0.0)
                                    recv_cost[u] = c
                            if params * factor + acts * inflight > dev.memory_bytes:
                                break
                            t_k = compute / dev.speed + comm_in
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
                                break  # every quantity here only grows with j2
                            total = label.total + compute / dev.speed + 2.0 * comm_in
                            rest = tables.suffix_fb[j2] / max_speed
                            stages_left = p - k - 1
                            future_max = rest / stages_left if stages_left else 0.0
                            if total + rest + (m - 1) * biggest > ub_limit:
                                break  # grows with j2
                            if total + rest + (m - 1) * future_max > ub_limit:
                                continue  # shrinks with j2: a longer stage may still do
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
    return best, best_t


def _deepening(problem: Problem, tables: _Tables, p: int, ub: float,
               classes: list[list[int]] | None) -> tuple[_Label | None, float]:
    """Run the search under growing bounds ``G``, starting just above a lower bound.

    A search bounded by ``G`` finds the optimum whenever it is ``<= G`` (only
    labels whose lower bound exceeds ``G`` are pruned), so the first bound
    that yields a solution yields the optimal one, and tight bounds prune hard.
    """
    speeds = sorted((d.speed for d in problem.devices), reverse=True)[:p] if classes is not None \
        else [problem.devices[k].speed for k in range(p)]
    total = tables.suffix_fb[0]
    lower = total / max(speeds) + (problem.micro_batches - 1) * total / sum(speeds)
    if lower > ub * (1 + _REL_TOL):
        return None, math.inf
    bound = lower * 1.02
    while True:
        bound = min(bound, ub)
        label, t = _solve_fixed_p(problem, tables, p, bound, classes)
        if label is not None or bound >= ub:
            return label, t
        bound *= 1.15


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
    """Smallest over the search space of the largest stage's peak memory."""
    tables = _Tables(problem)
    n, factor = tables.n, 1.0 + problem.optimizer_state_factor
    best = math.inf
    for p in stage_counts(problem):
        # cost[k][j]: min over cuts of the max peak of stages 0..k-1 covering [0, j)
        prev = [0.0] + [math.inf] * n
        for k in range(p):
            cur = [math.inf] * (n + 1)
            inflight = problem.inflight(k, p)
            for j in range(n):
                if prev[j] == math.inf:
                    continue
                params = acts = 0.0
                for j2 in range(j + 1, n + 1):
                    params += tables.param[j2 - 1]
                    acts += tables.act[j2 - 1]
                    v = max(prev[j], params * factor + acts * inflight)
                    if v < cur[j2]:
                        cur[j2] = v
            prev = cur
        best = min(best, prev[n])
    return best


def solve_dp(problem: Problem, placement: bool = True) -> Solution:
    """Optimal contiguous plan (see the module docstring for the exact search space).

    ``placement=True`` also chooses which device runs each stage (any injective
    mapping, with interchangeable devices collapsed); ``False`` runs stage ``k``
    on device ``k``, the topology-blind baseline.
    """
    started = time.perf_counter()
    tables = _Tables(problem)
    classes = device_classes(problem) if placement else None
    ub, incumbent = math.inf, None
    for p in stage_counts(problem):
        cuts = _balanced_cuts(tables, p)
        sc = score_assignment(problem, assignment_from_cuts(tables.order, cuts), list(range(p)))
        if sc.feasible and sc.iteration_s < ub:
            ub, incumbent = sc.iteration_s, (p, cuts, list(range(p)))
    # With one group of interchangeable devices, placement is stage k on device k: one search.
    searches = [None, classes] if classes is not None and len(classes) > 1 else [None]
    for search_classes in searches:  # the blind optimum first: a tight bound for placement
        for p in stage_counts(problem):
            label, t = _deepening(problem, tables, p, ub, search_classes)
            if label is not None and t <= ub * (1 + _REL_TOL):
                cuts, devices = [], []
                while label is not None and label.parent is not None:
                    if label.start > 0:
                        cuts.append(label.start)
                    devices.append(label.device)
                    label = label.parent
                ub, incumbent = t, (p, sorted(cuts), devices[::-1])
    if incumbent is None:
        need = min_peak_bytes(problem)
        have = max(d.memory_bytes for d in problem.devices)
        raise InfeasibleError(
            f"no contiguous partition of {tables.n} nodes over {len(problem.devices)} devices fits in memory: "
            f"the smallest possible stage peak is {need:.4g} bytes, the largest device has {have:.4g} bytes; "
            "add devices, use devices with at least that much memory, or lower micro_batches/activation memory",
            min_peak_bytes=need,
        )
    p, cuts, devices = incumbent
    stage_of = assignment_from_cuts(tables.order, cuts)
    sc: Score = score_assignment(problem, stage_of, devices)
    stages = [Stage([v for v in tables.order if stage_of[v] == s], [problem.devices[devices[s]].id])
              for s in range(p)]
    space = ("contiguous stages of a topological order, any stage-to-device mapping" if placement
             else "contiguous stages of a topological order, stage k on device k")
    return Solution(
        stages,
        predicted=sc.as_predicted(),
        solver={"method": "dp", "optimal": True, "lower_bound_s": sc.iteration_s,
                "time_s": time.perf_counter() - started, "search_space": space},
    )
