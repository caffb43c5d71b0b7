"""Solving with groups of operations kept in one stage: repeated blocks by default, the user's kept-whole
modules always.

The groups (:mod:`fxpipe.planning.blocks`, and ``leaf_modules`` under torch.export in
``gm.meta["fxpipe_keep_whole"]``) are contracted to one node each (:func:`solvers.together.contract`),
the contracted problem is solved, and the answer is expanded, scored and certified on the full problem
(:func:`solvers.together.solve_together`), so the plan's numbers are those of its real stages. Blocks are a preference: when no plan keeps every block whole
(fewer nodes than stages, or memory), the planner cuts inside blocks and says so (``plan.solver
["kept_whole"]``, shown by ``plan.summary()``). A user's kept-whole module is a requirement, as it is
with fx, where a leaf is one node; a group that cannot be one node (not convex: a path leaves it and
comes back) is not kept, and the note says which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import solvers
from solvers.together import convex, solve_together

__all__ = ["Grouping", "solve_grouped"]


@dataclass
class Grouping:
    """Label -> operation names: what must stay whole, and the repeated blocks that preferably do."""

    required: dict[str, list[str]]
    blocks: dict[str, list[str]]
    # which groups are convex, by the problem's nodes: every problem of one graph asks the same (an auto
    # search solves a dozen), and each answer walks the whole graph once per group
    convex: dict[Any, tuple[dict[str, list[str]], list[str]]] = field(default_factory=dict, repr=False)

    def convex_groups(self, problem: solvers.Problem,
                      groups: dict[str, list[str]]) -> tuple[dict[str, list[str]], list[str]]:
        """:func:`_convex`, once per graph and groups."""
        key = (tuple(n.id for n in problem.nodes), tuple(sorted((k, tuple(v)) for k, v in groups.items())))
        if key not in self.convex:
            self.convex[key] = _convex(problem, groups)
        return self.convex[key]


def _merged(*parts: dict[str, list[str]]) -> dict[str, list[str]]:
    """Groups that share a node joined (a kept module inside a block is kept whole by its block)."""
    out: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for part in parts:
        for label, names in part.items():
            joined = {owner[n] for n in names if n in owner}
            merged = [n for j in sorted(joined) for n in out.pop(j)] + [n for n in names if n not in owner]
            key = sorted(joined)[0] if joined else label
            out[key] = merged
            owner.update({n: key for n in merged})
    return out


def _convex(problem: solvers.Problem, groups: dict[str, list[str]]) -> tuple[dict[str, list[str]], list[str]]:
    known = set(problem.node_map())
    graph = problem.graph()
    kept, dropped = {}, []
    for label, names in groups.items():
        members = {n for n in names if n in known}
        if len(members) < 2:
            continue
        if convex(problem, members, graph):
            kept[label] = sorted(members)
        else:
            dropped.append(label)
    return kept, dropped


def _span(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else f"{labels[0]} … {labels[-1]}"


def solve_grouped(problem: solvers.Problem, grouping: Grouping,
                  solve: Callable[[solvers.Problem], solvers.Solution]) -> solvers.Solution:
    """The best plan keeping ``grouping.required`` and, where any plan can, every block whole."""
    required, not_convex = grouping.convex_groups(problem, grouping.required)
    both, not_convex_blocks = grouping.convex_groups(problem, _merged(grouping.blocks, required))
    blocks = [b for b in grouping.blocks if b in both]
    notes = []
    if not_convex:
        notes.append(f"not kept whole (a path leaves it and comes back): {', '.join(not_convex)}")
    said_blocks = f"{len(blocks)} blocks ({_span(blocks)})" if blocks else ""
    attempts = [(both, said_blocks)] if blocks else []
    attempts.append((required, ""))
    failure: Exception | None = None
    for groups, note in attempts:
        if not groups:
            solution = solve(problem)
        else:
            try:
                solution = solve_together(problem, groups, solve)
            except (solvers.InfeasibleError, solvers.InvalidProblemError) as exc:
                if groups is required:
                    raise
                failure = exc
                continue
        if failure is not None:
            note = (f"cut inside blocks: no plan keeps the {len(blocks)} blocks ({_span(blocks)}) whole "
                    f"({str(failure).splitlines()[0]})")
        if required:
            note = "; ".join(x for x in (note, f"also in one stage: {', '.join(required)}") if x)
        solution.solver["kept_whole"] = "; ".join(x for x in (note, *notes) if x)
        return solution
    raise AssertionError("unreachable: the last attempt raises or returns")
