"""The topology as a tree of link classes, and canonical search states under the tree's symmetries.

Real interconnects are hierarchical: two GPUs behind one PCIe switch (PIX), two switches of a socket
(PXB), two sockets (SYS), two machines (the network). Then the link between two devices depends only on
the level at which they part: the devices form a tree whose inner nodes each carry one link value, and
swapping two alike subtrees of a node (same shape, same devices) keeps every link, speed and memory.
Those swaps generate a group that can be far larger than :data:`solvers.dp.symmetry.MAX_AUTOMORPHISMS`
(two 8-GPU boxes: 128 x 128 x 2 = 32 768), yet a state's least image under it is found by sorting
subtrees, in time linear in the devices, instead of by a pass over the group.

:func:`link_tree` finds the tree, or says there is none: a set of devices splits at the one link value
``v`` whose removal disconnects it (then every link between the parts is ``v``; no other value can do
this). :class:`TreeCanon` has :class:`solvers.dp.symmetry.Canon`'s interface, so the label search
keeps one state per orbit and :func:`solvers.dp.labels.plan_of` maps plans back to real devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from solvers.problem import Problem

__all__ = ["Tree", "TreeCanon", "link_tree"]


@dataclass
class Tree:
    """A device (``leaf`` set) or a group of subtrees joined pairwise by one link value (in ``shape``)."""

    shape: tuple                 # equal shapes: alike subtrees (same structure, links and devices)
    leaf: int | None = None
    children: list["Tree"] = field(default_factory=list)

    def leaves(self) -> list[int]:
        return [self.leaf] if self.leaf is not None else [x for c in self.children for x in c.leaves()]

    def symmetries(self) -> int:
        """Order of the group its swaps generate: per node, the orders of its children and, for each
        shape, the orderings of the children of that shape."""
        order = 1
        for shape in {c.shape for c in self.children}:
            alike = [c for c in self.children if c.shape == shape]
            order *= math.factorial(len(alike)) * alike[0].symmetries() ** len(alike)
        return order


def _value(problem: Problem, i: int, j: int) -> tuple:
    return (problem.bandwidth_Bps[i][j], problem.latency_s[i][j])


def link_tree(problem: Problem) -> Tree | None:
    """The tree of link classes of the devices; None when the links are not hierarchical
    (or not symmetric: a tree's swaps keep only links that are the same both ways)."""
    n = len(problem.devices)
    if any(_value(problem, i, j) != _value(problem, j, i) for i in range(n) for j in range(i)):
        return None
    kinds = {d: (problem.devices[d].speed, problem.devices[d].memory_bytes) for d in range(n)}

    def build(members: list[int]) -> Tree | None:
        if len(members) == 1:
            return Tree(shape=("device", kinds[members[0]]), leaf=members[0])
        for value in sorted({_value(problem, i, j) for i in members for j in members if i < j}):
            parts = _components(members, lambda i, j: _value(problem, i, j) != value)
            if len(parts) > 1:
                children = [build(part) for part in parts]
                if any(c is None for c in children):
                    return None
                kids = [c for c in children if c is not None]
                return Tree(shape=("group", value, tuple(sorted(c.shape for c in kids))), children=kids)
        return None

    return build(list(range(n)))


def _components(members: list[int], joined) -> list[list[int]]:
    """Connected components of ``members`` under the relation ``joined``, each in ascending order."""
    left, parts = set(members), []
    while left:
        start = min(left)
        left.discard(start)
        part, stack = [start], [start]
        while stack:
            i = stack.pop()
            for j in sorted(left):
                if joined(i, j):
                    left.discard(j)
                    part.append(j)
                    stack.append(j)
        parts.append(sorted(part))
    return parts


class TreeCanon:
    """Least image of ``(used devices, pending senders)`` under the swaps of alike subtrees, memoised.

    A subtree's signature is its shape and, sorted, its children's signatures; a device's is whether it
    is used and which pending senders (node, stage) sit on it. Equal signatures are equal up to the
    group, so mapping, within every node, the children of each shape in signature order onto that
    shape's children in the tree's own order gives the same image for every state of an orbit.
    """

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self._memo: dict[tuple[int, tuple[int, ...]], tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
        self.size = len(tree.leaves())

    def _signature(self, node: Tree, used: int, on: dict[int, tuple], out: dict[int, tuple]) -> tuple:
        """``node``'s signature, and every subtree's in ``out`` by ``id`` (computed once per state)."""
        if node.leaf is not None:
            sig = (node.shape, used >> node.leaf & 1, on.get(node.leaf, ()))
        else:
            sig = (node.shape, tuple(sorted(self._signature(c, used, on, out) for c in node.children)))
        out[id(node)] = sig
        return sig

    def _assign(self, real: Tree, slot: Tree, signatures: dict[int, tuple], perm: list[int]) -> None:
        if real.leaf is not None:
            perm[real.leaf] = slot.leaf   # type: ignore[assignment]
            return
        for shape in {c.shape for c in real.children}:
            reals = sorted((c for c in real.children if c.shape == shape), key=lambda c: signatures[id(c)])
            slots = [c for c in slot.children if c.shape == shape]
            for r, s in zip(reals, slots):
                self._assign(r, s, signatures, perm)

    def canonical(self, used: int, pending: tuple) -> tuple[tuple[int, tuple], tuple[int, ...]]:
        """``used`` is a bit mask of devices, ``pending`` a tuple of ``(node, stage, device)``;
        returns the canonical ``(used, pending)`` and the permutation that maps this state onto it."""
        devs = tuple(d for _, _, d in pending)
        hit = self._memo.get((used, devs))
        if hit is None:
            on: dict[int, list] = {}
            for i, d in enumerate(devs):
                on.setdefault(d, []).append(i)   # which pending entries sit on d, by their place in the tuple
            frozen = {d: tuple(v) for d, v in on.items()}
            perm = [0] * self.size
            signatures: dict[int, tuple] = {}
            self._signature(self.tree, used, frozen, signatures)
            self._assign(self.tree, self.tree, signatures, perm)
            mask = 0
            for d in range(self.size):
                if used >> d & 1:
                    mask |= 1 << perm[d]
            hit = self._memo[(used, devs)] = (mask, tuple(perm[d] for d in devs), tuple(perm))
        mask, images, perm_t = hit
        return (mask, tuple((u, a, d) for (u, a, _), d in zip(pending, images))), perm_t
