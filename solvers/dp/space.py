"""Which device (or replica group) the next stage may take in the label search: a :class:`Space`.

Three spaces: stage ``k`` on a fixed order of devices, any unused device up to interchangeable ones (or up to
the topology's automorphisms, :class:`solvers.dp.symmetry.Canon`, or of its tree of link classes,
:class:`solvers.dp.hierarchy.TreeCanon`), or runs of consecutive devices of an order
as replica groups. :mod:`solvers.dp.labels` searches one space at a time."""

from __future__ import annotations

from solvers.groups import GroupTable
from solvers.dp.hierarchy import TreeCanon
from solvers.dp.symmetry import Canon

__all__ = ["Space"]


class Space:
    """Which device group stage ``k`` may take, given the devices used so far.

    * ``"order"``: stage ``k`` on device group ``order[k]`` (``order = 0, 1, ...``, single devices, is
      topology-blind); ``p`` stages need ``p`` entries.
    * ``"classes"``: any unused device, one per group of interchangeable devices
      (any injective mapping, up to relabelling).
    * ``"runs"``: the next ``r = 1..max_replicas`` devices of ``order`` as one replica group.
    """

    def __init__(self, kind: str, table: GroupTable, order: list[int] | None = None,
                 classes: list[list[int]] | None = None, max_replicas: int = 1,
                 canon: Canon | TreeCanon | None = None) -> None:
        self.kind, self.table, self.order, self.classes = kind, table, order, classes
        self.canon = canon if kind == "classes" else None   # then ``used`` is a bit mask of devices
        self.max_replicas = max_replicas
        n = len(table.problem.devices)
        self._runs: dict[tuple[int, int], int] = {}
        if kind == "runs":
            for start in range(n):
                for r in range(1, min(max_replicas, n - start) + 1):
                    self._runs[(start, r)] = table.add(tuple(order[start:start + r]))

    def start(self) -> tuple | int:
        if self.canon is not None:
            return 0
        return (0,) * len(self.classes) if self.kind == "classes" else ()

    def candidates(self, used: tuple, k: int, p: int, pending: tuple = ()) -> list[tuple[int, tuple]]:
        """``(device group, devices used after it)`` for stage ``k``, given the state's ``used`` and ``pending``.

        With a canonical form, one device per orbit of the symmetries that keep the state: two devices
        that such a symmetry swaps lead to mirror images of the same futures, at the same costs.
        """
        if self.kind == "order":
            return [(self.order[k], used)]
        if self.canon is not None:   # the lowest unused device of each class, one per orbit
            out, seen = [], set()
            for group in self.classes:
                d = next((d for d in group if not used >> d & 1), None)
                if d is not None:
                    # d marked as a pending sender no node has: equal forms differ by a symmetry that
                    # keeps ``used`` and ``pending`` and maps one device onto the other
                    form = self.canon.canonical(used | 1 << d, pending + ((-1, -1, d),))[0]
                    if form not in seen:
                        seen.add(form)
                        out.append((d, used | 1 << d))
            return out
        if self.kind == "classes":
            return [(group[used[c]], used[:c] + (used[c] + 1,) + used[c + 1:])
                    for c, group in enumerate(self.classes) if used[c] < len(group)]
        taken = used[0] if used else 0
        room = len(self.order) - taken - (p - k - 1)
        return [(self._runs[(taken, r)], (taken + r,)) for r in range(1, min(self.max_replicas, room) + 1)]

    @property
    def mixed_speeds(self) -> bool:
        """Whether stages of this space may run at different speeds (not ``"runs"``, whose bounds take the fastest)."""
        if self.kind == "order":
            return len({self.table.groups[g].speed for g in self.order}) > 1
        return self.kind != "runs" and len({d.speed for d in self.table.problem.devices}) > 1

    def stage_speeds(self, p: int) -> list[float]:
        """The fastest speeds ``p`` stages of this space can have (those of ``order[:p]`` in ``"order"``)."""
        devs = self.table.problem.devices
        if self.kind == "order":
            return [self.table.groups[g].speed for g in self.order[:p]]
        return sorted((d.speed for d in devs), reverse=True)[:p]

    def rest_speeds(self, used: tuple | int, k: int, p: int) -> tuple[float, ...]:
        """The fastest speeds stages ``k + 1 .. p - 1`` can have once ``used`` (after stage ``k``) is taken."""
        devs = self.table.problem.devices
        if self.kind == "order":
            return tuple(self.table.groups[g].speed for g in self.order[k + 1:p])
        if self.canon is not None:
            free = [devs[d].speed for d in range(len(devs)) if not used >> d & 1]
        else:
            free = [devs[d].speed for c, group in enumerate(self.classes) for d in group[used[c]:]]
        return tuple(sorted(free, reverse=True)[:p - k - 1])

    def speeds(self, p: int) -> tuple[float, float]:
        """(fastest stage speed, largest total speed of ``p`` stages) over this space."""
        devs = self.table.problem.devices
        if self.kind == "order":
            sp = [self.table.groups[g].speed for g in self.order[:p]]
            return max(sp), sum(sp)
        if self.kind == "classes":
            sp = sorted((d.speed for d in devs), reverse=True)[:p]
            return max(sp), sum(sp)
        return max(self.table.groups[g].speed for g in self._runs.values()), sum(d.speed for d in devs)
