"""Tables the dynamic programme reads: prefix sums, transfer bounds, stage counts, interchangeable devices."""

from __future__ import annotations

import math

import numpy as np

from solvers.problem import Problem

__all__ = ['REL_TOL', 'Tables', 'balanced_cuts', 'device_classes', 'fastest_link', 'one_way_classes', 'stage_counts']


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


def one_way_classes(problem: Problem) -> list[tuple[float, float]]:
    """The distinct ``(bandwidth, latency)`` of the problem's links, bandwidth times the most replicas a
    stage may have, without those another beats both ways: a boundary tensor crosses one of them, or slower."""
    d = len(problem.devices)
    links = {(problem.bandwidth_Bps[i][j] * problem.max_replicas, problem.latency_s[i][j])
             for i in range(d) for j in range(d) if i != j}
    return sorted(x for x in links if not any(y != x and y[0] >= x[0] and y[1] <= x[1] for y in links))


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
        # come from before c, each over the link that is cheapest for its size (any placement
        # uses one of the problem's links; a replica group's is no faster than the best of them
        # times the replicas): 4 one-way transfers in the sum (forward and gradient, charged to
        # both ends). Different boundaries have different receiving stages, so these bounds add
        # up without double counting.
        self._link_classes = one_way_classes(problem)
        cheapest_one_way = self.cheapest_one_way
        self.enter_lb = [0.0] * (n + 1)
        # What the stage ending just before c must at least send: node c's inputs from each position,
        # both ways (two one-way transfers; the receiver pays the other two).
        self.sent_to: list[list[tuple[int, float]]] = [[] for _ in range(n + 1)]
        for c in range(1, n):
            first: dict[int, float] = {}
            for u, nbytes in self.inputs[c]:
                first[u] = max(first.get(u, 0.0), nbytes)
            self.sent_to[c] = sorted((u, 2.0 * cheapest_one_way(b)) for u, b in first.items())
            self.enter_lb[c] = 2.0 * sum(cost for _, cost in self.sent_to[c])
        # crossing_lb[c]: the same, for every tensor that crosses a cut at c (made before c, read at or
        # after it): a stage that starts at c and holds at least ``span`` positions receives them all, since
        # no edge reaches further than ``span`` positions (residual skips cross most cuts besides node c's
        # own inputs). One transfer per sender, of its largest tensor read past the cut.
        self.span = max((pos[e.dst] - pos[e.src] for e in problem.edges), default=1)
        added = np.zeros(n + 2)
        reads: dict[int, list[tuple[int, float]]] = {}
        for w in range(n):
            for u, nbytes in self.inputs[w]:
                reads.setdefault(u, []).append((w, nbytes))
        for u, out in reads.items():
            out.sort(reverse=True)   # farthest reader first: the largest tensor read at or after each cut
            largest = 0.0
            for i, (w, nbytes) in enumerate(out):
                largest = max(largest, nbytes)
                after = out[i + 1][0] if i + 1 < len(out) else u
                if after < w:   # cuts in (after, w] see this largest tensor
                    cost = 4.0 * cheapest_one_way(largest)
                    added[after + 1] += cost
                    added[w + 1] -= cost
        self.crossing_lb = [float(x) for x in np.cumsum(added)[:n + 1]]
        self._bottleneck: dict[float, list[list[float]]] = {}
        self._transfer_lbs: list[list[float]] = []
        # cheapest[c]: the smallest enter bounds among positions > c, ascending (at most 16 kept).
        self.cheapest: list[list[float]] = [[] for _ in range(n + 1)]
        for c in range(n - 2, -1, -1):
            self.cheapest[c] = sorted(self.cheapest[c + 1] + [self.enter_lb[c + 1]])[:16]

    def cheapest_one_way(self, nbytes: float) -> float:
        """The least one-way time of a ``nbytes`` tensor over any of the problem's links (0 with one device)."""
        return min((nbytes / bw + lat for bw, lat in self._link_classes), default=0.0)

    def future_transfer_lb(self, cut: int, boundaries: int) -> float:
        """Least transfer time the sum must still pay for ``boundaries`` cuts, the first at ``cut``."""
        if boundaries <= 0:
            return 0.0
        more = self.cheapest[cut][:boundaries - 1]
        return self.enter_lb[cut] + sum(more) if len(more) == boundaries - 1 else math.inf

    def future_transfer_lbs(self, boundaries: int) -> list[list[float]]:
        """``future_transfer_lb(cut, b)`` as ``table[b][cut]`` for every ``b <= boundaries``, computed once."""
        while len(self._transfer_lbs) <= boundaries:
            b = len(self._transfer_lbs)
            self._transfer_lbs.append([self.future_transfer_lb(cut, b) for cut in range(self.n + 1)])
        return self._transfer_lbs

    def suffix_bottleneck(self, speed: float, stages: int) -> list[list[float]]:
        """``B[s][j]``: every plan that covers positions ``[j, n)`` with ``s`` stages (``s <= stages``) has a
        stage that takes at least this long, at ``speed`` or slower.

        A stage ``[a, b)`` takes at least its compute, half of ``enter_lb[a]`` (what it receives for node
        ``a``) and, unless it is the last, what it sends for node ``b``'s inputs from inside it; the least
        largest such bound over the partitions is a bottleneck programme, one vector step per end ``b``.
        It bounds the future's slowest stage far better than the average compute when transfers are large.
        """
        # one table per speed, grown a stage count at a time: row s needs only row s - 1, and the
        # searches ask for 1, 2, ... stage counts in turn
        table = self._bottleneck.get(speed)
        if table is not None and len(table) > stages:
            return table
        n = self.n
        pre = np.concatenate([[0.0], np.cumsum(self.fb)])
        recv = np.array(self.enter_lb[:n]) / 2.0
        if table is None:
            table = self._bottleneck[speed] = [
                [math.inf] * (n + 1), [float(x) for x in (pre[n] - pre[:n]) / speed + recv] + [math.inf]]
        while len(table) <= stages:
            s, later = len(table), table[-1]
            best = np.full(n + 1, math.inf)
            for b in range(1, n - s + 2):
                if later[b] == math.inf:
                    continue
                stage = (pre[b] - pre[:b]) / speed + recv[:b]
                for u, cost in self.sent_to[b]:   # starts at or before u: sends u's output to b
                    stage[:u + 1] += cost
                np.minimum(best[:b], np.maximum(stage, later[b]), out=best[:b])
            table.append([float(x) for x in best])
        return table


def balanced_cuts(tables: Tables, p: int, speeds: list[float] | None = None) -> list[int]:
    """Cut positions that split compute in proportion to ``speeds`` (evenly when None): stage ``k`` gets
    ``speeds[k] / sum(speeds)`` of the work, a cheap incumbent for pruning."""
    total = tables.suffix_fb[0]
    shares = speeds if speeds is not None else [1.0] * p
    targets, acc_share = [], 0.0
    for share in shares[:-1]:
        acc_share += share
        targets.append(total * acc_share / sum(shares))
    cuts: list[int] = []
    acc = 0.0
    for i in range(tables.n):
        acc += tables.fb[i]
        if len(cuts) < p - 1 and acc >= targets[len(cuts)] and i + 1 < tables.n:
            cuts.append(i + 1)
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
