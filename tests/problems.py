"""Random planning problems for the solver tests (chains and skip connections)."""

from __future__ import annotations

import random

from solvers import Problem

__all__ = ["random_problem"]


def random_problem(rng: random.Random, n: int, devices: int, skips: bool, schedule: str,
                   tight_memory: bool, mixed_links: bool = True) -> Problem:
    nodes = [dict(id=f"n{i}", fwd_s=rng.uniform(0.1, 1), bwd_s=rng.uniform(0.1, 2),
                  param_bytes=rng.uniform(0, 10), act_bytes=rng.uniform(0, 10)) for i in range(n)]
    edges = [dict(src=f"n{i}", dst=f"n{i + 1}", bytes=rng.uniform(0, 5)) for i in range(n - 1)]
    if skips and n >= 3:
        for _ in range(rng.randint(1, n)):
            a = rng.randrange(n - 2)
            b = rng.randrange(a + 2, n)
            edges.append(dict(src=f"n{a}", dst=f"n{b}", bytes=rng.uniform(0, 5)))
    pick = (lambda *xs: rng.choice(xs)) if mixed_links else (lambda *xs: xs[0])
    bw = [[0 if i == j else pick(2, 1, 5, 10) for j in range(devices)] for i in range(devices)]
    lat = [[0 if i == j else pick(0.01, 0, 0.1) for j in range(devices)] for i in range(devices)]
    devs = [dict(id=f"d{i}", memory_bytes=rng.uniform(20, 80) if tight_memory else 1e9,
                 speed=rng.choice([1, 1, 2, 0.5])) for i in range(devices)]
    return Problem.from_dict(dict(
        format="fxpipe-problem/1", micro_batches=rng.randint(1, 6), schedule=schedule,
        stages=rng.choice([None, None, max(1, min(devices, n) // 2)]),
        optimizer_state_factor=rng.choice([0, 1, 2]), nodes=nodes, edges=edges, devices=devs,
        links=dict(bandwidth_Bps=bw, latency_s=lat)))
