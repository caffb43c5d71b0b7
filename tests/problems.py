"""Random planning problems for the solver tests (chains and skip connections)."""

from __future__ import annotations

import random

from solvers import Problem

__all__ = ["KINDS", "SHAPES", "random_problem", "reference_problem", "shaped_problem"]


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


KINDS = ("chain", "skip", "branch", "parallel")


def reference_problem(rng: random.Random, kind: str, n: int, devices: int, schedule: str,
                      tight_memory: bool) -> Problem:
    """A random problem of one ``kind`` with heterogeneous devices and links.

    ``branch``: each node reads one to three earlier nodes; ``parallel``: a source, two or
    three branches listed interleaved (as a trace may list them), a sink that reads them all.
    """
    base = random_problem(rng, n, devices, kind == "skip", schedule, tight_memory)
    doc = base.to_dict()
    if tight_memory:   # a fraction of what one stage holding everything needs: binds, rarely excludes all
        need = sum(v["param_bytes"] * (1 + doc["optimizer_state_factor"]) + v["act_bytes"] * doc["micro_batches"]
                   for v in doc["nodes"])
        for d in doc["devices"]:
            d["memory_bytes"] = need * rng.uniform(0.5, 1.5) / len(doc["devices"]) ** 0.5
    if kind in ("chain", "skip"):
        return Problem.from_dict(doc)
    doc["edges"] = []
    if kind == "branch":
        for i in range(1, n):
            for j in rng.sample(range(i), k=min(i, rng.randint(1, 3))):
                doc["edges"].append({"src": f"n{j}", "dst": f"n{i}", "bytes": rng.uniform(0, 5)})
    else:
        width = rng.choice([2, 3]) if n >= 5 else 2
        last = {b: 0 for b in range(width)}   # branch -> its latest node (all start at the source)
        for i in range(1, n - 1):
            b = (i - 1) % width
            doc["edges"].append({"src": f"n{last[b]}", "dst": f"n{i}", "bytes": rng.uniform(0, 5)})
            last[b] = i
        for b in set(last.values()):
            doc["edges"].append({"src": f"n{b}", "dst": f"n{n - 1}", "bytes": rng.uniform(0, 5)})
    return Problem.from_dict(doc)


SHAPES = ("multi_source", "multi_sink", "dense", "free_nodes", "diamonds")


def shaped_problem(rng: random.Random, shape: str) -> Problem:
    """A random problem of a shape ``reference_problem`` does not make: several sources or sinks, a dense DAG,
    nodes that cost nothing, runs of diamonds; one-way link asymmetry, devices without memory, fixed stage counts
    and edges of no bytes in any of them."""
    n = rng.randint(2, 6)
    nodes = []
    for i in range(n):
        free = shape == "free_nodes" and rng.random() < 0.4   # no compute, no memory
        nodes.append({"id": f"v{i}", "fwd_s": 0.0 if free else rng.choice([0.1, 0.5, 1.0, rng.uniform(0, 2)]),
                      "bwd_s": 0.0 if free else rng.uniform(0, 2),
                      "param_bytes": 0.0 if free else rng.choice([0.0, rng.uniform(0, 20)]),
                      "act_bytes": 0.0 if free else rng.choice([0.0, rng.uniform(0, 20)])})
    edges = []
    for i in range(1, n):
        if shape == "multi_source" and i < 2:
            continue   # v0 and v1 are both sources
        if shape == "dense":
            sources = [j for j in range(i) if rng.random() < 0.6] or [i - 1]
        elif shape == "diamonds":
            sources = [max(0, i - rng.choice([1, 2]))]
        elif shape == "multi_sink":
            sources = [rng.randrange(i)]
        else:
            sources = [i - 1]
        edges += [{"src": f"v{j}", "dst": f"v{i}", "bytes": rng.choice([0.0, rng.uniform(0, 30)])} for j in sources]
    if shape == "multi_source" and n >= 3:
        edges += [{"src": "v0", "dst": f"v{n - 1}", "bytes": rng.uniform(0, 30)},
                  {"src": "v1", "dst": f"v{n - 1}", "bytes": rng.uniform(0, 30)}]
    d = rng.randint(1, 4)
    symmetric = rng.random() < 0.5
    bandwidth = [[0.0] * d for _ in range(d)]
    latency = [[0.0] * d for _ in range(d)]
    for i in range(d):
        for j in range(d):
            if i != j:
                if symmetric and j < i:
                    bandwidth[i][j], latency[i][j] = bandwidth[j][i], latency[j][i]
                else:
                    bandwidth[i][j] = rng.choice([1.0, 3.0, 10.0, 100.0])
                    latency[i][j] = rng.choice([0.0, 0.0, 0.05, 0.3])
    devices = [{"id": f"d{i}", "memory_bytes": rng.choice([1e9, rng.uniform(10, 120), 1e9, 0.0]),
                "speed": rng.choice([1.0, 1.0, 0.5, 2.0, 1.5])} for i in range(d)]
    return Problem.from_dict({
        "format": "fxpipe-problem/1", "micro_batches": rng.randint(1, 8), "schedule": rng.choice(["gpipe", "1f1b"]),
        "stages": rng.choice([None, None, None, rng.randint(1, max(1, min(d, n)))]),
        "optimizer_state_factor": rng.choice([0, 1, 2]), "nodes": nodes, "edges": edges, "devices": devices,
        "links": {"bandwidth_Bps": bandwidth, "latency_s": latency}})
