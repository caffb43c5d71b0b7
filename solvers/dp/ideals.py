"""The label search over chains of ideals: exact over convex partitions x placements, for graphs with few ideals.

A convex partition into ordered stages is a chain of ideals ``{} = I_0 < I_1 < ... < I_p = V``
(:mod:`solvers.dp.lattice`). The contiguous search (:mod:`solvers.dp.labels`) walks the prefixes of one
topological order, a sub-lattice: where a graph has side branches (ResNet's downsample convolutions, an
Inception tower) a plan may put a branch in a stage that no single order allows, so that search proves
nothing about them, and the bounds that cover them (:mod:`solvers.spine`, the ILP) stay far below the plan:
on ResNet-101 over the 8-GPU Titan V box the best bound was 16 % below the DP's plan, which this search
proves optimal in 2 s. It is the same label setting with ideals in place of cut positions: a state is
``(ideal, stages so far, used devices, pending senders)``, the labels and their dominance are
:class:`solvers.dp.frontier.Label` and :func:`~solvers.dp.frontier.insert_label`, the bounds, states and
incumbent it shares with that search :class:`~solvers.dp.frontier.LabelSearch`, and a stage is a difference
``J \\ I`` of two ideals whose work fits the per-stage cap ``UB / m``.

Its bounds, all over the lattice: the rest's work at the fastest speed and at the best balance; what every
node read after ``J`` must still send, from its own device over that device's cheapest link (it raises both
the sum and its stage's time); the rest's sum and slowest stage together
(:mod:`solvers.dp.ideal_bounds`); and, with devices of different speeds, the share slow devices must take
(:mod:`solvers.dp.speeds`).
"""

from __future__ import annotations

import math
import time
from typing import Callable

from solvers.groups import GroupTable
from solvers.problem import Problem
from solvers.dp.frontier import Label, LabelSearch, Timeout, insert_label, senders
from solvers.dp.ideal_bounds import IdealCompletion
from solvers.dp.lattice import Lattice, Step
from solvers.dp.space import Space
from solvers.dp.speeds import SpeedRest
from solvers.dp.tables import Tables

__all__ = ["solve_ideals_p"]


def solve_ideals_p(problem: Problem, tables: Tables, lattice: Lattice, p: int, ub: float, space: Space,
                   deadline: float) -> tuple[Label | None, float, float]:
    """Best label for ``p`` stages below ``ub`` over chains of ideals, its time, and the least bound pruned
    (the signature of :func:`solvers.dp.labels.solve_fixed_p`, so :func:`~solvers.dp.deepen.deepening` runs it)."""
    search = _IdealSearch(problem, tables, lattice, p, ub, space, deadline)
    for i, k, by_key in search.states(len(lattice.ideals), deadline):
        search.stages_from(i, k, by_key)
    return search.best, search.best_t, search.pruned


def _owing(table: GroupTable, n_dev: int) -> Callable[[int, float], float]:
    """What a tensor of ``nbytes`` read after the ideal still costs its device ``a`` at least: it is sent at
    least once, over that device's cheapest link (2 x one way; made once per device and size)."""
    links_from = [sorted({table.link(a, b) for b in range(n_dev) if b != a}) for a in range(n_dev)]
    owe_memo: dict[tuple[int, float], float] = {}

    def owes(a: int, nbytes: float) -> float:
        got = owe_memo.get((a, nbytes))
        if got is None:
            got = owe_memo[(a, nbytes)] = 2.0 * min((nbytes / bw + lat for bw, lat in links_from[a]), default=0.0)
        return got
    return owes


class _IdealSearch(LabelSearch):
    """One :func:`solve_ideals_p`: the shared bounds, and those over the lattice: the rest's work at the most
    speed its stages can have, what the senders still read owe (:func:`_owing`), and the rest's sum and
    slowest stage together (:class:`~solvers.dp.ideal_bounds.IdealCompletion`)."""

    __slots__ = ("lattice", "deadline", "total_work", "top_speed", "completion", "full", "size", "target_cache",
                 "one_way", "owes")

    def __init__(self, problem: Problem, tables: Tables, lattice: Lattice, p: int, ub: float, space: Space,
                 deadline: float) -> None:
        super().__init__(problem, tables, p, ub, space)
        self.lattice, self.deadline = lattice, deadline
        self.total_work = tables.suffix_fb[0]
        speeds = sorted((d.speed for d in problem.devices), reverse=True)
        self.top_speed = [sum(speeds[:s]) for s in range(p + 1)]   # the most speed s more stages can have
        self.completion = (IdealCompletion(lattice, p, self.m, self.max_speed, self.least_max, self.cap, deadline)
                           if p > 1 and math.isfinite(self.cap) else None)
        self.full = len(lattice.ideals) - 1
        self.size = [bin(mask).count("1") for mask in lattice.ideals]
        self.target_cache: dict[tuple[int, int], list[tuple]] = {}
        self.one_way: dict[tuple[float, int, int], float] = {}   # 2 x one-way time of a tensor between two devices
        self.owes = _owing(space.table, len(problem.devices))

    def stages_from(self, i: int, k: int, by_key: dict[tuple, list[Label]]) -> None:
        """Stage ``k``, from ideal ``i``, out of each state there: to each ideal it may end at, on each device."""
        p = self.p
        inflight = self.problem.inflight(k, p)
        stages_left = p - k - 1
        targets = self.targets(i, stages_left)
        for (used, pending), labels in by_key.items():
            if time.perf_counter() > self.deadline:
                raise Timeout
            pend = senders(pending)
            least_total = min(label.total for label in labels)
            viable = self.viable(targets, least_total, stages_left)
            if not viable:
                continue
            for d, new_used in self.space.candidates(used, k, p, pending):
                self.stages_on(i, k, d, new_used, labels, pend, least_total, viable, inflight, stages_left)

    def targets(self, i: int, stages_left: int) -> list[tuple]:
        """``(work, rest's work, ideal, step)`` of each ideal a stage from ``i`` may end at with ``stages_left``
        stages after it, lightest stage first (made once, under the cap of the first search to ask)."""
        targets = self.target_cache.get((i, stages_left))
        if targets is None:
            lattice, full, total_work = self.lattice, self.full, self.total_work
            reach = lattice.reach(i, self.cap * self.max_speed)
            chosen = [full] if stages_left == 0 and full in reach else [
                j for j in reach if j != full and self.n - self.size[j] >= stages_left] if stages_left else []
            targets = self.target_cache[(i, stages_left)] = sorted(
                (lattice.work[j] - lattice.work[i], total_work - lattice.work[j], j, lattice.step(i, j))
                for j in chosen)
        return targets

    def viable(self, targets: list[tuple], least_total: float, stages_left: int) -> list[tuple]:
        """The targets some device may take below the bound from a state whose cheapest label has ``least_total``
        (at the fastest speed, each transfer over the problem's cheapest link): dropped once for the state,
        not once per device."""
        m, max_speed, completion, top_speed = self.m, self.max_speed, self.completion, self.top_speed
        cap, ub_limit, pruned = self.cap, self.ub_limit, self.pruned
        viable = []
        for target in targets:
            work, rest_work, j, st = target
            compute = work / max_speed
            if compute > cap:   # and every later target, heavier
                pruned = min(pruned, m * compute)
                break
            future_max = rest_work / top_speed[stages_left] if stages_left else 0.0
            least_t = compute + st.recv_lb
            floor_j = least_total + least_t + st.recv_lb + 2.0 * (st.kept_lb + st.alive_lb) + (
                rest_work / max_speed) + (m - 1) * max(least_t + st.alive_lb, future_max)
            if completion is not None and stages_left and floor_j <= ub_limit:
                joint = least_total + least_t + st.recv_lb + completion.bound(
                    stages_left, j, least_t + st.alive_lb)
                if joint > floor_j:
                    floor_j = joint
            if floor_j > ub_limit:
                pruned = min(pruned, floor_j)
                continue
            viable.append(target)
        self.pruned = pruned
        return viable

    def stages_on(self, i: int, k: int, d: int, new_used: tuple | int, labels: list[Label], pend: tuple,
                  least_total: float, viable: list[tuple], inflight: int, stages_left: int) -> None:
        """The stage from ideal ``i`` to each viable target on device ``d``: its time and what its senders still
        owe, the tests every label of the state shares, then the labels it closes (:meth:`close`)."""
        m, factor, max_speed, least_max = self.m, self.factor, self.max_speed, self.least_max
        cap, ub_limit, pruned = self.cap, self.ub_limit, self.pruned
        completion, top_speed, one_way, owes = self.completion, self.top_speed, self.one_way, self.owes
        table = self.space.table
        pend_stage, pend_dev, pend_stages, slot = pend
        group = self.groups[d]
        speed = group.speed
        act_scale = inflight / group.replicas
        speed_rest = self.speed_rests.of(new_used, k, self.p)
        for work, rest_work, j, st in viable:
            compute = work / speed
            if compute > cap:   # and every later target, heavier
                pruned = min(pruned, m * compute)
                break
            rest = rest_work / max_speed
            future_max = rest_work / top_speed[stages_left] if stages_left else 0.0
            if st.params * factor + st.acts * act_scale > group.memory_bytes:
                continue
            sent: list[list[float]] = [[] for _ in pend_stages]
            comm_in = 0.0
            for u, nbytes in st.recv:
                c = one_way.get((nbytes, pend_dev[u], d))
                if c is None:
                    c = one_way[(nbytes, pend_dev[u], d)] = 2.0 * table.transfer_s(nbytes, pend_dev[u], d)
                comm_in += c
                sent[slot[pend_stage[u]]].append(c)
            t_k = compute + comm_in
            if t_k > cap:
                pruned = min(pruned, m * t_k)
                continue
            stage_total = compute + 2.0 * comm_in
            max_floor = future_max if future_max > least_max else least_max
            floor_j = least_total + stage_total + rest + (m - 1) * max(t_k, future_max)
            if floor_j > ub_limit:
                pruned = min(pruned, floor_j)
                continue
            # what the stages still sending will send at least (and their receivers receive)
            owe_slot = [0.0] * len(pend_stages)
            for u, nbytes in zip(st.kept, st.kept_bytes):
                owe_slot[slot[pend_stage[u]]] += owes(pend_dev[u], nbytes)
            owe_new = sum(owes(d, nbytes) for nbytes in st.alive_bytes)
            owe_total = 2.0 * (sum(owe_slot) + owe_new)
            floor_j = least_total + stage_total + owe_total + rest + (m - 1) * max(t_k + owe_new, future_max)
            if completion is not None and stages_left and floor_j <= ub_limit:
                joint = least_total + stage_total + completion.bound(stages_left, j, t_k + owe_new)
                if joint > floor_j:
                    floor_j = joint
            if speed_rest is not None and floor_j <= ub_limit:
                slow = least_total + stage_total + owe_total + speed_rest.bound(
                    rest_work, max(t_k + owe_new, future_max))
                if slow > floor_j:
                    floor_j = slow
            if floor_j > ub_limit:
                pruned = min(pruned, floor_j)
                continue
            self.pruned = pruned
            self.close(i, j, k, d, new_used, labels, pend, st, sent, owe_slot, owe_new, owe_total, t_k,
                       stage_total, rest, rest_work, future_max, max_floor, speed_rest, stages_left)
            pruned, cap, ub_limit = self.pruned, self.cap, self.ub_limit
        self.pruned = pruned

    def close(self, i: int, j: int, k: int, d: int, new_used: tuple | int, labels: list[Label], pend: tuple,
              st: Step, sent: list[list[float]], owe_slot: list[float], owe_new: float, owe_total: float,
              t_k: float, stage_total: float, rest: float, rest_work: float, future_max: float, max_floor: float,
              speed_rest: SpeedRest | None, stages_left: int) -> None:
        """Each label the stage ``J \\ I`` (ideals ``i`` to ``j``) on ``d`` closes: filed under the state it leads
        to, or, at the whole graph, the incumbent when it beats it. The update of
        :func:`solvers.dp.labels.solve_fixed_p`'s innermost loop, written out here too (a call per label would
        cost both searches)."""
        m, completion, full = self.m, self.completion, self.full
        cap, ub_limit, pruned, best_t = self.cap, self.ub_limit, self.pruned, self.best_t
        pend_stage, pend_dev, pend_stages, _ = pend
        still = {pend_stage[u] for u in st.kept}
        done_slots = [s for s, a in enumerate(pend_stages) if a not in still]
        kept_slots = [s for s, a in enumerate(pend_stages) if a in still]
        k_done = not st.alive
        target: list[Label] | None = None   # the Pareto set of the state the stage leads to
        perm: tuple | None = None
        grows = any(sent)
        for label in labels:
            grown = list(label.pending_t)
            if grows:
                for s, costs in enumerate(sent):
                    for c in costs:
                        grown[s] += c
            max_done = label.max_done
            for s in done_slots:
                if grown[s] > max_done:
                    max_done = grown[s]
            if k_done and t_k > max_done:
                max_done = t_k
            new_t = tuple([grown[s] for s in kept_slots] + ([] if k_done else [t_k]))
            biggest = max_done if k_done else max(max_done, t_k + owe_new)
            for s in kept_slots:
                if grown[s] + owe_slot[s] > biggest:
                    biggest = grown[s] + owe_slot[s]
            if biggest > cap:
                pruned = min(pruned, m * biggest)
                continue
            total = label.total + stage_total
            bound = total + owe_total + rest + (m - 1) * max(biggest, future_max)
            if completion is not None and stages_left and bound <= ub_limit:
                joint = total + completion.bound(stages_left, j, biggest)
                if joint > bound:
                    bound = joint
            if speed_rest is not None and bound <= ub_limit:
                slow = total + owe_total + speed_rest.bound(rest_work, max(biggest, future_max))
                if slow > bound:
                    bound = slow
            if bound > ub_limit:
                pruned = min(pruned, bound)
                continue
            new_label = Label(total, max(max_done, max_floor), new_t, label, i, j, d)
            if j == full:
                t_iter = total + (m - 1) * max_done
                if t_iter < best_t:
                    best_t = t_iter
                    ub_limit, cap = self.improve(new_label, t_iter, ub_limit, cap)
                continue
            if target is None:
                new_pending = tuple(sorted([(u, pend_stage[u], pend_dev[u]) for u in st.kept]
                                           + [(x, k, d) for x in st.alive]))
                target, perm = self.front(j, k + 1, new_used, new_pending)
            if perm is not None:
                new_label.device, new_label.sigma = perm[d], perm
            insert_label(target, new_label, m - 1)
        self.cap, self.ub_limit, self.pruned = cap, ub_limit, pruned
