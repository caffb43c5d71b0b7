"""Which nodes of a pipeline's stage graphs run on sequence shards under sequence parallelism
(:func:`sequence_sharded`), for :mod:`fxpipe.distributed.parallel.sequence`, which applies it: the position-wise
operations (element-wise functions, norms over the last dimension, dropout, casts) whose output has the sequence at
dim 1, reached from a row-wise layer's partial sums or from a sharded value an earlier stage sent."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxpipe.distributed.parallel.local_shapes import _VIEWS, _name, _shape, _val   # the same reading of a node
from fxpipe.distributed.parallel.tp_plans import TPPlanError

__all__ = ["SEQ_DIM", "SequenceSharding", "sequence_sharded"]

SEQ_DIM = 1

_SAME = {"_to_copy", "to", "clone", "contiguous", "alias", "detach", "type_as", "dropout", "native_dropout",
         "float", "half", "bfloat16", "feature_dropout", "alpha_dropout"}
_NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std"}
CHECKS = {"_assert_tensor_metadata"}
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


class Classifier:
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


def partial_nodes(gm: fx.GraphModule, rowwise: set[str]) -> set[fx.Node]:
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
        partial = partial_nodes(gm, rowwise)
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
        sharded = _region(gm, Classifier(gm, length), partial_nodes(gm, rowwise), crossing)
        out.sharded.append({n.name for n in sharded})
        output = next(n for n in gm.graph.nodes if n.op == "output")
        crossing |= {n.name for n in output.all_input_nodes if n in sharded}
    return out


def _region(gm: fx.GraphModule, facts: Classifier, partial: set[fx.Node], crossing: set[str]) -> set[fx.Node]:
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
