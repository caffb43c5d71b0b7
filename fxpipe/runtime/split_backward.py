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

When a frontier's parameter side is shared with a later frontier (a computed
weight used twice), re-running it would revisit the input path; such a stage,
and a checkpointed one (whose recomputation cannot be replayed twice), does its
full backward in the first pass and nothing in the second (``deferred`` is
``False``); gradients are the same either way.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightPass", "backward_inputs", "full_backward"]


class WeightPass:
    """The deferred weight-gradient work of one stage and micro-batch; :meth:`run` it once."""

    def __init__(self, frontier: list[tuple[Node, list[Any], list[GradientEdge]]],
                 roots: list[tuple[Any, torch.Tensor]], params: list[torch.Tensor], deferred: bool) -> None:
        self._frontier, self._roots, self._params, self.deferred = frontier, roots, params, deferred

    def run(self) -> None:
        params = [p for p in self._params if p.requires_grad]
        if self._roots and params:
            torch.autograd.backward([r for r, _ in self._roots], [g for _, g in self._roots], inputs=params)
        for node, received, children in self._frontier:   # one frontier at a time: one weight gradient alive
            outputs = [(GradientEdge(node, k), g) for k, g in enumerate(received) if g is not None]
            if not outputs or not params:
                continue
            got = torch.autograd.grad([o for o, _ in outputs], children, [g for _, g in outputs],
                                      allow_unused=True, materialize_grads=False)
            edges = [(c, g) for c, g in zip(children, got) if g is not None]
            del got
            if edges:
                torch.autograd.backward([c for c, _ in edges], [g for _, g in edges], inputs=params)
        self._frontier, self._roots = [], []


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
    return WeightPass([], [], [], deferred=False)


def backward_inputs(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> WeightPass:
    """Accumulate the gradients of ``inputs`` (leaves) now; return the pass that fills ``params``' ``.grad``."""
    inputs = [t for t in inputs if t.requires_grad]
    params = [p for p in params if p.requires_grad]
    if not roots:
        return WeightPass([], [], [], deferred=True)
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    param_nodes = {get_gradient_edge(p).node for p in params}
    root_nodes = [get_gradient_edge(r).node for r in roots]
    on_path = _reach(root_nodes, input_nodes)
    feeds_params = _reach(root_nodes, param_nodes)
    frontier: list[tuple[Node, list[GradientEdge]]] = []
    owner: dict[Node, Node] = {}
    for node, path in on_path.items():
        if not path or node in input_nodes:
            continue
        children = [GradientEdge(c, slot) for c, slot in _children(node) if not on_path[c] and feeds_params[c]]
        for edge in children:
            if owner.setdefault(edge.node, node) is not node:
                return full_backward(roots, grads)     # parameter side shared by two frontiers
        if children:
            frontier.append((node, children))
    received: dict[Node, list[Any]] = {}
    handles = [node.register_prehook(lambda g, n=node: received.__setitem__(n, list(g))) for node, _ in frontier]
    try:
        path_roots = [(r, g) for r, n, g in zip(roots, root_nodes, grads) if on_path[n]]
        if path_roots and inputs:
            got = torch.autograd.grad([r for r, _ in path_roots], inputs, [g for _, g in path_roots],
                                      retain_graph=True, allow_unused=True)
            for leaf, g in zip(inputs, got):
                if g is not None:
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
    finally:
        for handle in handles:
            handle.remove()
    other_roots = [(r, g) for r, n, g in zip(roots, root_nodes, grads) if not on_path[n] and feeds_params[n]]
    return WeightPass([(node, received.get(node, []), children) for node, children in frontier],
                      other_roots, params, deferred=True)
