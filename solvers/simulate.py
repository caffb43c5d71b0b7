"""Discrete-event simulation of one pipeline iteration, for every schedule of :mod:`solvers.schedules`.

Each worker runs its operations one at a time in the schedule's order. A
forward of micro-batch ``i`` on stage ``s`` needs the forward of ``i`` on every
stage that feeds ``s``, plus the transfer; a backward needs the backward of
``i`` on every stage that ``s`` feeds, plus the gradient transfer; a weight pass
``W`` needs its stage's ``B``. Transfers run on the link between the two
workers, one at a time per direction, overlapped with compute. The result is
the iteration time, each worker's busy and idle time, and a timeline of
(stage, kind, micro-batch, start, end) that a notebook can draw.

With no transfers and equal stage times the simulated GPipe and 1F1B time
equals the reference formula ``sum t_s + (m - 1) max t_s``; tests check that.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from statistics import median
from typing import Sequence

from solvers.problem import Problem
from solvers.groups import GroupTable
from solvers.groups import allreduce_s as allreduce
from solvers.schedules import BACKWARDS, KINDS, Op, stage_worker, worker_orders
from solvers.solution import Solution

__all__ = ["Event", "Simulation", "simulate", "simulate_solution", "per_micro_batch", "stage_medians", "weight_shares"]


@dataclass(frozen=True)
class Event:
    stage: int          # for transfers: the sending stage
    kind: str           # "F", "B", "I", "W", "send_F" or "send_B"
    micro_batch: int
    start: float
    end: float
    peer: int = -1      # for transfers: the receiving stage


@dataclass
class Simulation:
    iteration_s: float
    busy_s: list[float]
    idle_s: list[float]
    timeline: list[Event] = field(default_factory=list)


def simulate(fwd_s: list[float], bwd_s: list[float], micro_batches: int, schedule: str,
             sends: dict[tuple[int, int], float] | None = None,
             allreduce_s: list[float] | None = None, workers: int | None = None,
             weight_share: float | Sequence[float] = 0.5, cores: float | None = None,
             parallel_efficiency: float = 1.0,
             stage_efficiency: Sequence[Sequence[float]] | None = None, slots: int | None = None) -> Simulation:
    """Simulate stages with per-micro-batch times ``fwd_s[s]``, ``bwd_s[s]``.

    ``sends[(a, b)]`` is the one-way transfer time of one micro-batch from stage
    ``a`` to a later stage ``b`` (its gradient goes back in the same time);
    consecutive stages are linked even when nothing crosses (time 0); stages on
    one worker hand over for free. ``allreduce_s[s]`` is the gradient all-reduce of
    a replicated stage, run once after its last backward. ``workers`` (default: one
    per stage) runs several stages each for ``interleaved-1f1b`` and ``zb-v``. A split backward
    (``zb-h1``, ``zb-v``) gives ``weight_share`` of ``bwd_s`` to the weight pass ``W`` (one share for all
    stages, or one per stage: a checkpointed micro-batch's recomputation belongs to ``B``).

    ``cores`` makes the workers share that many processors (CPU workers of one
    machine, in units of one worker's threads): while ``k`` operations run, each
    advances at ``min(1, cores / k)`` of its speed, times ``parallel_efficiency``
    when ``k > 1`` (the slowdown of threads that share caches and memory
    bandwidth; ``stage_efficiency[s]`` gives stage ``s``'s own, ``(forward,
    backward)``, the backward's also for ``W``); ``None`` gives every worker its
    own device. ``slots`` lets at most that many operations run at once, as
    :class:`fxpipe.cost.cpu.turns.CoreTurns` makes CPU workers beyond the processors
    take turns: a ready operation waits for a free slot, first ready first
    served. Busy and idle times are per worker; waiting for a slot is idle.
    """
    p, m = len(fwd_s), micro_batches
    n_workers = p if workers is None else workers
    orders = worker_orders(schedule, p, m, n_workers)   # a split backward's I and W are read off the kinds
    shares = [weight_share] * p if isinstance(weight_share, (int, float)) else list(weight_share)
    if len(shares) != p or not all(0.0 <= w <= 1.0 for w in shares):
        raise ValueError(f"weight_share must be a share in [0, 1], or one per stage ({p}), got {weight_share!r}")
    length = {"F": list(fwd_s), "B": list(bwd_s), "I": [b * (1 - w) for b, w in zip(bwd_s, shares)],
              "W": [b * w for b, w in zip(bwd_s, shares)]}
    owner = [stage_worker(schedule, s, n_workers) for s in range(p)]
    sends = dict(sends or {})
    for s in range(p - 1):  # consecutive stages always hand over (the executors run them in order)
        sends.setdefault((s, s + 1), 0.0)
    feeds: dict[int, list[int]] = {s: [] for s in range(p)}
    fed_by: dict[int, list[int]] = {s: [] for s in range(p)}
    for a, b in sends:
        feeds[a].append(b)
        fed_by[b].append(a)

    if cores is None and slots is None:
        timeline, busy = _dedicated(orders, length, owner, sends, feeds, fed_by)
    else:
        timeline, busy = _shared(orders, length, owner, sends, feeds, fed_by, cores, parallel_efficiency,
                                 stage_efficiency, slots)
    worker_free = [0.0] * n_workers
    for e in timeline:
        if e.kind in KINDS:
            worker_free[owner[e.stage]] = max(worker_free[owner[e.stage]], e.end)
    for st, ar in enumerate(allreduce_s or []):
        if ar > 0:
            w = owner[st]
            timeline.append(Event(st, "allreduce", -1, worker_free[w], worker_free[w] + ar))
            worker_free[w] += ar
            busy[w] += ar
    total = max(e.end for e in timeline)
    return Simulation(total, busy, [total - b for b in busy], sorted(timeline, key=lambda e: (e.start, e.stage)))


def _shared(orders: list[list[Op]], length: dict[str, list[float]], owner: list[int],
            sends: dict[tuple[int, int], float], feeds: dict[int, list[int]], fed_by: dict[int, list[int]],
            cores: float | None, parallel_efficiency: float, stage_efficiency: Sequence[Sequence[float]] | None,
            slots: int | None) -> tuple[list[Event], list[float]]:
    """Workers sharing ``cores`` processors or ``slots`` (:func:`simulate`): time advances to the next end or
    arrival, and every running operation advances at its share of the processors meanwhile."""
    n_workers = len(orders)

    def rate(active: int, kind: str, stage: int) -> float:
        if cores is None:
            return 1.0
        shared = min(1.0, cores / active)
        if active < 2:
            return shared
        return shared * (stage_efficiency[stage][0 if kind == "F" else 1] if stage_efficiency else parallel_efficiency)

    done: dict[Op, float] = {}                            # (kind, stage, mb) -> end time
    arrived: dict[tuple[str, int, int, int], float] = {}  # (kind, src, dst, mb) -> arrival
    pending: list[float] = []                             # a heap of the arrival times not yet reached
    link_free: dict[tuple[int, int], float] = {}
    running: list[list | None] = [None] * n_workers       # [op, work left, start]
    ready_since: dict[int, float] = {}                    # worker -> when its next operation's inputs were here
    position = [0] * n_workers
    timeline: list[Event] = []
    busy = [0.0] * n_workers
    remaining = sum(len(o) for o in orders)
    now = 0.0
    while remaining:
        for w in range(n_workers):   # whose next operation has its inputs here
            if running[w] is not None or position[w] == len(orders[w]) or w in ready_since:
                continue
            kind, s, i = orders[w][position[w]]
            deps = ([("F", a, s, i) for a in fed_by[s]] if kind == "F" else
                    [("B", b, s, i) for b in feeds[s]] if kind in BACKWARDS else [])
            local = [] if kind == "F" else [("F", s, i)] if kind in BACKWARDS else [("I", s, i)]
            if all(arrived.get(d, float("inf")) <= now for d in deps) and all(d in done for d in local):
                ready_since[w] = now
        # start them: all at once, or while a slot is free, first come first served
        free = n_workers if slots is None else max(1, slots) - sum(r is not None for r in running)
        for w in sorted(ready_since, key=lambda w: (ready_since[w], w))[:max(0, free)]:
            op = orders[w][position[w]]
            running[w] = [op, length[op[0]][op[1]], now]
            del ready_since[w]
        active = [w for w in range(n_workers) if running[w] is not None]
        while pending and pending[0] <= now:   # time only moves on: arrivals at or before now are past
            heapq.heappop(pending)
        upcoming = pending[0] if pending else float("inf")
        if not active:
            if upcoming == float("inf"):
                raise RuntimeError("the schedule deadlocked: a worker waits for an operation that never runs")
            now = upcoming
            continue
        speed = {w: rate(len(active), running[w][0][0], running[w][0][1]) for w in active}
        step = min(min(running[w][1] / speed[w] for w in active), upcoming - now)
        now += step
        for w in active:
            op, left, start = running[w]
            left -= speed[w] * step
            if left > 1e-12 * max(1.0, length[op[0]][op[1]]):
                running[w][1] = left
                continue
            kind, s, i = op
            running[w] = None
            done[op] = now
            busy[w] += now - start
            timeline.append(Event(s, kind, i, start, now))
            for when in _send(op, now, sends, feeds, fed_by, owner, link_free, arrived, timeline):
                heapq.heappush(pending, when)
            position[w] += 1
            remaining -= 1
    return timeline, busy

def _dedicated(orders: list[list[Op]], length: dict[str, list[float]], owner: list[int],
               sends: dict[tuple[int, int], float], feeds: dict[int, list[int]],
               fed_by: dict[int, list[int]]) -> tuple[list[Event], list[float]]:
    """Every worker on its own device (:func:`simulate` without ``cores`` or ``slots``): an operation starts
    when its worker is free and its inputs are here, so the simulation goes from end to end in time order (a
    heap) instead of stepping every worker to the next event, which :func:`_shared` needs and which took seconds
    for the 64 micro-batches over 64 stages the mesh search simulates. Ends at one time are taken in worker
    order, as :func:`_shared` takes them, so transfers queue on a link in the same order."""
    n_workers = len(orders)
    done: dict[Op, float] = {}
    arrived: dict[tuple[str, int, int, int], float] = {}
    link_free: dict[tuple[int, int], float] = {}
    free, busy, position = [0.0] * n_workers, [0.0] * n_workers, [0] * n_workers
    running = [False] * n_workers
    ends: list[tuple[float, int, float, Op]] = []   # (end, worker, start, operation) of the running ones
    timeline: list[Event] = []

    def start_next(w: int) -> None:   # w's next operation, where its inputs' times are known
        if running[w] or position[w] == len(orders[w]):
            return
        kind, s, i = op = orders[w][position[w]]
        inputs = ([arrived.get(("F", a, s, i)) for a in fed_by[s]] if kind == "F" else
                  [arrived.get(("B", b, s, i)) for b in feeds[s]] + [done.get(("F", s, i))] if kind in BACKWARDS
                  else [done.get(("I", s, i))])
        if None in inputs:
            return
        begin = max(free[w], *inputs) if inputs else free[w]
        running[w] = True
        heapq.heappush(ends, (begin + length[kind][s], w, begin, op))

    for w in range(n_workers):
        start_next(w)
    remaining = sum(len(o) for o in orders)
    while remaining:
        if not ends:
            raise RuntimeError("the schedule deadlocked: a worker waits for an operation that never runs")
        now, w, begin, op = heapq.heappop(ends)
        kind, s, i = op
        running[w], free[w], done[op] = False, now, now
        busy[w] += now - begin
        position[w] += 1
        remaining -= 1
        timeline.append(Event(s, kind, i, begin, now))
        _send(op, now, sends, feeds, fed_by, owner, link_free, arrived, timeline)
        start_next(w)
        for t in ([] if kind == "W" else feeds[s] if kind == "F" else fed_by[s]):
            start_next(owner[t])
    return timeline, busy


def _send(op: Op, now: float, sends: dict[tuple[int, int], float], feeds: dict[int, list[int]],
          fed_by: dict[int, list[int]], owner: list[int], link_free: dict[tuple[int, int], float],
          arrived: dict[tuple[str, int, int, int], float], timeline: list[Event]) -> list[float]:
    """``op`` ended at ``now``: its activation goes forward, or its gradient back, over each link in turn (one
    transfer at a time per link and direction; stages of one worker hand over at once). Records each arrival and
    returns the times of those that cross a link."""
    kind, s, i = op
    carried = "F" if kind == "F" else "B"   # an activation, or a gradient (of a whole or an input pass)
    crossing = []
    for t in ([] if kind == "W" else feeds[s] if kind == "F" else fed_by[s]):
        cost = sends[(s, t)] if kind == "F" else sends[(t, s)]
        link = (owner[s], owner[t])
        if link[0] == link[1]:
            arrived[(carried, s, t, i)] = now
            continue
        begin = max(now, link_free.get(link, 0.0))
        link_free[link] = arrived[(carried, s, t, i)] = begin + cost
        timeline.append(Event(s, f"send_{carried}", i, begin, begin + cost, peer=t))
        crossing.append(begin + cost)
    return crossing


def per_micro_batch(ops: list[tuple[str, int, float]]) -> tuple[list[float], list[float]]:
    """One stage's ``(kind, micro_batch, seconds)`` operations as forward times and backward times per
    micro-batch (``B``, or a split backward's ``I`` and ``W`` added together)."""
    fwd = [seconds for kind, _, seconds in ops if kind == "F"]
    bwd = [sum(seconds for kind, mb, seconds in ops if kind != "F" and mb == i)
           for i in sorted({mb for _, mb, _ in ops})]
    return fwd, bwd


def stage_medians(timeline: list[Event], stages: int) -> list[tuple[float, float]]:
    """Per stage, the median forward and backward (B plus W) duration of one micro-batch in ``timeline``."""
    out = []
    for s in range(stages):
        fwd, bwd = per_micro_batch([(e.kind, e.micro_batch, e.end - e.start) for e in timeline
                                    if e.stage == s and e.kind in KINDS])
        out.append((median(fwd) if fwd else 0.0, median(bwd) if bwd else 0.0))
    return out


def weight_shares(backward_s: Sequence[float], total_s: Sequence[float]) -> list[float]:
    """Per stage, the weight pass's share of a split backward of ``total_s`` that is ``backward_s`` proper and
    the rest a checkpointed micro-batch's recomputed forward (run in ``B``): half of the backward proper."""
    return [0.5 * max(0.0, b) / t if t > 0 else 0.5 for b, t in zip(backward_s, total_s)]


def simulate_solution(problem: Problem, solution: Solution, schedule: str | None = None,
                      workers: int | None = None, recompute_share: float = 0.0) -> Simulation:
    """Simulate ``solution`` with the problem's costs (forward/backward split per stage).

    ``schedule`` (default: the problem's) and ``workers`` as for :func:`simulate`. ``recompute_share``: the
    problem's backward costs include that share of the forward, recomputed for checkpointed micro-batches;
    a split backward runs it in ``I``, and ``W`` takes half of the rest.
    """
    device_index = {d.id: i for i, d in enumerate(problem.devices)}
    nodes = problem.node_map()
    stage_of = {n: s for s, st in enumerate(solution.stages) for n in st.nodes}
    table = GroupTable(problem)
    devs = [table.add(tuple(device_index[d] for d in st.devices)) for st in solution.stages]
    speed = [table.groups[g].speed for g in devs]
    fwd = [sum(nodes[n].fwd_s for n in st.nodes) / speed[s] for s, st in enumerate(solution.stages)]
    bwd = [sum(nodes[n].bwd_s for n in st.nodes) / speed[s] for s, st in enumerate(solution.stages)]
    ar = [allreduce(table.groups[g], sum(nodes[n].param_bytes for n in st.nodes))
          for g, st in zip(devs, solution.stages)]
    tensors: dict[tuple[str, int], float] = {}
    for e in problem.edges:
        a, b = stage_of[e.src], stage_of[e.dst]
        if a != b:
            tensors[(e.src, b)] = max(tensors.get((e.src, b), 0.0), e.bytes)
    sends: dict[tuple[int, int], float] = {}
    for (src, b), nbytes in tensors.items():
        a = stage_of[src]
        sends[(a, b)] = sends.get((a, b), 0.0) + table.transfer_s(nbytes, devs[a], devs[b])
    return simulate(fwd, bwd, problem.micro_batches, schedule or problem.schedule, sends, ar, workers,
                    weight_share=weight_shares([b - recompute_share * f for f, b in zip(fwd, bwd)], bwd))
