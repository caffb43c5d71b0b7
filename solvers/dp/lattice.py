"""The lattice of a DAG's ideals (down-sets), enumerated under a limit, and the stages between two of them.

A convex partition into ordered stages is a chain of ideals ``{} = I_0 < I_1 < ... < I_p = V``, stage ``k``
being ``I_{k+1} \\ I_k`` (:mod:`solvers.dp.ideals` searches those chains). Written by hand because no library
enumerates a DAG's ideals under a limit: networkx has antichains, which biject with ideals, but lists all of
them, with no bound to stop early. Each ideal is found from a smaller one plus a node that it makes
available, level by level, so the work is the number of ideals times the graph's width, and it stops as
soon as the limit is passed (ViT-B/16 has more than 200,000 ideals).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from solvers.dp.frontier import Label, Timeout
from solvers.dp.tables import Tables

__all__ = ["MAX_IDEALS", "MAX_STEPS", "Lattice", "Step", "TooManyIdeals"]


MAX_IDEALS = 3000
"""Above this many ideals the lattice is not built (its transitions grow with the square of the count)."""

MAX_STEPS = 300_000
"""Above this many stages under a plan's per-stage cap the search over ideals is not run: GPT-2's 3 181
ideals give 3.7 million (its search then takes the whole limit and finishes nothing), ResNet-101's 411
give 51 000 (2 s on the 8-GPU Titan V box)."""


@dataclass(slots=True)
class Step:
    """What a stage ``J \\ I`` holds, for one pair of ideals: computed once, read for every state and device."""
    work: float
    params: float
    acts: float
    recv: tuple            # (sender position in I, largest tensor it sends into the stage)
    kept: tuple            # senders of I still read after J
    alive: tuple           # positions of the stage read after J
    kept_bytes: tuple      # for each of ``kept``: its smallest tensor read after J (what it must still send)
    alive_bytes: tuple     # the same for ``alive``
    recv_lb: float         # 2 x one-way time of what the stage receives, over the problem's cheapest links
    kept_lb: float         # the same for what ``kept`` must still send
    alive_lb: float        # the same for what ``alive`` must still send


class TooManyIdeals(Exception):
    """The graph has more ideals than the limit it was enumerated under."""


class Lattice:
    """The ideals of a problem's DAG (as bit masks over ``tables.order``), smallest first, and their steps."""

    def __init__(self, tables: Tables, limit: int = MAX_IDEALS) -> None:
        """Enumerate the ideals level by level (so an ideal's index exceeds its subsets'), each from a smaller
        one plus a node it makes available; raises :class:`TooManyIdeals` past ``limit``."""
        self.tables = tables
        self.cheapest = lambda nbytes: 2.0 * tables.cheapest_one_way(nbytes)   # there and back
        n = tables.n
        self.consumers: list[list[int]] = [[] for _ in range(n)]
        self.out_edges: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        self.edge_bytes: dict[tuple[int, int], float] = {}   # the smallest tensor from u to w
        for w in range(n):
            for u, nbytes in tables.inputs[w]:
                self.consumers[u].append(w)
                self.out_edges[u].append((w, nbytes))
                self.edge_bytes[(u, w)] = min(nbytes, self.edge_bytes.get((u, w), math.inf))
        self.reader_mask = [sum(1 << w for w in set(ws)) for ws in self.consumers]
        preds = [sum(1 << u for u in {u for u, _ in ins}) for ins in tables.inputs]   # edges may repeat
        self.ideals, self.work, self.params, self.acts = [0], [0.0], [0.0], [0.0]
        self.frontier: list[tuple[int, ...]] = [()]   # the nodes of an ideal read outside it
        self.up: list[list[int]] = []                  # the ideals one node larger
        index = {0: 0}
        available = [tuple(v for v in range(n) if not preds[v])]   # nodes an ideal may take next
        level = [0]
        while level:
            nxt: list[int] = []
            for i in level:
                mask, ups = self.ideals[i], []
                for v in available[i]:
                    grown = mask | 1 << v
                    j = index.get(grown)
                    if j is None:
                        if len(self.ideals) >= limit:
                            raise TooManyIdeals(limit)
                        j = index[grown] = len(self.ideals)
                        self.ideals.append(grown)
                        self.work.append(self.work[i] + tables.fb[v])
                        self.params.append(self.params[i] + tables.param[v])
                        self.acts.append(self.acts[i] + tables.act[v])
                        self.frontier.append(tuple(sorted(
                            [u for u in self.frontier[i] if self.reader_mask[u] & ~grown]
                            + ([v] if self.reader_mask[v] & ~grown else []))))
                        available.append(tuple(sorted(
                            [x for x in available[i] if x != v]
                            + [w for w in set(self.consumers[v]) if preds[w] & grown == preds[w]])))
                        nxt.append(j)
                    ups.append(j)
                self.up.append(ups)
            level = nxt
        self.frontier_set = [frozenset(f) for f in self.frontier]
        self._steps: dict[tuple[int, int], Step] = {}
        self._transitions: tuple[float, np.ndarray] | None = None

    @staticmethod
    def members(mask: int) -> list[int]:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out

    @classmethod
    def build(cls, tables: Tables, limit: int = MAX_IDEALS) -> "Lattice | None":
        """The lattice, or None when the graph has more than ``limit`` ideals."""
        try:
            return cls(tables, limit)
        except TooManyIdeals:
            return None

    def reach(self, i: int, work_cap: float) -> list[int]:
        """Ideals ``J > I`` (``I`` = ideal ``i``) whose difference holds at most ``work_cap`` of work."""
        base, seen, todo = self.work[i], set(), [i]
        while todo:
            a = todo.pop()
            for b in self.up[a]:
                if b not in seen and self.work[b] - base <= work_cap:
                    seen.add(b)
                    todo.append(b)
        return sorted(seen)

    def count_steps(self, work_cap: float, limit: int) -> int:
        """How many stages hold at most ``work_cap`` of work, counted up to just past ``limit``."""
        total = 0
        for i in range(len(self.ideals)):
            total += len(self.reach(i, work_cap))
            if total > limit:
                break
        return total

    def transitions(self, work_cap: float, deadline: float = math.inf) -> tuple[np.ndarray, ...]:
        """Every step whose work is at most ``work_cap``, as arrays sorted by lower ideal: lower and upper
        ideal, work, and the receive and send bounds of :class:`Step` (kept across searches, rebuilt only for
        a larger cap)."""
        if self._transitions is None or self._transitions[0] < work_cap:
            rows = []
            for i in range(len(self.ideals)):
                if time.perf_counter() > deadline:
                    raise Timeout
                rows += [(i, j, st.work, st.recv_lb, st.alive_lb) for j in self.reach(i, work_cap)
                         for st in (self.step(i, j),)]
            cols = np.array(rows, dtype=float).reshape(-1, 5)
            self._transitions = (work_cap, cols)
        cols = self._transitions[1]
        keep = cols[:, 2] <= work_cap
        return (cols[keep, 0].astype(np.int64), cols[keep, 1].astype(np.int64), cols[keep, 2], cols[keep, 3],
                cols[keep, 4])

    def step(self, i: int, j: int) -> Step:
        """The stage ``J \\ I`` (ideals ``i`` and ``j``), from the two frontiers: what crosses into the stage
        comes from ``I``'s frontier, what it still sends is ``J``'s frontier outside ``I``."""
        key = (i, j)
        got = self._steps.get(key)
        if got is not None:
            return got
        lo, hi = self.ideals[i], self.ideals[j]
        stage = hi & ~lo
        recv: dict[int, float] = {}
        kept_set = self.frontier_set[j]
        kept, kept_bytes = [], []
        for u in self.frontier[i]:
            for w, nbytes in self.out_edges[u]:
                if stage >> w & 1 and nbytes > recv.get(u, -1.0):
                    recv[u] = nbytes
            if u in kept_set:
                kept.append(u)
                kept_bytes.append(self._least_read_after(u, hi))
        alive = tuple(x for x in self.frontier[j] if not lo >> x & 1)
        alive_bytes = tuple(self._least_read_after(x, hi) for x in alive)
        cheapest = self.cheapest
        got = self._steps[key] = Step(
            work=self.work[j] - self.work[i], params=self.params[j] - self.params[i],
            acts=self.acts[j] - self.acts[i], recv=tuple(sorted(recv.items())), kept=tuple(kept), alive=alive,
            kept_bytes=tuple(kept_bytes), alive_bytes=alive_bytes, recv_lb=sum(cheapest(b) for b in recv.values()),
            kept_lb=sum(map(cheapest, kept_bytes)), alive_lb=sum(map(cheapest, alive_bytes)))
        return got

    def _least_read_after(self, u: int, mask: int) -> float:
        return min(self.edge_bytes[(u, w)] for w in self.consumers[u] if not mask >> w & 1)

    def stages_of(self, label: Label) -> tuple[list[list[int]], list[int]]:
        """The stages (positions) and devices of the plan ending in ``label`` (devices mapped through the
        automorphisms that canonicalised its states, as :func:`solvers.dp.labels.plan_of` does)."""
        stages, devices, to_final = [], [], None
        while label is not None and label.parent is not None:
            stages.append(self.members(self.ideals[label.end] & ~self.ideals[label.start]))
            devices.append(label.device if to_final is None else to_final[label.device])
            if label.sigma is not None:
                to_final = label.sigma if to_final is None else tuple(to_final[x] for x in label.sigma)
            label = label.parent
        return stages[::-1], devices[::-1]
