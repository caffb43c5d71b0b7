"""Device groups: what a stage runs on, alone or as a data-parallel replica group.

A stage on ``r`` devices (format ``fxpipe-problem/2``) splits every micro-batch
evenly over its replicas, as OneFlow's and PipeDream's replicated stages do:

* compute: ``C / (r x slowest speed)`` (synchronous replicas wait for the slowest);
* memory per device: full parameters (and optimizer state), ``1/r`` of the activations;
* gradients: a ring all-reduce of the stage's parameter bytes once per iteration,
  ``2 (r-1)/r x P / slowest in-group bandwidth + 2 (r-1) x worst in-group latency``,
  spread over the ``m`` micro-batches in the stage time (``+ AR / m``), so a
  bottleneck stage pays it exactly once in ``T = sum t + (m-1) max t``;
* a boundary tensor between groups of ``ra`` and ``rb`` devices moves in
  ``min(ra, rb)`` parallel pieces over the slowest link between the groups:
  ``bytes / (min(ra, rb) x slowest bandwidth) + worst latency`` one way.

With ``r = 1`` every formula is the ``fxpipe-problem/1`` one. Also here: the
hierarchical device order (hosts, sockets, switches as contiguous runs), which
replica groups and the beyond-16-devices placement are drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

from solvers.problem import Problem

__all__ = ["Group", "GroupTable", "hierarchical_order", "allreduce_s"]


@dataclass(frozen=True)
class Group:
    devices: tuple[int, ...]
    speed: float            # r x slowest member speed
    memory_bytes: float     # smallest member memory
    ring_bw: float          # slowest link inside the group (inf for one device)
    ring_lat: float         # worst latency inside the group

    @property
    def replicas(self) -> int:
        return len(self.devices)


def allreduce_s(group: Group, param_bytes: float) -> float:
    """Ring all-reduce time of ``param_bytes`` of gradients over the group (0 for one device)."""
    r = group.replicas
    if r == 1 or param_bytes == 0:
        return 0.0
    return 2.0 * (r - 1) / r * param_bytes / group.ring_bw + 2.0 * (r - 1) * group.ring_lat


class GroupTable:
    """Groups of a problem by index (single devices first, index = device index) and their links."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.groups: list[Group] = []
        self.index: dict[tuple[int, ...], int] = {}
        for d in range(len(problem.devices)):
            self.add((d,))
        self._links: dict[tuple[int, int], tuple[float, float]] = {}

    def add(self, devices: tuple[int, ...]) -> int:
        if devices in self.index:
            return self.index[devices]
        p = self.problem
        pairs = [(a, b) for a in devices for b in devices if a != b]
        group = Group(
            devices=devices,
            speed=len(devices) * min(p.devices[d].speed for d in devices),
            memory_bytes=min(p.devices[d].memory_bytes for d in devices),
            ring_bw=min((p.bandwidth_Bps[a][b] for a, b in pairs), default=float("inf")),
            ring_lat=max((p.latency_s[a][b] for a, b in pairs), default=0.0),
        )
        self.index[devices] = len(self.groups)
        self.groups.append(group)
        return self.index[devices]

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(effective bandwidth, latency) from group ``a`` to group ``b``."""
        key = (a, b)
        if key not in self._links:
            p, ga, gb = self.problem, self.groups[a], self.groups[b]
            if len(ga.devices) == 1 and len(gb.devices) == 1:
                u, v = ga.devices[0], gb.devices[0]
                self._links[key] = (p.bandwidth_Bps[u][v], p.latency_s[u][v])
            else:
                bw = min(p.bandwidth_Bps[u][v] for u in ga.devices for v in gb.devices)
                lat = max(p.latency_s[u][v] for u in ga.devices for v in gb.devices)
                self._links[key] = (min(ga.replicas, gb.replicas) * bw, lat)
        return self._links[key]

    def transfer_s(self, nbytes: float, a: int, b: int) -> float:
        """One-way time of a boundary tensor of ``nbytes`` from group ``a`` to group ``b``."""
        bw, lat = self.link(a, b)
        return nbytes / bw + lat


def hierarchical_order(problem: Problem) -> list[int]:
    """Devices ordered so that every cluster of fast links is a contiguous run.

    Single-linkage clustering of the link matrix (Kruskal on pairs sorted by
    bandwidth, then latency): merging two clusters concatenates their orders, so
    a PIX pair, a PCIe switch, a socket and a host each end up contiguous.
    """
    n = len(problem.devices)
    cluster = {d: [d] for d in range(n)}
    owner = list(range(n))
    pairs = sorted(((i, j) for i in range(n) for j in range(i + 1, n)),
                   key=lambda ij: (-min(problem.bandwidth_Bps[ij[0]][ij[1]], problem.bandwidth_Bps[ij[1]][ij[0]]),
                                   max(problem.latency_s[ij[0]][ij[1]], problem.latency_s[ij[1]][ij[0]]), ij))
    for i, j in pairs:
        a, b = owner[i], owner[j]
        if a == b:
            continue
        first, second = (a, b) if a < b else (b, a)
        cluster[first] = cluster[first] + cluster.pop(second)
        for d in cluster[first]:
            owner[d] = first
    return cluster[0] if n else []
