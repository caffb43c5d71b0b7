"""Tables the dynamic programme reads: prefix sums, transfer bounds, stage counts, interchangeable devices."""

from __future__ import annotations

import math

from solvers.problem import Problem

__all__ = ['REL_TOL', 'Tables', 'balanced_cuts', 'device_classes', 'fastest_link', 'stage_counts']


REL_TOL = 1e-9


def stage_counts(problem: Problem) -> list[int]:
    """The numbers of stages the search covers."""
    if problem.stages is not None:
        return [problem.stages]
    return list(range(1, min(len(problem.devices), len(problem.nodes)) + 1))


def fastest_link(problem: Problem) -> tuple[float, float]:
    """Largest bandwidth and smallest latency between two distinct devices (inf, 0 for one device)."""
    others = [(i, j) for i in range(len(problem.devices)) for j in range(len(problem.devices)) if i != j]
    return (max((problem.bandwidth_Bps[i][j] for i, j in others), default=math.inf),
            min((problem.latency_s[i][j] for i, j in others), default=0.0))


class Tables:
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
        # A stage that starts at position c receives at least the inputs of node c that
        # come from before c, each over the fastest link: 4 one-way transfers in the sum
        # (forward and gradient, charged to both ends). Different boundaries have
        # different receiving stages, so these bounds add up without double counting.
        bw_max, lat_min = fastest_link(problem)
        bw_max *= problem.max_replicas
        self.enter_lb = [0.0] * (n + 1)
        for c in range(1, n):
            first: dict[int, float] = {}
            for u, nbytes in self.inputs[c]:
                first[u] = max(first.get(u, 0.0), nbytes)
            self.enter_lb[c] = 4.0 * sum(b / bw_max + lat_min for b in first.values())
        # cheapest[c]: the smallest enter bounds among positions > c, ascending (at most 16 kept).
        self.cheapest: list[list[float]] = [[] for _ in range(n + 1)]
        for c in range(n - 2, -1, -1):
            self.cheapest[c] = sorted(self.cheapest[c + 1] + [self.enter_lb[c + 1]])[:16]

    def future_transfer_lb(self, cut: int, boundaries: int) -> float:
        """Least transfer time the sum must still pay for ``boundaries`` cuts, the first at ``cut``."""
        if boundaries <= 0:
            return 0.0
        more = self.cheapest[cut][:boundaries - 1]
        return self.enter_lb[cut] + sum(more) if len(more) == boundaries - 1 else math.inf


def balanced_cuts(tables: Tables, p: int) -> list[int]:
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
