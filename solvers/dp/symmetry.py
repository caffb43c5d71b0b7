"""Automorphisms of the device topology, and canonical search states under them.

An automorphism is a permutation of the devices that keeps every speed, memory,
bandwidth and latency (the 8-GPU Titan V box has 128: swap the two GPUs behind
each PCIe switch, the two switches of a socket, the two sockets). Two states of
the placement search whose used devices and pending senders are mapped onto
each other by an automorphism have the same futures, so the search keeps one:
:class:`Canon` maps a state to the least image under the group, and the
permutation that did it, so that a plan can be mapped back to real devices.
The pairwise classes of :func:`solvers.dp.tables.device_classes` are the
transpositions among these; the group adds the swaps of whole switches and sockets.
"""

from __future__ import annotations

from solvers.problem import Problem

__all__ = ["MAX_AUTOMORPHISMS", "Canon", "automorphisms"]

MAX_AUTOMORPHISMS = 1024
"""Beyond this many the group is not used (canonicalising costs one pass over it per new state)."""


def automorphisms(problem: Problem, limit: int = MAX_AUTOMORPHISMS) -> list[tuple[int, ...]] | None:
    """Every automorphism of the devices and links (``perm[d]`` is the image of ``d``); None past ``limit``.

    Backtracking: device ``i`` may go to ``j`` when their speed and memory agree and every link to
    the devices placed before keeps its bandwidth and latency both ways.
    """
    n = len(problem.devices)
    bw, lat, devs = problem.bandwidth_Bps, problem.latency_s, problem.devices
    kind = [(d.speed, d.memory_bytes) for d in devs]
    out: list[tuple[int, ...]] = []
    perm: list[int] = []
    taken = [False] * n

    def extend() -> bool:   # False: past the limit
        i = len(perm)
        if i == n:
            out.append(tuple(perm))
            return len(out) <= limit
        for j in range(n):
            if taken[j] or kind[j] != kind[i]:
                continue
            if all(bw[i][a] == bw[j][b] and bw[a][i] == bw[b][j] and lat[i][a] == lat[j][b]
                   and lat[a][i] == lat[b][j] for a, b in enumerate(perm)):
                taken[j] = True
                perm.append(j)
                ok = extend()
                perm.pop()
                taken[j] = False
                if not ok:
                    return False
        return True

    return out if extend() else None


class Canon:
    """Least image of ``(used devices, pending senders)`` under the group, memoised."""

    def __init__(self, group: list[tuple[int, ...]]) -> None:
        self.group = group
        self._memo: dict[tuple[int, tuple[int, ...]], tuple[int, tuple[int, ...], tuple[int, ...]]] = {}

    def canonical(self, used: int, pending: tuple) -> tuple[tuple[int, tuple], tuple[int, ...]]:
        """``used`` is a bit mask of devices, ``pending`` a tuple of ``(node, stage, device)``;
        returns the canonical ``(used, pending)`` and the permutation that maps this state onto it."""
        devs = tuple(d for _, _, d in pending)
        hit = self._memo.get((used, devs))
        if hit is None:
            best = None
            for perm in self.group:
                mask = 0
                for d, image in enumerate(perm):
                    if used >> d & 1:
                        mask |= 1 << image
                key = (mask, tuple(perm[d] for d in devs))
                if best is None or key < best[0]:
                    best = (key, perm)
            assert best is not None
            hit = self._memo[(used, devs)] = (best[0][0], best[0][1], best[1])
        mask, images, perm = hit
        return (mask, tuple((u, a, d) for (u, a, _), d in zip(pending, images))), perm
