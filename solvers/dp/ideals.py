"""The label search over chains of ideals: exact over convex partitions x placements, for graphs with few ideals.

A convex partition into ordered stages is a chain of ideals ``{} = I_0 < I_1 < ... < I_p = V``
(:mod:`solvers.dp.lattice`). The contiguous search (:mod:`solvers.dp.labels`) walks the prefixes of one
topological order, a sub-lattice: where a graph has side branches (ResNet's downsample convolutions, an
Inception tower) a plan may put a branch in a stage that no single order allows, so that search proves
nothing about them, and the bounds that cover them (:mod:`solvers.spine`, the ILP) stay far below the plan:
on ResNet-101 over the 8-GPU Titan V box the best bound was 16 % below the DP's plan, which this search
proves optimal in 2 s. It is the same label setting with ideals in place of cut positions: a state is
``(ideal, stages so far, used devices, pending senders)``, the labels and their dominance are
:class:`solvers.dp.labels.Label` and :func:`~solvers.dp.labels.insert_label`, and a stage is a difference
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

from solvers.groups import GroupTable
from solvers.problem import Problem
from solvers.dp.ideal_bounds import IdealCompletion
from solvers.dp.labels import Label, Timeout, insert_label
from solvers.dp.lattice import Lattice
from solvers.dp.space import Space
from solvers.dp.speeds import SpeedRests
from solvers.dp.tables import REL_TOL, Tables

__all__ = ["solve_ideals_p"]


def solve_ideals_p(problem: Problem, tables: Tables, lattice: Lattice, p: int, ub: float, space: Space,
                   deadline: float) -> tuple[Label | None, float, float]:
    """Best label for ``p`` stages below ``ub`` over chains of ideals, its time, and the least bound pruned
    (the signature of :func:`solvers.dp.labels.solve_fixed_p`, so :func:`~solvers.dp.deepen.deepening` runs it)."""
    m, n = problem.micro_batches, tables.n
    table: GroupTable = space.table
    groups = table.groups
    factor = 1.0 + problem.optimizer_state_factor
    total_work = tables.suffix_fb[0]
    cap = ub / m * (1 + REL_TOL) if math.isfinite(ub) else math.inf
    ub_limit = ub * (1 + REL_TOL) if math.isfinite(ub) else math.inf
    max_speed, together = space.speeds(p)
    least_max = total_work / together
    speeds = sorted((d.speed for d in problem.devices), reverse=True)
    top_speed = [sum(speeds[:s]) for s in range(p + 1)]   # the most speed s more stages can have
    canon = space.canon
    completion = (IdealCompletion(lattice, p, m, max_speed, least_max, cap, deadline)
                  if p > 1 and math.isfinite(cap) else None)
    full = len(lattice.ideals) - 1
    size = [bin(mask).count("1") for mask in lattice.ideals]
    target_cache: dict[tuple[int, int], list[tuple]] = {}
    one_way: dict[tuple[float, int, int], float] = {}   # 2 x one-way time of a tensor between two devices
    n_dev = len(problem.devices)
    # a node read after the ideal still sends at least once, from its device over that device's cheapest link
    links_from = [sorted({table.link(a, b) for b in range(n_dev) if b != a}) for a in range(n_dev)]
    owe_memo: dict[tuple[int, float], float] = {}
    speed_rests = SpeedRests(space, m)   # devices of different speeds: the rest at the speeds it can still have

    def owes(a: int, nbytes: float) -> float:
        got = owe_memo.get((a, nbytes))
        if got is None:
            got = owe_memo[(a, nbytes)] = 2.0 * min((nbytes / bw + lat for bw, lat in links_from[a]), default=0.0)
        return got

    frontier: dict[tuple[int, int], dict[tuple, list[Label]]] = {
        (0, 0): {(space.start(), ()): [Label(0.0, 0.0, (), None, 0, 0, -1)]}}
    best: Label | None = None
    best_t = pruned = math.inf
    for i in range(len(lattice.ideals)):
        if time.perf_counter() > deadline:
            raise Timeout
        for k in range(p):
            by_key = frontier.pop((i, k), None)
            if not by_key:
                continue
            inflight = problem.inflight(k, p)
            stages_left = p - k - 1
            targets = target_cache.get((i, stages_left))
            if targets is None:   # (work, rest's work, ideal, step), lightest stage first
                reach = lattice.reach(i, cap * max_speed)
                chosen = [full] if stages_left == 0 and full in reach else [
                    j for j in reach if j != full and n - size[j] >= stages_left] if stages_left else []
                targets = target_cache[(i, stages_left)] = sorted(
                    (lattice.work[j] - lattice.work[i], total_work - lattice.work[j], j, lattice.step(i, j))
                    for j in chosen)
            for (used, pending), labels in by_key.items():
                if time.perf_counter() > deadline:
                    raise Timeout
                pend_stage = {u: a for u, a, _ in pending}
                pend_dev = {u: d for u, _, d in pending}
                pend_stages = sorted(set(pend_stage.values()))
                slot = {a: s for s, a in enumerate(pend_stages)}
                least_total = min(label.total for label in labels)
                # the targets no device can take below the bound (at the fastest speed, each transfer over the
                # problem's cheapest link) are dropped once for the state, not once per device
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
                if not viable:
                    continue
                for d, new_used in space.candidates(used, k, p, pending):
                    group = groups[d]
                    speed = group.speed
                    act_scale = inflight / group.replicas
                    speed_rest = speed_rests.of(new_used, k, p)
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
                        still = {pend_stage[u] for u in st.kept}
                        done_slots = [s for s, a in enumerate(pend_stages) if a not in still]
                        kept_slots = [s for s, a in enumerate(pend_stages) if a in still]
                        k_done = not st.alive
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
                        key: tuple | None = None
                        perm: tuple | None = None
                        target: list[Label] = []
                        grows = any(sent)
                        # each label closed by this stage: the update of solvers.dp.labels.solve_fixed_p's
                        # innermost loop, written out here too (a call per label would cost both searches)
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
                                    best, best_t = new_label, t_iter
                                    ub_limit = min(ub_limit, t_iter * (1 + REL_TOL))
                                    cap = min(cap, t_iter / m * (1 + REL_TOL))
                                continue
                            if key is None:
                                new_pending = tuple(sorted([(u, pend_stage[u], pend_dev[u]) for u in st.kept]
                                                           + [(x, k, d) for x in st.alive]))
                                key = (new_used, new_pending)
                                if canon is not None:
                                    key, perm = canon.canonical(new_used, new_pending)
                                target = frontier.setdefault((j, k + 1), {}).setdefault(key, [])
                            if perm is not None:
                                new_label.device, new_label.sigma = perm[d], perm
                            insert_label(target, new_label, m - 1)
    return best, best_t, pruned
