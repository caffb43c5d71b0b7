"""Discrete-event simulation of one pipeline iteration (GPipe and 1F1B).

Each stage runs its operations one at a time in the schedule's order: GPipe
does every forward then every backward (fill-drain); 1F1B does ``p - s - 1``
warm-up forwards, then alternates one forward and one backward, then drains.
A forward of micro-batch ``i`` on stage ``s`` needs the forward of ``i`` on every
stage that feeds ``s``, plus the transfer; a backward needs the backward of
``i`` on every stage that ``s`` feeds, plus the gradient transfer. Transfers run
on the link between the two devices, one at a time per direction, overlapped
with compute. The result is the iteration time, each stage's busy and idle
time, and a timeline of (stage, kind, micro-batch, start, end) that a notebook
can draw.

With no transfers and equal stage times the simulated time equals the
reference formula ``sum t_s + (m - 1) max t_s``; tests check that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from solvers.problem import Problem
from solvers.groups import GroupTable
from solvers.groups import allreduce_s as allreduce
from solvers.solution import Solution

__all__ = ["Event", "Simulation", "simulate", "simulate_solution", "schedule_order"]


@dataclass(frozen=True)
class Event:
    stage: int          # for transfers: the sending stage
    kind: str           # "F", "B", "send_F" or "send_B"
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


def schedule_order(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs its forwards and backwards."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(stages - stage - 1, m)
        order = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            order.append(("F", f))
            f += 1
            order.append(("B", b))
            b += 1
        order += [("B", i) for i in range(b, m)]
        return order
    raise ValueError(f"unknown schedule {schedule!r}; expected gpipe or 1f1b")


def simulate(fwd_s: list[float], bwd_s: list[float], micro_batches: int, schedule: str,
             sends: dict[tuple[int, int], float] | None = None,
             allreduce_s: list[float] | None = None) -> Simulation:
    """Simulate stages with per-micro-batch times ``fwd_s[s]``, ``bwd_s[s]``.

    ``sends[(a, b)]`` is the one-way transfer time of one micro-batch from stage
    ``a`` to a later stage ``b`` (its gradient goes back in the same time);
    consecutive stages are linked even when nothing crosses (time 0).
    ``allreduce_s[s]`` is the gradient all-reduce of a replicated stage, run
    once after its last backward.
    """
    p, m = len(fwd_s), micro_batches
    sends = dict(sends or {})
    for s in range(p - 1):  # consecutive stages always hand over (the executors run them in order)
        sends.setdefault((s, s + 1), 0.0)
    feeds: dict[int, list[int]] = {s: [] for s in range(p)}
    fed_by: dict[int, list[int]] = {s: [] for s in range(p)}
    for a, b in sends:
        feeds[a].append(b)
        fed_by[b].append(a)
    orders = [schedule_order(schedule, s, p, m) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}      # (kind, stage, mb) -> end time
    arrived: dict[tuple[str, int, int, int], float] = {}  # (kind, src, dst, mb) -> arrival
    link_free: dict[tuple[int, int], float] = {}
    stage_free = [0.0] * p
    position = [0] * p
    timeline: list[Event] = []
    busy = [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, i = orders[s][position[s]]
            if kind == "F":
                deps = [("F", a, s, i) for a in fed_by[s]]
                local = []
            else:
                deps = [("B", b, s, i) for b in feeds[s]]
                local = [("F", s, i)]
            if any(d not in arrived for d in deps) or any(d not in done for d in local):
                continue
            ready = max([stage_free[s]] + [arrived[d] for d in deps] + [done[d] for d in local])
            length = fwd_s[s] if kind == "F" else bwd_s[s]
            end = ready + length
            done[(kind, s, i)] = end
            stage_free[s] = end
            busy[s] += length
            timeline.append(Event(s, kind, i, ready, end))
            # Send the activation forward, or the gradient back, over each link in turn.
            targets = feeds[s] if kind == "F" else fed_by[s]
            for t in targets:
                src, dst = (s, t)
                cost = sends[(s, t)] if kind == "F" else sends[(t, s)]
                start = max(end, link_free.get((src, dst), 0.0))
                link_free[(src, dst)] = start + cost
                arrived[(kind, s, t, i)] = start + cost
                timeline.append(Event(s, f"send_{kind}", i, start, start + cost, peer=t))
            position[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocked: a stage waits for an operation that never runs")
    for st, ar in enumerate(allreduce_s or []):
        if ar > 0:
            timeline.append(Event(st, "allreduce", -1, stage_free[st], stage_free[st] + ar))
            busy[st] += ar
    total = max(e.end for e in timeline)
    return Simulation(total, busy, [total - b for b in busy], sorted(timeline, key=lambda e: (e.start, e.stage)))


def simulate_solution(problem: Problem, solution: Solution) -> Simulation:
    """Simulate ``solution`` with the problem's costs (forward/backward split per stage)."""
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
    return simulate(fwd, bwd, problem.micro_batches, problem.schedule, sends, ar)
