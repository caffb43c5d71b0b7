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
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fxpipe.distributed.parallel.local_shapes import _VIEWS, _name, _shape, _val   # the same reading of a node
from fxpipe.distributed.parallel.tp_plans import TPPlanError

__all__ = ["SEQ_DIM", "SequenceSharding", "apply_sequence_parallel", "partial_styles", "read_parameters",
           "sequence_sharded"]

SEQ_DIM = 1

_SAME = {"_to_copy", "to", "clone", "contiguous", "alias", "detach", "type_as", "dropout", "native_dropout",
         "float", "half", "bfloat16", "feature_dropout", "alpha_dropout"}
_NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std"}
_CHECKS = {"_assert_tensor_metadata"}
# a torch.fx trace: functions, methods and modules that act on each position alone
_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add, torch.sub,
              torch.mul, torch.div, torch.neg, torch.tanh, torch.sigmoid, torch.rsqrt, torch.pow, torch.exp,
              F.gelu, F.silu, F.relu, F.dropout, torch.relu}
_METHODS = {"add", "sub", "mul", "div", "neg", "pow", "rsqrt", "tanh", "sigmoid", "exp", "to", "float", "half",
            "bfloat16", "type_as", "contiguous", "clone"}
_MODULES = (nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)
_NORM_MODULES = (nn.LayerNorm, nn.RMSNorm)


@dataclass
class SequenceSharding:
    """Which nodes of each stage graph run on sequence shards (by name), and the sequence length sharded."""

    length: int = 0
    sharded: list[set[str]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return any(self.sharded)


def _has_sequence(shape: tuple | None, length: int) -> bool:
    return shape is not None and len(shape) > SEQ_DIM and _is(shape[SEQ_DIM], length)


def _is(size: Any, value: int) -> bool:
    """A recorded size that is the int ``value`` (a symbolic size is not compared: no guard is made)."""
    return isinstance(size, int) and size == value


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if _shape(a) is not None]


def _trailing(dims: Any, ndim: int) -> bool:
    """Whether a reduction over ``dims`` leaves dims ``0..SEQ_DIM`` alone."""
    if dims is None:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    return bool(dims) and all(isinstance(d, int) and d % ndim > SEQ_DIM for d in dims)


def _kind(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """``"pointwise"``, ``"norm"`` (its normalized trailing dims checked), ``"reduce"`` (dims checked) or
    ``None`` (not position-wise)."""
    if node.op == "call_function":
        name = _name(node)
        if isinstance(node.target, torch._ops.OpOverload):
            if torch.Tag.pointwise in node.target.tags or name in _SAME:
                return "pointwise"
            if name in _NORMS:
                return "norm"
            if name in _REDUCTIONS:
                return "reduce"
            return None
        if node.target in _FUNCTIONS:
            return "pointwise"
        if node.target is F.layer_norm:
            return "norm"
        return None
    if node.op == "call_method":
        return "pointwise" if node.target in _METHODS else ("reduce" if node.target in ("mean", "sum") else None)
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, _MODULES):
            return "pointwise"
        if isinstance(module, _NORM_MODULES):
            return "norm"
    return None


def _norm_ok(node: fx.Node, gm: fx.GraphModule, ndim: int) -> bool:
    if node.op == "call_module":
        shape = gm.get_submodule(node.target).normalized_shape
    else:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
    if isinstance(shape, int):
        shape = (shape,)
    return isinstance(shape, (list, tuple)) and ndim - len(shape) > SEQ_DIM


def _reduce_ok(node: fx.Node, ndim: int) -> bool:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return _trailing(dims, ndim)


class _Classifier:
    """The static facts of one stage graph: which nodes may run on sequence shards and their sequence inputs."""

    def __init__(self, gm: fx.GraphModule, length: int) -> None:
        self.gm, self.length = gm, length
        self.eligible: dict[fx.Node, list[fx.Node]] = {}   # node -> its inputs that carry the sequence
        for node in gm.graph.nodes:
            seq = self._sequence_inputs(node)
            if seq is not None:
                self.eligible[node] = seq

    def _sequence_inputs(self, node: fx.Node) -> list[fx.Node] | None:
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            ok = src in self.eligible and _has_sequence(_shape(node), self.length)
            return [src] if ok else None
        kind = _kind(node, self.gm)
        val = _val(node)
        if kind is None:
            return None
        outs = list(val) if isinstance(val, (tuple, list)) else [val]
        shapes = [tuple(v.shape) for v in outs if hasattr(v, "shape")]
        if not shapes or not all(_has_sequence(s, self.length) for s in shapes):
            return None
        ndim = len(shapes[0])
        if kind == "norm" and not _norm_ok(node, self.gm, ndim):
            return None
        if kind == "reduce" and not _reduce_ok(node, ndim):
            return None
        seq = []
        for x in _tensor_inputs(node):
            shape = _shape(x)
            if len(shape) > ndim:
                return None
            at = SEQ_DIM - (ndim - len(shape))   # the input's dim aligned with the output's sequence dim
            if at < 0 or _is(shape[at], 1):
                continue   # broadcast along the sequence
            if at != SEQ_DIM or shape[at] != self.length:
                return None
            seq.append(x)
        if kind in ("norm", "reduce") and (not seq or seq[0] is not node.args[0]):
            return None
        return seq or None


def _partial_nodes(gm: fx.GraphModule, rowwise: set[str]) -> set[fx.Node]:
    """The row-wise layers' outputs (partial sums under sequence parallelism) and the views of them."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in rowwise:
            found.add(node)
        elif node.op == "call_function" and _name(node) in _VIEWS and node.args and node.args[0] in found:
            found.add(node)
    return found


def _sequence_length(graphs: Sequence[fx.GraphModule], rowwise: set[str]) -> int | None:
    """The sequence length: dim 1 of the first ``(batch, sequence, ...)`` value a row-wise layer's output is viewed
    as (its ``Conv1D`` output is flat) that a position-wise operation reads."""
    for gm in graphs:
        partial = _partial_nodes(gm, rowwise)
        for node in gm.graph.nodes:
            if node.op == "output" or _kind(node, gm) is None:
                continue
            for x in node.all_input_nodes:
                shape = _shape(x)
                out = _shape(node)
                if x in partial and shape is not None and len(shape) > SEQ_DIM + 1 and \
                        isinstance(shape[SEQ_DIM], int) and out is not None and len(out) == len(shape):
                    return shape[SEQ_DIM]
    return None


def sequence_sharded(graphs: Sequence[fx.GraphModule], rowwise: Iterable[str], tp: int) -> SequenceSharding:
    """Which nodes of ``graphs`` (every stage of the plan, in pipeline order, their tensor-parallel layers called as
    modules) run on sequence shards (module docstring). :class:`TPPlanError` where the sequence does not divide by
    ``tp``. Changes nothing."""
    rowwise = set(rowwise)
    fx_graphs = [gm if isinstance(gm, fx.GraphModule) else None for gm in graphs]
    length = _sequence_length([g for g in fx_graphs if g is not None], rowwise)
    if length is None:
        return SequenceSharding(0, [set() for _ in graphs])
    if length % tp:
        raise TPPlanError(f"sequence parallelism shards the sequence ({length} tokens) over tp={tp} ranks, which does "
                          f"not divide it: pad the sequences to a multiple of {tp}, or turn sequence parallelism off "
                          "(mesh '...,sp=0')")
    out = SequenceSharding(length, [])
    crossing: set[str] = set()   # names of sharded values sent by earlier stages
    made: dict[str, Any] = {}    # each value's recorded shape, by name: a received value's placeholder has none
    for k, gm in enumerate(fx_graphs):
        if gm is None:
            out.sharded.append(set())
            continue
        for node in gm.graph.nodes:
            if node.op == "placeholder" and _val(node) is None and node.name in made:
                node.meta["val"] = made[node.name]
            elif _val(node) is not None:
                made.setdefault(node.name, _val(node))
        sharded = _region(gm, _Classifier(gm, length), _partial_nodes(gm, rowwise), crossing)
        out.sharded.append({n.name for n in sharded})
        output = next(n for n in gm.graph.nodes if n.op == "output")
        crossing |= {n.name for n in output.all_input_nodes if n in sharded}
    return out


def _region(gm: fx.GraphModule, facts: _Classifier, partial: set[fx.Node], crossing: set[str]) -> set[fx.Node]:
    """The nodes of ``gm`` that run sharded: seeded by the position-wise readers of partial sums and by the
    sharded values received, grown to the position-wise users, and to the position-wise inputs all of whose
    users run sharded."""
    sharded = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in crossing}
    sharded |= {n for n, seq in facts.eligible.items() if any(x in partial for x in seq)}
    todo = list(sharded)
    while todo:
        node = todo.pop()
        grown = [u for u in node.users if u not in sharded and node in facts.eligible.get(u, ())]
        for x in facts.eligible.get(node, ()):
            if x not in sharded and x in facts.eligible and all(u in facts.eligible for u in x.users):
                grown.append(x)
        for n in grown:
            if n.op == "call_function" and n.target is operator.getitem and n.args[0] not in sharded:
                continue   # one output of a tuple: only with the operation that makes it
            if n not in sharded:
                sharded.add(n)
                todo.append(n)
    return sharded


# -- the edges' redistributions --------------------------------------------------------------------------------------
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
    partial = _partial_nodes(gm, rowwise)
    if not sharded and not partial:
        return
    facts = _Classifier(gm, length)
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
    inputs, or the parameters of a module they call. Each tp rank holds the gradient of its tokens only."""
    out = set()
    for node in gm.graph.nodes:
        if node.name not in names:
            continue
        out |= {x.target for x in node.all_input_nodes if x.op == "get_attr"}
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
        if user.op == "call_function" and _name(user) in _CHECKS:
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
