"""The label-setting search: contiguous cuts for a fixed stage count, in one space of stage-to-device choices.

A state is ``(cut position, stages so far, pending senders)``; each keeps the Pareto set of
:class:`~solvers.dp.frontier.Label` s (see :mod:`solvers.dp`; the labels, their dominance and what this search
shares with :mod:`solvers.dp.ideals` are :mod:`solvers.dp.frontier`'s); which devices a stage may take is a
:class:`solvers.dp.space.Space`. :mod:`solvers.dp.deepen` runs :func:`solve_fixed_p` under rising upper bounds."""

from __future__ import annotations

import math

import numpy as np

from solvers.groups import allreduce_s
from solvers.problem import Problem
from solvers.dp.completion import completion_for
from solvers.dp.frontier import Label, LabelSearch, Timeout, insert_label, senders
from solvers.dp.skip import EndSkip
from solvers.dp.space import Space
from solvers.dp.speeds import SpeedRest
from solvers.dp.tables import Tables

__all__ = ['analytic_lower', 'Label', 'plan_of', 'Timeout', 'insert_label', 'solve_fixed_p']


def solve_fixed_p(problem: Problem, tables: Tables, p: int, ub: float, space: Space,
                   deadline: float) -> tuple[Label | None, float, float]:
    """Best label for exactly ``p`` stages with iteration time below ``ub``, its time, and the
    smallest lower bound of the labels the bound cut off (a proven bound when none is found)."""
    search = _CutSearch(problem, tables, p, ub, space)
    for j, k, by_key in search.states(tables.n, deadline):
        search.stages_from(j, k, by_key)
    return search.best, search.best_t, search.pruned


class _CutSearch(LabelSearch):
    """One :func:`solve_fixed_p`: the shared bounds, and those over the suffixes of the order: the slowest stage
    and the transfers the rest must still have, the rest's sum and slowest stage together
    (:mod:`solvers.dp.completion`), and the stage ends a state need not look at (:mod:`solvers.dp.skip`)."""

    __slots__ = ("future_bottleneck", "transfer_lbs", "completion", "skip", "last_use")

    def __init__(self, problem: Problem, tables: Tables, p: int, ub: float, space: Space) -> None:
        super().__init__(problem, tables, p, ub, space)
        m, max_speed, least_max = self.m, self.max_speed, self.least_max
        self.future_bottleneck = tables.suffix_bottleneck(max_speed, p - 1)
        self.transfer_lbs = tables.future_transfer_lbs(p - 1)
        # every stage of a plan under the bound is at most this slow: T >= (sum at full speed) + (m - 1) max
        slowest = ((self.ub_limit - tables.suffix_fb[0] / max_speed) / (m - 1) if m > 1 and math.isfinite(ub)
                   else math.inf)
        self.completion = (completion_for(problem, tables, p, max_speed, least_max, slowest)
                           if p > 1 and math.isfinite(slowest) and slowest >= least_max else None)
        # a state skips the stage ends where even its cheapest label fails the floor test (solvers.dp.skip)
        self.skip = EndSkip(tables, p, m, max_speed, self.future_bottleneck, self.transfer_lbs)
        self.last_use = np.array(tables.last_use)

    def stages_from(self, j: int, k: int, by_key: dict[tuple, list[Label]]) -> None:
        """Stage ``k``, from cut ``j``, out of each state there: on each device it may take, to each end."""
        p = self.p
        inflight = self.problem.inflight(k, p)
        last_stage = k == p - 1
        stages_left = p - k - 1
        j_max = self.n - stages_left
        for (used, pending), labels in by_key.items():
            pend = senders(pending)
            first_end, skipped = self.skip.first_end(j, j_max, stages_left, min(label.total for label in labels),
                                                     self.cap, self.ub_limit)
            self.pruned = min(self.pruned, skipped)   # no more than the skipped ends' floors: still a proven bound
            if first_end is None:
                continue
            for d, new_used in self.space.candidates(used, k, p, pending):
                self.stage_ends(j, k, d, new_used, pending, pend, labels, first_end, inflight, last_stage,
                                stages_left, j_max)

    def stage_ends(self, j: int, k: int, d: int, new_used: tuple | int, pending: tuple, pend: tuple,
                   labels: list[Label], first_end: int, inflight: int, last_stage: bool, stages_left: int,
                   j_max: int) -> None:
        """The stage ``[j, j2)`` on device group ``d`` for each end ``j2`` in turn (while it fits): its time, the
        tests every label of the state shares, then the labels it closes (:meth:`close`).

        Everything of a stage [j, j2) on d but the labels' own sums is the same for every label of this
        state: computed once per j2, then each label still growing takes its share."""
        tables, m, factor, max_speed, least_max = self.tables, self.m, self.factor, self.max_speed, self.least_max
        cap, ub_limit, pruned = self.cap, self.ub_limit, self.pruned
        future_bottleneck, transfer_lbs, completion, last_use = (self.future_bottleneck, self.transfer_lbs,
                                                                 self.completion, self.last_use)
        # the tables read at every end (uses: each node's last reader, of which last_use is the numpy copy)
        fb, param, act, inputs, uses, suffix_fb = (tables.fb, tables.param, tables.act, tables.inputs,
                                                   tables.last_use, tables.suffix_fb)
        transfer_s, pend_dev = self.space.table.transfer_s, pend[1]
        group = self.groups[d]
        speed, memory = group.speed, group.memory_bytes
        speed_rest = self.speed_rests.of(new_used, k, self.p)
        act_scale = inflight / group.replicas
        replicated = group.replicas > 1
        active = list(labels)
        least_total = min(label.total for label in active)
        compute = params = acts = 0.0
        recv: dict[int, float] = {}        # pending node -> bytes received
        recv_cost: dict[int, float] = {}   # pending node -> 2 x one-way time
        comm_in = 0.0
        alive_seg: list[int] = []
        kept = _Kept(pending, pend[2], uses, self.n)   # the earlier senders still read at j2
        for j2 in range(j + 1, j_max + 1):
            x = j2 - 1
            compute += fb[x]
            params += param[x]
            acts += act[x]
            for u, nbytes in inputs[x]:
                if u < j and nbytes >= recv.get(u, -1.0):
                    recv[u] = nbytes
                    c = 2.0 * transfer_s(nbytes, pend_dev[u], d)
                    comm_in += c - recv_cost.get(u, 0.0)
                    recv_cost[u] = c
            if j2 < first_end:   # an end the floor test fails for every label: only add it up
                continue
            if params * factor + acts * act_scale > memory:
                break
            ar = allreduce_s(group, params) / m if replicated else 0.0
            t_k = compute / speed + comm_in + ar
            if j2 == first_end > j + 1:   # the first end looked at past the skipped ones
                alive_seg = (j + np.flatnonzero(last_use[j:j2] >= j2)).tolist()
            else:
                alive_seg = [u for u in alive_seg if uses[u] >= j2]
                if uses[x] >= j2:
                    alive_seg.append(x)
            stage_total = compute / speed + 2.0 * comm_in + ar
            rest = suffix_fb[j2] / max_speed
            # Tests for every label at once (each label's max is at least t_k): t_k and
            # total + rest only grow with j2, so past these no label does at any later j2.
            if t_k > cap:
                if m * t_k < pruned:
                    pruned = m * t_k
                break
            end_j2 = least_total + stage_total + rest + (m - 1) * t_k   # no label ends lower
            if end_j2 > ub_limit:
                if end_j2 < pruned:
                    pruned = end_j2
                break
            # the stages after this one: their slowest takes at least this long
            future_max = future_bottleneck[stages_left][j2] if stages_left else 0.0
            # A lower bound of the final maximum, whatever the label: a label's own maximum below it
            # makes no difference to any completion, so it is raised to it, and labels that differ
            # only there collapse into one in the Pareto set.
            max_floor = future_max if future_max > least_max else least_max
            transfer_lb = transfer_lbs[stages_left][j2] if stages_left else 0.0
            # every label's bound is at least this one (its max at least the rest shared out):
            # when it is over the limit, no label here can end a plan at j2 (a longer stage may:
            # the rest shrinks); the labels' own drop tests are made at the next j2
            floor_j2 = least_total + stage_total + rest + (m - 1) * future_max + transfer_lb
            if completion is not None and stages_left and floor_j2 <= ub_limit:
                joint = least_total + stage_total + completion.bound(stages_left, j2, t_k)
                if joint > floor_j2:
                    floor_j2 = joint
            if speed_rest is not None and floor_j2 <= ub_limit:
                slow = least_total + stage_total + transfer_lb + speed_rest.bound(
                    suffix_fb[j2], future_max if future_max > t_k else t_k)
                if slow > floor_j2:
                    floor_j2 = slow
            if floor_j2 > ub_limit:
                if floor_j2 < pruned:
                    pruned = floor_j2
                continue
            self.pruned = pruned
            still_growing = self.close(j, j2, k, d, new_used, active, pend, recv_cost, kept.at(j2), alive_seg,
                                       t_k, stage_total, rest, future_max, max_floor, transfer_lb, speed_rest,
                                       stages_left, last_stage)
            pruned, cap, ub_limit = self.pruned, self.cap, self.ub_limit
            if len(still_growing) < len(active):
                active = still_growing
                if not active:
                    break
                least_total = min(label.total for label in active)
        self.pruned = pruned

    def close(self, j: int, j2: int, k: int, d: int, new_used: tuple | int, active: list[Label], pend: tuple,
              recv_cost: dict[int, float], kept: tuple, alive_seg: list[int], t_k: float, stage_total: float,
              rest: float, future_max: float, max_floor: float, transfer_lb: float, speed_rest: SpeedRest | None,
              stages_left: int, last_stage: bool) -> list[Label]:
        """Each label of ``active`` that the stage ``[j, j2)`` on ``d`` closes: filed under the state it leads to,
        or, at the last cut, the incumbent when it beats it. Returns the labels that pass the tests that only
        get worse with ``j2``: a longer stage may still do for them."""
        m, n, completion = self.m, self.n, self.completion
        cap, ub_limit, pruned, best_t = self.cap, self.ub_limit, self.pruned, self.best_t
        rest_fb = self.tables.suffix_fb[j2]   # the rest's work
        pend_stage, _, pend_stages, slot = pend
        kept_pending, done_slots, kept_slots = kept
        # what each pending stage grows by: what it sent to this stage (added in this order)
        sent: list[list[float]] = [[] for _ in pend_stages]
        for u, c in recv_cost.items():
            sent[slot[pend_stage[u]]].append(c)
        new_pending = kept_pending + tuple([(u, k, d) for u in alive_seg])
        k_done = not alive_seg
        target: list[Label] | None = None   # the Pareto set of the state this j2 leads to
        perm: tuple | None = None
        still_growing: list[Label] = []
        grows = any(sent)
        for label in active:
            if grows:
                grown = list(label.pending_t)
                for i, costs in enumerate(sent):
                    for c in costs:
                        grown[i] += c
            else:
                grown = label.pending_t
            max_done = label.max_done
            for i in done_slots:
                if grown[i] > max_done:
                    max_done = grown[i]
            if k_done and t_k > max_done:
                max_done = t_k
            if kept_slots:
                new_t = tuple([grown[i] for i in kept_slots] + ([] if k_done else [t_k]))
                biggest = max(max_done, *new_t)
            else:
                new_t = () if k_done else (t_k,)
                biggest = max_done if k_done or max_done >= t_k else t_k
            if biggest > cap:
                if m * biggest < pruned:   # T >= m max t_s
                    pruned = m * biggest
                continue  # every quantity here only grows with j2: this label is done
            total = label.total + stage_total
            least = total + rest + (m - 1) * biggest
            if least > ub_limit:
                if least < pruned:
                    pruned = least
                continue  # grows with j2: done
            still_growing.append(label)
            bound = total + rest + (m - 1) * (biggest if biggest > future_max else future_max) + transfer_lb
            if completion is not None and stages_left and bound <= ub_limit:
                joint = total + completion.bound(stages_left, j2, biggest)
                if joint > bound:
                    bound = joint
            if speed_rest is not None and bound <= ub_limit:
                slow = total + transfer_lb + speed_rest.bound(
                    rest_fb, biggest if biggest > future_max else future_max)
                if slow > bound:
                    bound = slow
            if bound > ub_limit:
                if bound < pruned:
                    pruned = bound
                continue  # may shrink with j2: a longer stage may still do
            if last_stage and j2 < n:
                continue
            new_label = Label(total, max_done if max_done > max_floor else max_floor, new_t, label, j, j2, d)
            if j2 == n:
                t_iter = total + (m - 1) * max_done
                if t_iter < best_t:
                    best_t = t_iter
                    ub_limit, cap = self.improve(new_label, t_iter, ub_limit, cap)
                continue
            if target is None:
                target, perm = self.front(j2, k + 1, new_used, new_pending)
            if perm is not None:
                new_label.device, new_label.sigma = perm[d], perm
            insert_label(target, new_label, m - 1)
        self.cap, self.ub_limit, self.pruned = cap, ub_limit, pruned
        return still_growing


class _Kept:
    """The earlier senders of a state still read at or after an end ``j2``, and the slots of the stages that no
    longer send and that still do, for rising ``j2``: updated only when one stops being read."""

    __slots__ = ("pending", "expiry", "done_slots", "kept_slots", "pend_stages", "last_use", "n")

    def __init__(self, pending: tuple, pend_stages: list[int], last_use: list[int], n: int) -> None:
        self.pending, self.done_slots, self.kept_slots = pending, [], list(range(len(pend_stages)))
        self.pend_stages, self.last_use, self.n = pend_stages, last_use, n
        self.expiry = min((last_use[u] for u, _, _ in pending), default=n)

    def at(self, j2: int) -> tuple[tuple, list[int], list[int]]:
        """``(pending senders still read, slots done, slots kept)`` at ``j2``, no lower than the last one asked."""
        if j2 > self.expiry:   # some earlier sender is read for the last time before j2
            last_use = self.last_use
            self.pending = tuple(e for e in self.pending if last_use[e[0]] >= j2)
            self.expiry = min((last_use[u] for u, _, _ in self.pending), default=self.n)
            still = {a for _, a, _ in self.pending}
            self.done_slots = [i for i, a in enumerate(self.pend_stages) if a not in still]
            self.kept_slots = [i for i, a in enumerate(self.pend_stages) if a in still]
        return self.pending, self.done_slots, self.kept_slots


def plan_of(label: Label) -> tuple[list[int], list[int]]:
    """Cut positions and the device (group) of every stage of the plan that ends in ``label``,
    mapped through the automorphisms that canonicalised its states into real devices."""
    cuts: list[int] = []
    devices: list[int] = []
    to_final: tuple | None = None   # the frame of the current label -> the frame of the last one
    while label is not None and label.parent is not None:
        if label.start > 0:
            cuts.append(label.start)
        devices.append(label.device if to_final is None else to_final[label.device])
        if label.sigma is not None:   # the parent's frame maps into this label's by sigma
            to_final = label.sigma if to_final is None else tuple(to_final[x] for x in label.sigma)
        label = label.parent
    return sorted(cuts), devices[::-1]


def analytic_lower(problem: Problem, tables: Tables, p: int, space: Space) -> float:
    """No plan of ``p`` stages in ``space`` is faster: all the work on the fastest stage, plus the rest at full speed."""
    fastest, together = space.speeds(p)
    total = tables.suffix_fb[0]
    alike = total / fastest + (problem.micro_batches - 1) * total / together
    if not space.mixed_speeds:
        return alike
    return max(alike, SpeedRest(space.stage_speeds(p), problem.micro_batches).bound(total, 0.0))
