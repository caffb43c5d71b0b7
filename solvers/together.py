"""Nodes that must share a stage: a problem whose groups of nodes are contracted to one node each, and back.

A caller that wants some sets of nodes kept whole (a transformer block, a module the user keeps as a
leaf) solves :func:`contract`'s problem with any solver and maps the answer back with :func:`expand`;
every stage of the result then holds each group entirely or not at all. A contracted node costs the sum
of its members (compute, parameters, activations); an edge into or out of a group carries, per source
node, the largest tensor that source sends into the group, as :func:`solvers.score.score_assignment`
charges one transfer per source and receiving stage. That is exact where no group has two members sending
into one stage through different receivers (a chain of blocks: each sends its output on to the next);
otherwise the contracted problem counts the largest of those sends, not their sum, so the answer is always
scored again on the original problem. A group must be convex (no path leaves it and comes
back), or the contracted graph would have a cycle: :func:`convex` says which are.

:func:`solve_together` does the three steps and scores and certifies the answer on the original problem:
its bound is then only the one that holds over the whole reference space (the grouped search proves
nothing about plans that split a group), so ``optimal`` is claimed only when that bound meets it.
"""

from __future__ import annotations

import time
from typing import Callable

import networkx as nx

from solvers.certificate import certify
from solvers.errors import InvalidProblemError
from solvers.problem import Edge, Node, Problem
from solvers.score import score
from solvers.solution import Solution, Stage

__all__ = ["contract", "expand", "convex", "group_id", "solve_together"]


def group_id(label: str) -> str:
    """The contracted node's id (``"group:<label>"``)."""
    return f"group:{label}"


def _reach(graph: nx.DiGraph, start: set[str], forward: bool) -> set[str]:
    """Every node reached from ``start`` along (or against) the edges, ``start`` itself only if on a cycle."""
    step = graph.successors if forward else graph.predecessors
    seen: set[str] = set()
    todo = [n for s in start for n in step(s)]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def convex(problem: Problem, members: set[str], graph: nx.DiGraph | None = None) -> bool:
    """No node outside ``members`` lies on a path between two members."""
    graph = problem.graph() if graph is None else graph
    return not ((_reach(graph, members, True) & _reach(graph, members, False)) - members)


def contract(problem: Problem, groups: dict[str, list[str]]) -> Problem:
    """``problem`` with each group (label -> member node ids, disjoint, convex) as one node."""
    owner: dict[str, str] = {}
    for label, members in groups.items():
        for m in members:
            if m in owner:
                raise InvalidProblemError(f"node {m!r} is in two groups: {owner[m]!r} and {group_id(label)!r}")
            owner[m] = group_id(label)
    known = problem.node_map()
    unknown = sorted(set(owner) - set(known))
    if unknown:
        raise InvalidProblemError(f"groups name nodes that are not in the problem: {unknown[:5]}")
    merged: dict[str, list[float]] = {}
    nodes: list[Node] = []
    for node_id in problem.order:    # a group sits where its first member was
        n = known[node_id]
        key = owner.get(node_id)
        if key is None:
            nodes.append(n)
            continue
        if key not in merged:
            merged[key] = [0.0, 0.0, 0.0, 0.0]
            nodes.append(Node(key, 0.0, 0.0))
        for i, v in enumerate((n.fwd_s, n.bwd_s, n.param_bytes, n.act_bytes)):
            merged[key][i] += v
    nodes = [Node(n.id, *merged[n.id]) if n.id in merged else n for n in nodes]
    sends: dict[tuple[str, str], float] = {}   # (original source, contracted destination) -> bytes
    for e in problem.edges:
        dst = owner.get(e.dst, e.dst)
        if owner.get(e.src, e.src) != dst:
            sends[(e.src, dst)] = max(sends.get((e.src, dst), 0.0), e.bytes)
    carried: dict[tuple[str, str], float] = {}
    for (src, dst), nbytes in sends.items():
        key = (owner.get(src, src), dst)
        carried[key] = carried.get(key, 0.0) + nbytes
    edges = [Edge(src, dst, nbytes) for (src, dst), nbytes in carried.items()]
    return Problem(nodes=nodes, edges=edges, devices=list(problem.devices), bandwidth_Bps=problem.bandwidth_Bps,
                   latency_s=problem.latency_s, micro_batches=problem.micro_batches, schedule=problem.schedule,
                   stages=problem.stages, optimizer_state_factor=problem.optimizer_state_factor, name=problem.name,
                   max_replicas=problem.max_replicas, recompute=problem.recompute)


def expand(problem: Problem, solution: Solution, groups: dict[str, list[str]]) -> Solution:
    """A solution of ``contract(problem, groups)`` as one of ``problem``: each group's node replaced by its
    members, every stage's nodes in ``problem``'s order."""
    members = {group_id(label): list(nodes) for label, nodes in groups.items()}
    position = {n: i for i, n in enumerate(problem.order)}
    stages = [Stage(sorted((m for n in st.nodes for m in members.get(n, [n])), key=position.__getitem__),
                    list(st.devices)) for st in solution.stages]
    return Solution(stages, dict(solution.predicted), dict(solution.solver))


def solve_together(problem: Problem, groups: dict[str, list[str]],
                   solve: Callable[[Problem], Solution]) -> Solution:
    """The best plan ``solve`` finds for ``problem`` with each group in one stage, scored on ``problem``."""
    started = time.perf_counter()
    found = solve(contract(problem, groups))
    solution = expand(problem, found, groups)
    solution.predicted = score(problem, solution).as_predicted()
    exact_over = f"{found.solver.get('exact_over', found.solver.get('method', 'the solver'))}, each of " \
                 f"{len(groups)} groups of nodes kept in one stage"
    return certify(problem, solution, method=str(found.solver.get("method", "?")), started=started,
                   exact_over=exact_over, covers_reference=False,
                   space_optimal=bool(found.solver.get("space_optimal", found.solver.get("optimal", False))))
