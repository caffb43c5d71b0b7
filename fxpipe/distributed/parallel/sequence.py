"""Sequence parallelism on traced pipeline stages: the activations between tensor-parallel blocks sharded by
sequence over the ``tp`` ranks (Megatron-LM's sequence parallelism, Korthikanti et al. 2022; torchtitan's plans).

With tensor parallelism alone every tp rank holds the whole residual stream (the norms, the residual adds, the
dropouts, what crosses a stage boundary) and runs it redundantly. Sequence parallelism shards those position-wise
operations along the sequence (dim 1 of a ``(batch, sequence, ...)`` value): each tp rank runs them on ``1 / tp``
of the tokens, the stage boundaries carry ``1 / tp`` of the bytes, and the row-wise layers' all-reduce becomes a
reduce-scatter into the sequence shards, the column-wise layers' input an all-gather of them (backward: the
reverse), the same bytes on a ring.

How it is applied (torch's own DTensor redistributions, on the stage graph)
---------------------------------------------------------------------------
torchtitan writes its plan per module: ``SequenceParallel()`` on the norms, ``PrepareModuleInput`` at a block's
edge, ``RowwiseParallel(output_layouts=Shard(1))``, ``ColwiseParallel(input_layouts=Shard(1))``. A traced stage
does not call its norms, residual adds and dropouts as modules (``torch.export`` records ``aten.pow``/``mean``/
``rsqrt``/``mul`` for an RMS norm), and a layer's input or output may be a flattened ``(batch * sequence, ...)``
view (GPT-2's ``Conv1D``), on which ``Shard(1)`` would shard the features. So the same redistributions are put on
the graph's edges instead, where the value has its ``(batch, sequence, ...)`` shape:

1. :func:`sequence_sharded` finds, over every stage of the plan in pipeline order, the nodes that run on
   sequence shards: the *position-wise* operations (point-wise ATen operations, dtype conversions, dropout,
   layer/RMS norms and reductions over the trailing dimensions only; the modules and functions of a torch.fx
   trace alike) whose output has the sequence at dim 1, connected to a row-wise layer's output (or to a sharded
   value a previous stage sent); an operation's inputs are taken in where every user of theirs runs sharded too.
   Anything else (a view, attention, a non-tensor-parallel linear layer such as an LM head, the loss) is not
   position-wise and runs on whole tensors.
2. :func:`apply_sequence_parallel` then makes the row-wise layers keep their output a partial-sum ``DTensor``
   (``RowwiseParallel(output_layouts=Partial(), use_local_output=False)``, through views), and puts a small
   module on each edge: partial sums entering the sharded region are reduce-scattered into sequence shards
   (``redistribute(Shard(1))``), whole values entering it are cut to this rank's shard (backward: all-gathered),
   sharded values leaving it are all-gathered (``redistribute(Replicate())``; a ``DTensor`` where the value only
   feeds column-wise layers, whose input gradient, a partial sum, is then reduce-scattered back; a plain tensor
   otherwise, whose gradient is the same on every tp rank and is cut), partial sums leaving as whole values are
   all-reduced (the row-wise default). A stage's sharded outputs cross the boundary sharded, except the last
   stage's (the loss reads whole values).

The parameters the sharded region reads (the norms' weights and biases) get from each tp rank the gradient of its
tokens only: they are summed over the tp ranks once a step (as Megatron-LM's ``allreduce_sequence_parallel_grads``
does), with the per-head norms' (:func:`fxpipe.distributed.parallel.tp.sum_partial_grads`).

Needs: the sequence length (dim 1 of the row-wise layers' ``(batch, sequence, ...)`` outputs, a recorded int)
divisible by ``tp``, else :class:`~fxpipe.distributed.parallel.tp_plans.TPPlanError` names the fix. Dropout on
sequence shards draws other random numbers than one process does (as in Megatron-LM and torchtitan): exact
against one process only without dropout. Where no such region is found (no row-wise layer; a graph without
recorded shapes) nothing changes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fxpipe.distributed.parallel.local_shapes import _VIEWS, _name
from fxpipe.frontend.precision import read_attribute
from fxpipe.distributed.parallel.sequence_region import (CHECKS, SEQ_DIM, SequenceSharding, Classifier,
                                                         partial_nodes, sequence_sharded)

__all__ = ["SEQ_DIM", "SequenceSharding", "apply_sequence_parallel", "partial_styles", "read_parameters",
           "sequence_sharded"]


class ToSequenceShards(nn.Module):
    """A value entering the sharded region: a partial sum (``DTensor``) reduce-scattered, a whole tensor cut to
    this rank's shard (its gradient all-gathered back)."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: Any) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, (Replicate(),), run_check=False)
        return x.redistribute(self.mesh, (Shard(SEQ_DIM),)).to_local()


class FromSequenceShards(nn.Module):
    """A sharded value leaving the region, all-gathered: a ``DTensor`` when only column-wise layers read it (their
    partial input gradient is reduce-scattered back), else a plain tensor (its gradient, the same on every tp rank,
    is cut to this rank's shard)."""

    def __init__(self, mesh: Any, keep_dtensor: bool) -> None:
        super().__init__()
        self.mesh, self.keep_dtensor = mesh, keep_dtensor

    def forward(self, x: torch.Tensor) -> Any:
        whole = DTensor.from_local(x, self.mesh, (Shard(SEQ_DIM),), run_check=False).redistribute(
            self.mesh, (Replicate(),))
        return whole if self.keep_dtensor else whole.to_local()


class Summed(nn.Module):
    """A row-wise layer's partial sums read as a whole value: all-reduced (tensor parallelism's default)."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: Any) -> torch.Tensor:
        return x.redistribute(self.mesh, (Replicate(),)).to_local() if isinstance(x, DTensor) else x


def partial_styles(styles: dict[str, Any], rowwise: set[str]) -> dict[str, Any]:
    """``styles`` with each row-wise layer's output kept a partial-sum ``DTensor`` (its reduction is the graph's)."""
    out = dict(styles)
    for path in rowwise & set(styles):
        style = copy.copy(styles[path])
        style.output_layouts, style.use_local_output = (Partial(),), False
        out[path] = style
    return out


def _only_colwise(node: fx.Node, colwise: set[str], gm: fx.GraphModule) -> bool:
    """Whether every use of ``node``'s value, through views, is a column-wise layer's input."""
    for user in node.users:
        if user.op == "call_module" and user.target in colwise:
            continue
        if user.op == "call_function" and _name(user) in _VIEWS and user.args[0] is node and \
                _only_colwise(user, colwise, gm):
            continue
        return False
    return bool(node.users)


def apply_sequence_parallel(gm: fx.GraphModule, names: set[str], length: int, colwise: set[str],
                            rowwise: set[str], tp: int, mesh: Any, last: bool) -> None:
    """Put the redistributions on ``gm``'s edges (module docstring) for its sharded nodes ``names``
    (:func:`sequence_sharded`, of ``length`` tokens); ``last``: the pipeline's last stage (its outputs leave
    whole). Its row-wise layers must already output partial sums (:func:`partial_styles`)."""
    sharded = {n for n in gm.graph.nodes if n.name in names}
    partial = partial_nodes(gm, rowwise)
    if not sharded and not partial:
        return
    facts = Classifier(gm, length)
    made: dict[tuple[fx.Node, str], fx.Node] = {}

    def convert(value: fx.Node, kind: str, module: nn.Module) -> fx.Node:
        if (value, kind) not in made:
            path = f"fxpipe_sp_{kind}_{value.name}"
            gm.add_submodule(path, module)
            with gm.graph.inserting_after(value):
                made[value, kind] = gm.graph.call_module(path, (value,))
        return made[value, kind]

    for node in list(gm.graph.nodes):   # values entering the region: reduce-scattered or cut
        for x in facts.eligible.get(node, ()) if node in sharded else ():
            if x not in sharded:
                node.replace_input_with(x, convert(x, "shard", ToSequenceShards(mesh)))
    for node in list(gm.graph.nodes):
        if node in sharded:   # values leaving it: gathered
            _leave(gm, node, sharded, colwise, tp, mesh, last, convert)
        elif node in partial:   # partial sums read whole: all-reduced
            for user in list(node.users):
                if user not in partial and not _made(user):
                    user.replace_input_with(node, convert(node, "sum", Summed(mesh)))
    gm.graph.lint()
    gm.recompile()


def _made(node: fx.Node) -> bool:
    return node.op == "call_module" and str(node.target).startswith("fxpipe_sp_")


def read_parameters(gm: fx.GraphModule, names: set[str]) -> set[str]:
    """The targets of the parameters (and buffers) that the sharded nodes ``names`` of ``gm`` read: ``get_attr``
    inputs (or their bfloat16 compute copies under ``"bf16-mixed"``), or the parameters of a module they call. Each
    tp rank holds the gradient of its tokens only."""
    out = set()
    for node in gm.graph.nodes:
        if node.name not in names:
            continue
        out |= {read.target for x in node.all_input_nodes if (read := read_attribute(x)) is not None}
        if node.op == "call_module":
            out |= {f"{node.target}.{n}" for n, _ in gm.get_submodule(node.target).named_parameters()}
    return out


def _leave(gm: fx.GraphModule, node: fx.Node, sharded: set[fx.Node], colwise: set[str], tp: int, mesh: Any,
           last: bool, convert: Any) -> None:
    """The edges from sharded ``node`` to readers outside the region: gathered (or, for checks, made local)."""
    readers = []
    for user in [u for u in node.users if u not in sharded and not _made(u)]:
        if user.op == "output" and not last:
            continue   # sent sharded: the next stage receives its shard
        if user.op == "call_function" and _name(user) in CHECKS:
            size = user.kwargs.get("size")
            if size is not None:   # the check's recorded size made local
                size = list(size)
                size[SEQ_DIM] = size[SEQ_DIM] // tp
                user.kwargs = {**user.kwargs, "size": size, "stride": None}
            continue
        readers.append(user)
    if not readers:
        return
    keep = all((u.op == "call_module" and u.target in colwise) or
               (u.op == "call_function" and _name(u) in _VIEWS and _only_colwise(u, colwise, gm)) for u in readers)
    gathered = convert(node, "gather", FromSequenceShards(mesh, keep))
    for user in readers:
        user.replace_input_with(node, gathered)
