"""A stage's backward split in two: input gradients now, weight gradients later (zero-bubble schedules).

:func:`backward_inputs` runs ``torch.autograd.grad`` from the stage's outputs to
its input leaves only. Autograd then skips every computation that leads only to
parameters: the weight-gradient matmul of a linear layer, the weight part of a
convolution's backward, whole branches that touch no input. On the way it
records the gradient arriving at each *frontier* node: a node on the path to
the inputs that also feeds parameters. The returned :class:`WeightPass` later
runs, frontier by frontier, (1) the node again asking only for its
parameter-side edges and (2) a backward from those edges into the parameters'
``.grad`` (outputs that do not depend on the inputs at all go straight to (2)).
Together they compute exactly what one full backward computes, each operation
once; one frontier at a time keeps a single weight gradient in flight.

torch.distributed.pipelining has the same idea in private functions
(``_backward.stage_backward_input/weight``) that change between releases and
fall back to a full backward when the stage's inputs need no gradient; this
one also covers that case (the first stage defers its whole backward).

A frontier's parameter side may be shared with another's at any depth (a
computed weight ``w = tanh(p)`` read by two matmuls, directly or through ``w.t()``
and ``w * 3``; a T5 relative-position bias added in every layer; a value both
returned and used), and with the outputs that do not depend on the inputs. A
backward through a node frees what it saved, so such parts cannot run once per
frontier: :func:`backward_inputs` walks every parameter-side subgraph and puts
the frontiers (and outputs) that meet anywhere below into one group, whose
weight pass is one backward from all their edges; each node still runs once.
Only a parameter's own leaf may be met by several groups: accumulating into
``.grad`` saves nothing. A frontier whose parameter side is also reached from a
frontier *below* it on the input path (a module applied twice in a row) cannot be
asked for its own share alone (autograd sums every path), so such a stage does its
whole backward at once (:func:`_reached_from_below`). A checkpointed micro-batch splits too: checkpoint's
own recomputation cannot serve two passes, so its forward saves nothing and the executor recomputes it by
hand just before the input pass (:func:`fxpipe.runtime.backward.recompute.forward_saving_nothing`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightPass", "backward_inputs", "full_backward", "leaf_nodes"]


_Frontier = tuple[Node, list[Any], list[GradientEdge]]   # node, gradients it received, its parameter-side edges


class WeightPass:
    """The deferred weight-gradient work of one stage and micro-batch; :meth:`run` it once.

    ``groups`` are the independent parts: each its frontiers and the outputs (with their gradients) whose
    parameter sides meet; one group at a time keeps only its own weight gradients in flight."""

    def __init__(self, groups: list[tuple[list[_Frontier], list[tuple[Any, torch.Tensor]]]],
                 params: list[torch.Tensor], deferred: bool) -> None:
        self._groups, self._params, self.deferred = groups, params, deferred

    def run(self) -> None:
        params = [p for p in self._params if p.requires_grad]
        for frontier, roots in self._groups if params else []:
            edges: dict[tuple[Node, int], tuple[Any, torch.Tensor]] = {}
            for node, received, children in frontier:   # the node again, for its parameter-side edges only
                outputs = [(GradientEdge(node, k), g) for k, g in enumerate(received) if g is not None]
                if not outputs:
                    continue
                got = torch.autograd.grad([o for o, _ in outputs], children, [g for _, g in outputs],
                                          allow_unused=True, materialize_grads=False)
                for edge, g in zip(children, got):   # an edge two frontiers share gets the sum
                    if g is not None:
                        key = (edge.node, edge.output_nr)
                        edges[key] = (edge, g if key not in edges else edges[key][1] + g)
            starts = list(roots) + list(edges.values())
            del edges
            if starts:   # one backward for the group: a shared part runs once, from its summed gradient
                torch.autograd.backward([s for s, _ in starts], [g for _, g in starts], inputs=params)
        self._groups = []


def _children(node: Node) -> list[tuple[Node, int]]:
    return [(child, slot) for child, slot in node.next_functions if child is not None]


def _reach(roots: list[Node], targets: set[Node]) -> dict[Node, bool]:
    """For every node below ``roots``: whether some path from it reaches ``targets`` (iterative post-order)."""
    reach: dict[Node, bool] = {}
    for root in roots:
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in reach:
                continue
            if expanded:
                reach[node] = node in targets or any(reach[c] for c, _ in _children(node))
                continue
            stack.append((node, True))
            stack += [(c, False) for c, _ in _children(node) if c not in reach]
    return reach


def full_backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> WeightPass:
    """One ordinary backward now (inputs and parameters); the weight pass does nothing."""
    if roots:
        torch.autograd.backward(list(roots), list(grads))
    return WeightPass([], [], deferred=False)


def leaf_nodes(tensors: Sequence[torch.Tensor]) -> set[Node]:
    """The autograd nodes (``AccumulateGrad``) of leaves that require grad. Finding one costs an operator (a view,
    inside ``get_gradient_edge``): a step finds its parameters' once per stage, not once per micro-batch; holding
    the nodes keeps them the ones every forward of the step uses."""
    return {get_gradient_edge(t).node for t in tensors if t.requires_grad}


def backward_inputs(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                    param_nodes: set[Node] | None = None) -> WeightPass:
    """Accumulate the gradients of ``inputs`` (leaves) now; return the pass that fills ``params``' ``.grad``.
    ``param_nodes`` are ``leaf_nodes(params)``, where the caller keeps them (default: found here)."""
    inputs = [t for t in inputs if t.requires_grad]
    params = [p for p in params if p.requires_grad]
    if not roots:
        return WeightPass([], [], deferred=True)
    input_nodes = leaf_nodes(inputs)
    param_nodes = leaf_nodes(params) if param_nodes is None else param_nodes
    root_nodes = [get_gradient_edge(r).node for r in roots]
    on_path = _reach(root_nodes, input_nodes)
    feeds_params = _reach(root_nodes, param_nodes)
    frontier: list[tuple[Node, list[GradientEdge]]] = []
    for node, path in on_path.items():
        if not path or node in input_nodes:
            continue
        children = [GradientEdge(c, slot) for c, slot in _children(node) if not on_path[c] and feeds_params[c]]
        if children:
            frontier.append((node, children))
    if _reached_from_below(frontier, on_path, feeds_params, param_nodes):
        return full_backward(roots, grads)
    received: dict[Node, list[Any]] = {}
    handles = [node.register_prehook(lambda g, n=node: received.__setitem__(n, list(g))) for node, _ in frontier]
    try:
        path_roots = [(r, g) for r, n, g in zip(roots, root_nodes, grads) if on_path[n]]
        if path_roots and inputs:
            got = torch.autograd.grad([r for r, _ in path_roots], inputs, [g for _, g in path_roots],
                                      retain_graph=True, allow_unused=True)
            onward = [(t, g) for t, g in zip(inputs, got) if g is not None and t.grad_fn is not None]
            for leaf, g in zip(inputs, got):
                if g is not None and leaf.grad_fn is None:
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
            if onward:   # the caller's own graph (a slice of an input that requires grad): continue into it
                torch.autograd.backward([t for t, _ in onward], [g for _, g in onward])
    finally:
        for handle in handles:
            handle.remove()
    other_roots = [(r, g) for r, n, g in zip(roots, root_nodes, grads) if not on_path[n] and feeds_params[n]]
    starts = [[edge.node for edge in children] for _, children in frontier]
    group = _meeting_groups(starts + [[get_gradient_edge(r).node for r, _ in other_roots]], feeds_params, param_nodes)
    groups: dict[int, tuple[list[_Frontier], list[tuple[Any, torch.Tensor]]]] = {}
    for u, (node, children) in enumerate(frontier):
        groups.setdefault(group[u], ([], []))[0].append((node, received.get(node, []), children))
    if other_roots:
        groups.setdefault(group[len(frontier)], ([], []))[1].extend(other_roots)
    return WeightPass(list(groups.values()), params, deferred=True)


def _reached_from_below(frontier: list[tuple[Node, list[GradientEdge]]], on_path: dict[Node, bool],
                        feeds_params: dict[Node, bool], param_nodes: set[Node]) -> bool:
    """Whether some frontier's parameter side is also reached from a frontier below it on the input path.

    The weight pass asks autograd for the gradient from a frontier node into its parameter-side edges, and
    autograd sums *every* path from that node: through the input path too (a module or parameter used
    twice in a row, ``linear(linear(x, w, b), w, b)``). Where such a second path exists, the weight pass
    would count the lower frontier's share twice (and run its node again), so the stage's backward is
    done whole instead; where none does (parameters shared by side-by-side branches), it stays split."""
    holders: dict[Node, set[int]] = {}   # a parameter-side node -> the frontiers whose side holds it
    for u, (_, children) in enumerate(frontier):
        seen: set[Node] = set()
        stack = [edge.node for edge in children]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            holders.setdefault(node, set()).add(u)
            if node not in param_nodes:
                stack += [c for c, _ in _children(node) if feeds_params.get(c, False)]
    position = {node: u for u, (node, _) in enumerate(frontier)}
    for u, (top, children) in enumerate(frontier):
        others = set().union(*(holders[edge.node] for edge in children)) - {u}
        if not others:   # no other frontier's side holds this one's direct children
            continue
        seen, stack = set(), [c for c, _ in _children(top) if on_path.get(c, False)]
        while stack:   # the input-path nodes below frontier u: is one of them such a frontier?
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if position.get(node) in others:
                return True
            stack += [c for c, _ in _children(node) if on_path.get(c, False)]
    return False


def _meeting_groups(starts: list[list[Node]], feeds_params: dict[Node, bool], leaves: set[Node]) -> list[int]:
    """For each unit (its parameter-side start nodes), a group id: units whose subgraphs share a node other
    than a parameter's leaf are in one group (union-find; every node is walked once, by its first unit)."""
    parent = list(range(len(starts)))

    def find(u: int) -> int:
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    owner: dict[Node, int] = {}
    for u, nodes in enumerate(starts):
        stack = [n for n in nodes if n not in leaves]
        while stack:
            node = stack.pop()
            if node in owner:   # met another unit's subgraph (or this one's again): its nodes below are owned
                a, b = find(owner[node]), find(u)
                parent[max(a, b)] = min(a, b)
                continue
            owner[node] = u
            stack += [c for c, _ in _children(node) if c not in leaves and feeds_params.get(c, False)]
    return [find(u) for u in range(len(starts))]
