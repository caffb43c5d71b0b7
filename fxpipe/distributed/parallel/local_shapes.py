"""A stage graph's recorded shape constants made local to one tensor-parallel rank, once, at setup.

Between a block's column-wise layers and its row-wise one, each tp rank holds a plain tensor of its own heads (or
features): the column-wise layer's local output. A traced graph recorded the model's shapes as constants there:
Llama's exported attention views ``q`` as ``(b, s, 4, 8)``, expands its key/value heads to ``(b, 2, 2, s, 8)`` and
reshapes to ``(b, 4, s, 8)``, the full head counts. :func:`local_sizes` walks the graph once, from each
column-wise layer's output to the row-wise layers' inputs, and follows which dimension of each value is sharded
(its ``meta["val"]`` holds the global shape): view-like operations by torch's own DTensor view rules
(``torch.distributed.tensor._ops._view_ops``: ``view_groups``, ``expand``, ``dim_transpose``, ... with
``propagate_shape_and_sharding``), point-wise operations by broadcasting, reductions over other dimensions than the
sharded one (a per-head norm, Qwen3's ``q_norm``/``k_norm``: the mean over each head's features), the attention
kernels on the head dim (1), GPT-2's ``split`` of a fused q/k/v output (below). Where a view or expand records the
sharded dimension's global size as an ``int``, it becomes the local one
(divided by ``tp``); sizes that are graph values (a symbolic batch) stay as they are. An operation it cannot follow
exactly (one that reduces, slices or splits the sharded dimension, or one it does not know) is refused naming the
operation, before any step runs.

A fused column-wise layer (:class:`~fxpipe.distributed.parallel.tp_plans.Conv1DFusedColwise`, GPT-2's ``c_attn``)
gives each rank ``[q_r, k_r, v_r]``: its value may pass through views that keep its sharded dimension whole
(``(b * s, 3 * n) -> (b, s, 3 * n)``) and then only be ``split`` / ``split_with_sizes`` on that dimension into its
parts at their full width (``split(n, dim=2)``), whose recorded size becomes ``n / tp``; each part is then an
ordinary local shard. Anything else done to a fused value (a view that splits or merges that dimension, a slice, a
split at other sizes, a row-wise layer) would read the parts' columns as one contiguous block: refused.

Nothing is done per step: the rewritten graph runs plain tensors, at the speed of
the unsharded model's operations on ``1/tp`` of the heads.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor._ops import _view_ops as views

from fxpipe.distributed.parallel.tp_plans import TPPlanError
from fxpipe.frontend.precision import read_attribute

__all__ = ["local_sizes", "localisation", "localise_shapes", "partial_parameters"]

_SAME_SHAPE = {"clone", "contiguous", "_to_copy", "alias", "detach", "dropout", "lift_fresh_copy", "type_as", "to",
               "float", "native_dropout"}
_VIEWS = {"view", "_unsafe_view", "reshape", "view_copy"}
_ATTENTION = "scaled_dot_product"
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "logsumexp", "var_mean", "prod"}
_CHECKS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}


def _name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return t
    packet = getattr(t, "overloadpacket", None)
    return getattr(packet if packet is not None else t, "__name__", str(t))


def _val(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("val", node.meta.get("tensor_meta"))


def _shape(node: Any) -> tuple | None:
    v = _val(node)
    return tuple(v.shape) if v is not None and hasattr(v, "shape") else None


def _refuse(node: fx.Node, why: str) -> TPPlanError:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    where = stack[-1][0] if stack else "the stage graph"
    return TPPlanError(f"tensor parallelism cannot run {node.format_node()} (in {where}) on one rank's share of the "
                       f"heads: {why}; pass tp_plan=... that leaves this block replicated")


def _size_arg(node: fx.Node) -> tuple[int, list]:
    """Where the sizes of a view/expand are in ``node.args`` (one list, or varargs after the tensor)."""
    if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
        return 1, list(node.args[1])
    return -1, list(node.args[1:])


def _local_size(node: fx.Node, dim: int, tp: int, edits: dict[fx.Node, tuple]) -> None:
    """The size the view/expand ``node`` records for its output's ``dim``, divided by ``tp`` (if an int), into
    ``edits`` (its new args)."""
    at, sizes = _size_arg(node)
    value = sizes[dim]
    if isinstance(value, fx.Node) or value == -1:
        return   # a graph value (the local size at run time) or inferred: right as it is
    if not isinstance(value, int) or value % tp:
        raise _refuse(node, f"its size {value!r} at the sharded dimension {dim} does not divide by tp={tp}")
    sizes[dim] = value // tp
    edits[node] = (node.args[0], sizes) if at == 1 else (node.args[0], *sizes)


def _view_rule(node: fx.Node, name: str, src: fx.Node) -> Any:
    shape, out = _shape(src), _shape(node)
    args = node.args
    if name in _VIEWS:
        return views.view_groups(shape, out)
    if name in ("expand", "expand_copy"):
        return views.expand(shape, out)
    if name in ("transpose", "swapaxes"):
        return views.dim_transpose(len(shape), args[1], args[2])
    if name == "permute":
        dims = args[1] if isinstance(args[1], (list, tuple)) else args[1:]
        return tuple(views.InputDim(d % len(shape)) for d in dims)
    if name == "unsqueeze":
        return views.dim_unsqueeze(len(shape), args[1])
    if name == "squeeze":
        return views.dim_squeeze(shape, args[1] if len(args) > 1 else None)
    if name == "flatten":
        return views.dim_flatten(len(shape), *args[1:])
    return None


def _follow(node: fx.Node, name: str, sharded: dict[fx.Node, Any], tp: int, edits: dict[fx.Node, tuple]) -> Any:
    """The sharded dim (or per-output dims) of ``node``'s value; its local sizes into ``edits``."""
    ins = [a for a in node.all_input_nodes if a in sharded]
    if name == "getitem" and node.target is operator.getitem:
        dims = sharded[node.args[0]]
        return dims[node.args[1]] if isinstance(dims, tuple) else _no(node, "it indexes a sharded tensor")
    if _ATTENTION in name:
        if any(sharded[a] != 1 for a in ins) or any(a not in sharded for a in node.args[:3] if isinstance(a, fx.Node)):
            raise _refuse(node, "attention needs query, key and value sharded on their heads (dim 1)")
        val = _val(node)
        return tuple(1 if isinstance(v, torch.Tensor) and v.dim() >= 3 else None for v in val) \
            if isinstance(val, (tuple, list)) else 1
    if len(ins) == 1 and node.args and node.args[0] is ins[0]:
        rule = _view_rule(node, name, ins[0])
        if rule is not None:
            d = sharded[ins[0]]
            want, got = views.propagate_shape_and_sharding([Shard(d)], _shape(ins[0]), rule, (tp,))
            if list(want) != [Shard(d)] or not isinstance(got[0], Shard) or type(got[0]) is not Shard:
                raise _refuse(node, f"it would move the sharded dimension {d} where one rank's heads are not whole")
            out = got[0].dim
            if name in _VIEWS or name in ("expand", "expand_copy"):
                _local_size(node, out, tp, edits)
            return out
    if name in _CHECKS:
        return None   # an assertion: no value
    if name in _REDUCTIONS and len(ins) == 1 and node.args[0] is ins[0]:
        return _reduced(node, sharded[ins[0]], len(_shape(ins[0])))
    if name == "cat":
        parts, nd = node.args[0], len(_shape(node))
        dim = (node.args[1] if len(node.args) > 1 else 0) % nd
        dims = {sharded.get(a) for a in parts}
        if len(dims) != 1 or dim in dims:
            raise _refuse(node, "it joins tensors along, or not all along, the sharded dimension")
        return dims.pop()
    if name in ("slice", "select") and len(ins) == 1 and node.args[0] is ins[0]:
        d, nd = sharded[ins[0]], len(_shape(ins[0]))
        dim = (node.args[1] if len(node.args) > 1 else 0) % nd
        if dim == d:
            raise _refuse(node, "it slices the sharded dimension")
        return d if name == "slice" or dim > d else d - 1
    target = node.target
    if (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags) or name in _SAME_SHAPE \
            or getattr(target, "__module__", None) in ("_operator", "operator"):
        out = _shape(node) if not isinstance(_val(node), (tuple, list)) else _shape_of(_val(node)[0])
        if out is None:
            raise _refuse(node, "its output shape was not recorded")
        dims = {sharded[a] + len(out) - len(_shape(a)) for a in ins}
        if len(dims) != 1 or any(out[sharded[a] + len(out) - len(_shape(a))] != _shape(a)[sharded[a]] for a in ins):
            raise _refuse(node, "its sharded inputs do not line up")
        d = dims.pop()
        return tuple(d for _ in _val(node)) if isinstance(_val(node), (tuple, list)) else d
    if name in ("split", "split_with_sizes", "chunk", "unbind"):
        raise _refuse(node, f"{name} of a column-wise layer's output would cut across its heads (a fused q/k/v layer "
                            "needs Conv1DFusedColwise, which gives each rank its share of every part)")
    raise _refuse(node, f"fxpipe does not know how {name} treats a sharded dimension")


def _reduced(node: fx.Node, d: int, nd: int) -> int:
    """The sharded dim of a reduction's output (a per-head norm's mean over the head's features): refused where it
    reduces the sharded dimension itself (that would need the other ranks' heads)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else dims
    if not dims:
        raise _refuse(node, "it reduces over every dimension, the sharded one too")
    dims = {x % nd for x in dims}
    if d in dims:
        raise _refuse(node, f"it reduces the sharded dimension {d}")
    keep = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], bool) else node.kwargs.get("keepdim", False)
    out = d if keep else d - sum(1 for x in dims if x < d)
    return (out, out) if isinstance(_val(node), (tuple, list)) else out


def _shape_of(v: Any) -> tuple | None:
    return tuple(v.shape) if hasattr(v, "shape") else None


def _no(node: fx.Node, why: str) -> Any:
    raise _refuse(node, why)


def _split(node: fx.Node, src: fx.Node, d: int, parts: int, tp: int, edits: dict[fx.Node, tuple]) -> tuple:
    """A ``split``/``split_with_sizes`` of the fused value ``src`` (sharded on ``d``, ``parts`` parts side by
    side) into its parts at their full width: the sizes made local into ``edits``; the outputs' sharded dims."""
    shape = _shape(src)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    sizes = node.args[1] if len(node.args) > 1 else None   # a size passed by keyword: refused below
    width = shape[d] // parts
    whole = [sizes] * parts if isinstance(sizes, int) else list(sizes) if isinstance(sizes, (list, tuple)) else None
    if node.args[0] is not src or dim % len(shape) != d or whole != [width] * parts or width % tp:
        raise _refuse(node, f"a fused layer's output ({parts} parts of {width} side by side on dimension {d}) can "
                            f"only be split on that dimension into its {parts} parts of {width} (each of which tp={tp} "
                            "divides)")
    local = width // tp if isinstance(sizes, int) else [width // tp] * parts
    edits[node] = (src, local, *node.args[2:])
    return tuple(d for _ in range(parts))


def local_sizes(gm: fx.GraphModule, colwise: set[str], rowwise: set[str], tp: int,
                fused: dict[str, int] | None = None) -> dict[fx.Node, tuple]:
    """The new args of every view/expand/split of ``gm`` (its column-wise layers at ``colwise`` giving local
    outputs, those at ``fused`` (path -> parts) their fused ``[part_0_r, part_1_r, ...]`` columns, its row-wise ones
    at ``rowwise`` taking them) whose recorded sizes must become one tp rank's; :class:`TPPlanError` where that
    cannot be exact (module doc). Changes nothing: :func:`localise_shapes` does."""
    return localisation(gm, colwise, rowwise, tp, fused)[0]


def partial_parameters(gm: fx.GraphModule, colwise: set[str], rowwise: set[str], tp: int,
                       fused: dict[str, int] | None = None) -> set[str]:
    """The ``get_attr`` targets of ``gm`` that meet one rank's heads between a block's layers (a per-head norm's
    weight, Qwen3's ``q_norm``): replicated, but each tp rank's backward sums their gradient over its own heads
    only, so the whole gradient is the sum over the tp ranks (Megatron's finalize all-reduces its q/k layer norms'
    gradients over tp for the same reason)."""
    return localisation(gm, colwise, rowwise, tp, fused)[1]


def localisation(gm: fx.GraphModule, colwise: set[str], rowwise: set[str], tp: int,
                 fused: dict[str, int] | None = None) -> tuple[dict[fx.Node, tuple], set[str]]:
    """:func:`local_sizes` and :func:`partial_parameters` from one walk of ``gm``."""
    sharded, edits = _walk(gm, colwise, rowwise, tp, fused)
    return edits, {read.target for node, dim in sharded.items() if dim is not None and node.op == "call_function"
                   for a in node.all_input_nodes if (read := read_attribute(a)) is not None}


def _walk(gm: fx.GraphModule, colwise: set[str], rowwise: set[str], tp: int,
          fused: dict[str, int] | None) -> tuple[dict[fx.Node, Any], dict[fx.Node, tuple]]:
    """The sharded dim of every value between ``gm``'s column-wise and row-wise layers, and the size edits."""
    fused = fused or {}
    sharded: dict[fx.Node, Any] = {}
    parts: dict[fx.Node, int] = {}   # the fused values: how many parts lie side by side on their sharded dim
    edits: dict[fx.Node, tuple] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and (node.target in colwise or node.target in fused):
            shape = _shape(node)
            if shape is None:
                raise _refuse(node, "its output shape was not recorded")
            sharded[node] = len(shape) - 1
            if node.target in fused:
                parts[node] = fused[node.target]
            continue
        ins = [a for a in node.all_input_nodes if a in sharded and sharded[a] is not None]
        if not ins:
            continue
        fused_in = [a for a in ins if a in parts]
        if fused_in:
            src = fused_in[0]
            if _name(node) in ("split", "split_with_sizes"):
                sharded[node] = _split(node, src, sharded[src], parts[src], tp, edits)
                continue
            kept = node.op == "call_function" and len(ins) == 1 and _name(node) in _VIEWS | _SAME_SHAPE
            d = _follow(node, _name(node), sharded, tp, edits) if kept else None
            if not kept or not isinstance(d, int) or _shape(node)[d] != _shape(src)[sharded[src]]:
                raise _refuse(node, f"a fused layer's output ({parts[src]} parts side by side) must be split into its "
                                    "parts before anything else uses it (only views that keep its sharded dimension "
                                    "whole come first)")
            sharded[node], parts[node] = d, parts[src]
            continue
        if node.op == "call_module" and node.target in rowwise:
            if len(ins) != 1 or sharded[ins[0]] != len(_shape(ins[0])) - 1:
                raise _refuse(node, "a row-wise layer needs its input sharded on the last dimension")
            continue
        if node.op in ("output", "call_module", "placeholder", "get_attr"):
            raise _refuse(node, "a sharded value would leave the block (a stage output or another layer's input)")
        if _name(node) == "sym_size":
            continue   # the local size at run time: what the view that reads it needs
        sharded[node] = _follow(node, _name(node), sharded, tp, edits)
    return sharded, edits


def localise_shapes(gm: fx.GraphModule, edits: dict[fx.Node, tuple]) -> None:
    """Apply :func:`local_sizes`'s ``edits`` to ``gm`` and recompile it."""
    for node, args in edits.items():
        node.args = args
    if edits:
        gm.recompile()
