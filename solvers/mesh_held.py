"""Micro-batches a pipeline stage holds at its memory peak under a schedule: what the mesh search's memory charges
(:func:`stage_inflight`; under a split backward, the pairs of :func:`stage_held`)."""

from __future__ import annotations

import functools

from solvers.schedules import BACKWARDS, get_schedule, inflight, worker_orders

__all__ = ["stage_held", "stage_inflight"]


def stage_inflight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches ``stage`` holds at its peak (interleaved counted as the planner does: 1F1B over all
    stages)."""
    return inflight(get_schedule(schedule).memory_model, stage, stages, micro_batches)


@functools.lru_cache(maxsize=1 << 16)
def stage_held(schedule: str, stage: int, stages: int, micro_batches: int) -> tuple[tuple[int, int], ...]:
    """(micro-batches between their forward and backward, micro-batches between their backward and weight pass)
    that ``stage`` may hold at its peak: one pair, ``(stage_inflight, 0)``, without a split backward; under one,
    every pair the stage's own operations pass through, less those another holds as many or more of both (the
    node-level model keeps a micro-batch's activations and the gradients at the weight frontier from its input
    pass to its weight pass: :mod:`solvers.activation_memory`)."""
    record = get_schedule(schedule)
    if not record.split_backward or stages % record.stages_per_worker():
        return ((stage_inflight(schedule, stage, stages, micro_batches), 0),)
    return _split_held(schedule, stages, micro_batches)[stage]


@functools.lru_cache(maxsize=1024)
def _split_held(schedule: str, stages: int, micro_batches: int) -> list[tuple[tuple[int, int], ...]]:
    """:func:`stage_held` of every stage under a split backward, from one walk of the workers' orders."""
    workers = get_schedule(schedule).workers(stages)
    seen: list[set[tuple[int, int]]] = [set() for _ in range(stages)]
    for order in worker_orders(schedule, stages, micro_batches, workers):
        forward, pending = {}, {}
        for kind, s, _ in order:
            forward[s] = forward.get(s, 0) + (1 if kind == "F" else -1 if kind in BACKWARDS else 0)
            pending[s] = pending.get(s, 0) + (1 if kind == "I" else -1 if kind == "W" else 0)
            seen[s].add((forward[s], pending[s]))
    return [_undominated(held) for held in seen]


def _undominated(pairs: set[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The pairs no other pair matches or exceeds in both, sorted (one sweep from the most forwards down)."""
    out, most = [], -1
    for f, w in sorted(pairs, key=lambda p: (-p[0], -p[1])):
        if w > most:
            out.append((f, w))
            most = w
    return tuple(sorted(out))
