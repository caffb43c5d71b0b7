"""The loss a model computes itself (``model(ids, labels=labels).loss``), made exact across micro-batches.

A Hugging Face model given ``labels`` returns ``cross_entropy(logits, labels, ignore_index=-100)`` (shifted by
one for a causal LM): a mean over the batch's counted tokens. Run per micro-batch, each micro-batch's mean
has its own denominator, and no weighting of those means gives the whole batch's loss or gradients when
padding spreads the counted tokens unevenly (transformers fixed the same bug in its gradient accumulation
with ``num_items_in_batch``). This module rewrites the captured graph so that it stays exact:

- the loss leaf's operation (``aten.cross_entropy_loss``, ``aten.nll_loss``, ``aten.nll_loss_nd`` with
  ``reduction=mean``) is set to ``reduction=sum``: each micro-batch returns its loss summed over its tokens;
- the targets that operation reads are computed from the graph's inputs alone (labels, padded and shifted
  by the model's own code), so :class:`ModelLoss` keeps that computation as a small graph of its own and
  counts, per micro-batch, what the mean would have divided by (the targets that are not ``ignore_index``,
  or the sum of their class weights).

The pipeline then trains with ``reduction="token"`` (:mod:`fxpipe.runtime.losses.losses`: the sums backpropagated,
the gradients divided once by the whole batch's count) and reports ``sum / count`` as the loss: the full
batch's own mean, exactly. A loss computed otherwise (a mean of another operation, a sum of losses, targets
that depend on the model's values) is left as it is and the graph is marked with why
(:data:`UNCOMBINED`); training on it without a ``loss_fn`` is refused with that reason.

Using the model's ``num_items_in_batch`` keyword instead would need every model to accept it (T5 and BERT
compute their loss without it) and fxpipe to know how each model shifts its labels; reading the graph needs
neither, and it works the same under ``fxpipe.compile``, ``fxpipe.plan`` and the ranks, which all capture
through :func:`fxpipe.frontend.capture.capture`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["MODEL_LOSS", "UNCOMBINED", "ModelLoss", "split_model_loss"]

MODEL_LOSS = "fxpipe_model_loss"     # gm.meta: the ModelLoss of a rewritten graph
UNCOMBINED = "fxpipe_model_loss_uncombined"   # gm.meta: why a 0-dim output could not be made exact

_aten = torch.ops.aten
# operation -> (position of weight, of reduction, of ignore_index) in its arguments
_LOSS_OPS = {
    _aten.cross_entropy_loss.default: (2, 3, 4),
    _aten.nll_loss.default: (2, 3, 4),
    _aten.nll_loss_nd.default: (2, 3, 4),
}
_MEAN, _SUM = 1, 2
_DEFAULTS = {2: None, 3: _MEAN, 4: -100}


def _arg(node: fx.Node, position: int, name: str) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, _DEFAULTS[position])


@dataclass
class ModelLoss:
    """Where a rewritten graph's loss is and how to count what its micro-batches' sums are divided by."""

    leaf: int                 # the output leaf holding the loss: each micro-batch's sum
    targets: fx.GraphModule   # the graph's inputs (its placeholders, in order) -> the targets the loss reads
    ignore_index: int
    weight: str | None        # the get_attr target of the class weights, if any
    owner: fx.GraphModule     # the graph the weights live in

    def count(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The number of counted targets (or the sum of their class weights) of one micro-batch, from its inputs
        by placeholder name."""
        args = [inputs[n.name] for n in self.targets.graph.nodes if n.op == "placeholder"]
        with torch.no_grad():
            target = self.targets(*args)
            kept = target != self.ignore_index
            if self.weight is None:
                return kept.sum()
            weight = functools.reduce(getattr, self.weight.split("."), self.owner)   # as the get_attr node reads it
            return torch.where(kept, weight.to(target.device)[target.clamp(min=0)], 0).sum()


def _inputs_only(target: fx.Node) -> tuple[list[fx.Node], str | None]:
    """The nodes ``target`` is computed from, in graph order, when that is from the graph's inputs alone (no
    parameter, no randomness); else why not."""
    seen: set[fx.Node] = set()
    stack = [target]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr":
            return [], f"its targets are computed from the model's tensor {node.target!r}"
        if node.op == "call_module":
            return [], f"its targets are computed by the module {node.target!r}"
        if node.op == "call_function" and ("dropout" in str(node.target) or "rand" in str(node.target)):
            return [], "its targets are computed with random numbers"
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(target.graph.nodes)}
    return sorted(seen, key=order.__getitem__), None


def _targets_graph(gm: fx.GraphModule, nodes: list[fx.Node], target: fx.Node) -> fx.GraphModule:
    """A graph of every placeholder of ``gm`` (so it is called as ``gm`` is) computing ``target``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node)
    for node in nodes:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[target])
    return fx.GraphModule(torch.nn.Module(), graph)


def split_model_loss(gm: fx.GraphModule) -> None:
    """Rewrite ``gm`` (a flat graph from the torch.export front end) in place when one of its outputs is a
    0-dim loss of a mean reduction (module doc): ``gm.meta[MODEL_LOSS]`` then holds the :class:`ModelLoss`.
    A 0-dim output that cannot be rewritten is left as it is, with the reason in ``gm.meta[UNCOMBINED]``."""
    if gm.meta.get("fxpipe_out_spec") is None:
        return
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = output.args[0]
    leaves = list(leaves) if isinstance(leaves, (tuple, list)) else [leaves]
    for i, leaf in enumerate(leaves):
        value = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            continue
        if MODEL_LOSS in gm.meta:
            gm.meta[UNCOMBINED] = f"output leaf {i} is a second 0-dim value beside the loss"
            continue
        why = _rewrite(gm, leaf, i)
        if why is not None:
            gm.meta[UNCOMBINED] = f"output leaf {i} ({leaf.target}): {why}"
    if MODEL_LOSS in gm.meta:
        gm.recompile()


def _rewrite(gm: fx.GraphModule, leaf: fx.Node, index: int) -> str | None:
    if leaf.op != "call_function" or leaf.target not in _LOSS_OPS:
        return (f"it is computed by {leaf.target}, not by a cross-entropy or NLL loss averaged over its targets "
                "(a weighted sum of losses, another loss), whose micro-batches fxpipe cannot combine exactly")
    at_weight, at_reduction, at_ignore = _LOSS_OPS[leaf.target]
    if _arg(leaf, at_reduction, "reduction") != _MEAN:
        return "its reduction is not a mean"
    target = leaf.args[1]
    value = target.meta.get("val") if isinstance(target, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.is_floating_point():
        return "its targets are class probabilities, not class indices"
    weight = _arg(leaf, at_weight, "weight")
    if weight is not None and (not isinstance(weight, fx.Node) or weight.op != "get_attr"):
        return "its class weights are computed in the graph"
    nodes, why = _inputs_only(target)
    if why is not None:
        return why
    names = {at_weight: "weight", at_reduction: "reduction", at_ignore: "ignore_index"}
    args = list(leaf.args[:2]) + [_arg(leaf, p, names[p]) for p in range(2, at_ignore + 1)] + list(leaf.args[at_ignore + 1:])
    args[at_reduction] = _SUM
    leaf.args = tuple(args)
    leaf.kwargs = {k: v for k, v in leaf.kwargs.items() if k not in names.values()}
    gm.meta[MODEL_LOSS] = ModelLoss(index, _targets_graph(gm, nodes, target), int(args[at_ignore]),
                                    None if weight is None else weight.target, gm)
    return None
