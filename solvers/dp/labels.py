"""The label-setting search: contiguous cuts for a fixed stage count, in one space of stage-to-device choices.

A state is ``(cut position, stages so far, pending senders)``; each keeps the Pareto set of
:class:`Label` s (see :mod:`solvers.dp`); which devices a stage may take is a
:class:`solvers.dp.space.Space`. :mod:`solvers.dp.deepen` runs :func:`solve_fixed_p` under
rising upper bounds."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from operator import le

import numpy as np

from solvers.groups import allreduce_s
from solvers.problem import Problem
from solvers.dp.completion import completion_for
from solvers.dp.skip import EndSkip
from solvers.dp.space import Space
from solvers.dp.speeds import SpeedRest, SpeedRests
from solvers.dp.tables import REL_TOL, Tables

__all__ = ['analytic_lower', 'Label', 'plan_of', 'Timeout', 'insert_label', 'solve_fixed_p']


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


def solve_fixed_p(problem: Problem, tables: Tables, p: int, ub: float, space: Space,
                   deadline: float) -> tuple[Label | None, float, float]:
    """Best label for exactly ``p`` stages with iteration time below ``ub``, its time, and the
    smallest lower bound of the labels the bound cut off (a proven bound when none is found)."""
    n, m = tables.n, problem.micro_batches
    groups = space.table.groups
    factor = 1.0 + problem.optimizer_state_factor
    cap = ub / m * (1 + REL_TOL) if math.isfinite(ub) else math.inf
    ub_limit = ub * (1 + REL_TOL) if math.isfinite(ub) else math.inf
    max_speed, together = space.speeds(p)
    # Every complete plan's slowest stage takes at least the whole work over the speeds of its stages.
    least_max = tables.suffix_fb[0] / together
    future_bottleneck = tables.suffix_bottleneck(max_speed, p - 1)
    transfer_lbs = tables.future_transfer_lbs(p - 1)
    canon = space.canon
    # every stage of a plan under the bound is at most this slow: T >= (sum at full speed) + (m - 1) max
    slowest = (ub_limit - tables.suffix_fb[0] / max_speed) / (m - 1) if m > 1 and math.isfinite(ub) else math.inf
    completion = (completion_for(problem, tables, p, max_speed, least_max, slowest)
                  if p > 1 and math.isfinite(slowest) and slowest >= least_max else None)
    # a state skips the stage ends where even its cheapest label fails the floor test (solvers.dp.skip)
    skip = EndSkip(tables, p, m, max_speed, future_bottleneck, transfer_lbs)
    last_use = np.array(tables.last_use)
    # devices of different speeds: the rest's compute at the speeds it can still have (solvers.dp.speeds)
    speed_rests = SpeedRests(space, m)
    # frontier[(j, k)] maps (used devices, pending senders) to Pareto sets of labels.
    frontier: dict[tuple[int, int], dict[tuple, list[Label]]] = {
        (0, 0): {(space.start(), ()): [Label(0.0, 0.0, (), None, 0, 0, -1)]}
    }
    best: Label | None = None
    best_t = math.inf
    pruned = math.inf   # smallest lower bound of anything cut off by the bound: what a failure proves
    for j in range(n):
        if time.perf_counter() > deadline:
            raise Timeout
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
                first_end, skipped = skip.first_end(j, j_max, stages_left, min(label.total for label in labels),
                                                    cap, ub_limit)
                pruned = min(pruned, skipped)   # no more than the skipped ends' floors: still a proven bound
                if first_end is None:
                    continue
                for d, new_used in space.candidates(used, k, p, pending):
                    group = groups[d]
                    speed_rest = speed_rests.of(new_used, k, p)
                    act_scale = inflight / group.replicas
                    replicated = group.replicas > 1
                    # Everything of a stage [j, j2) on d but the labels' own sums is the same for every label
                    # of this state: computed once per j2, then each label still growing takes its share.
                    active = list(labels)
                    least_total = min(label.total for label in active)
                    compute = params = acts = 0.0
                    recv: dict[int, float] = {}        # pending node -> bytes received
                    recv_cost: dict[int, float] = {}   # pending node -> 2 x one-way time
                    comm_in = 0.0
                    alive_seg: list[int] = []
                    # the earlier senders still read at or after j2, updated only when one stops being read
                    kept_pending, done_slots, kept_slots = pending, [], list(range(len(pend_stages)))
                    expiry = min((tables.last_use[u] for u, _, _ in pending), default=n)
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
                        if j2 < first_end:   # an end the floor test fails for every label: only add it up
                            continue
                        if params * factor + acts * act_scale > group.memory_bytes:
                            break
                        ar = allreduce_s(group, params) / m if replicated else 0.0
                        t_k = compute / group.speed + comm_in + ar
                        if j2 == first_end > j + 1:   # the first end looked at past the skipped ones
                            alive_seg = (j + np.flatnonzero(last_use[j:j2] >= j2)).tolist()
                        else:
                            alive_seg = [u for u in alive_seg if tables.last_use[u] >= j2]
                            if tables.last_use[x] >= j2:
                                alive_seg.append(x)
                        stage_total = compute / group.speed + 2.0 * comm_in + ar
                        rest = tables.suffix_fb[j2] / max_speed
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
                                tables.suffix_fb[j2], future_max if future_max > t_k else t_k)
                            if slow > floor_j2:
                                floor_j2 = slow
                        if floor_j2 > ub_limit:
                            if floor_j2 < pruned:
                                pruned = floor_j2
                            continue
                        # what each pending stage grows by: what it sent to this stage (added in this order)
                        sent: list[list[float]] = [[] for _ in pend_stages]
                        for u, c in recv_cost.items():
                            sent[slot[pend_stage[u]]].append(c)
                        if j2 > expiry:   # some earlier sender is read for the last time before j2
                            kept_pending = tuple(e for e in kept_pending if tables.last_use[e[0]] >= j2)
                            expiry = min((tables.last_use[u] for u, _, _ in kept_pending), default=n)
                            still = {a for _, a, _ in kept_pending}
                            done_slots = [i for i, a in enumerate(pend_stages) if a not in still]
                            kept_slots = [i for i, a in enumerate(pend_stages) if a in still]
                        new_pending = kept_pending + tuple([(u, k, d) for u in alive_seg])
                        k_done = not alive_seg
                        key: tuple | None = None
                        perm: tuple | None = None
                        target: list[Label] = []   # the Pareto set of the state (key) this j2 leads to
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
                                    tables.suffix_fb[j2], biggest if biggest > future_max else future_max)
                                if slow > bound:
                                    bound = slow
                            if bound > ub_limit:
                                if bound < pruned:
                                    pruned = bound
                                continue  # may shrink with j2: a longer stage may still do
                            if last_stage and j2 < n:
                                continue
                            new_label = Label(total, max_done if max_done > max_floor else max_floor, new_t,
                                              label, j, j2, d)
                            if j2 == n:
                                t_iter = total + (m - 1) * max_done
                                if t_iter < best_t:
                                    best, best_t = new_label, t_iter
                                    ub_limit = min(ub_limit, t_iter * (1 + REL_TOL))
                                    cap = min(cap, t_iter / m * (1 + REL_TOL))
                                continue
                            if key is None:
                                key = (new_used, new_pending)
                                if canon is not None:   # one state per orbit of the topology's automorphisms
                                    key, perm = canon.canonical(new_used, new_pending)
                                target = frontier.setdefault((j2, k + 1), {}).setdefault(key, [])
                            if perm is not None:
                                new_label.device, new_label.sigma = perm[d], perm
                            insert_label(target, new_label, m - 1)
                        if len(still_growing) < len(active):
                            active = still_growing
                            if not active:
                                break
                            least_total = min(label.total for label in active)
    return best, best_t, pruned


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
