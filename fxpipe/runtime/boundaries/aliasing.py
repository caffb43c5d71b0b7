"""Which values of a traced graph may share memory, and which nodes write into a value.

A stage must not write into memory it does not own: a value received from
another stage (autograd saved it there, and a checkpointed stage re-reads it
when it recomputes) or a buffer whose recomputation must see what the first
forward saw. A write can reach such memory through any chain of values that
share it: ``nn.Identity`` and a dropout that return their input, views
(``view``, ``reshape``, ``expand``, slicing, ``t``, ``permute``, ``flatten``,
``narrow``, ``.T``, ``.data``...), ``contiguous``/``to``/``float`` of a tensor
that already is, and an in-place op, which returns what it wrote. The answers
here are conservative (an op that *may* return its input counts, and so does a
user's opaque leaf module), because a missed alias is a silent wrong result and
a needless one costs only a copy.
"""

from __future__ import annotations

import builtins
import operator
from typing import Iterable

import torch.fx as fx
from torch import nn

__all__ = ["is_inplace", "alias_sources", "written_inputs", "aliases_of", "written_buffers"]

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul, operator.setitem}
# Methods and functions whose result may share memory with their first argument: views, and conversions
# that return the tensor itself when there is nothing to convert.
_SAME_MEMORY = {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "swapaxes",
                "swapdims", "permute", "t", "adjoint", "unsqueeze", "squeeze", "expand", "expand_as",
                "broadcast_to", "narrow", "select", "chunk", "split", "split_with_sizes", "tensor_split",
                "hsplit", "vsplit", "dsplit", "unsafe_chunk", "unsafe_split", "unbind", "movedim", "moveaxis",
                "diagonal", "unfold", "as_strided", "detach", "alias", "view_as_real", "view_as_complex",
                "real", "imag", "atleast_1d", "atleast_2d", "atleast_3d", "contiguous", "to", "type", "type_as",
                "float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte", "char", "cpu",
                "cuda", "requires_grad_", "__getitem__", "getitem", "identity", "dropout", "dropout1d",
                "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "align_to", "rename",
                "refine_names", "coalesce", "resolve_conj", "resolve_neg", "conj", "positive",
                # ATen views that torch.export records for Python indexing and reshapes
                "slice", "_unsafe_view", "_reshape_alias"}
# Names ending in "_" that change no tensor's values.
_NOT_WRITING = {"requires_grad_", "share_memory_", "retain_grad_"}
# Functions whose result may share memory with *every* tensor argument.
_ALL_ARGUMENTS = {"broadcast_tensors", "meshgrid", "atleast_1d", "atleast_2d", "atleast_3d"}
# Attributes that are the tensor itself or a view of it.
_SAME_MEMORY_ATTRIBUTES = {"data", "T", "mT", "H", "mH", "real", "imag"}
# torch.nn modules that return their input (or a view of it): the rest compute new tensors.
_RETURNING_INPUT = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)
# Functions that update running statistics passed to them (their tensor arguments after the input).
_UPDATING_STATISTICS = {"batch_norm", "instance_norm"}


def _name(target: object) -> str:
    """A function's or method's name; an ATen overload's (the torch.export front end's ``aten.mul_.Tensor``)
    is its packet's, ``mul_``, so that it reads as the Python call it was recorded from."""
    if isinstance(target, str):
        return target
    return getattr(getattr(target, "overloadpacket", target), "__name__", "")


def _opaque(module: nn.Module) -> bool:
    """A leaf module fxpipe cannot see into: not one of torch.nn's own (a user's ``leaf_modules``)."""
    return not type(module).__module__.startswith(("torch.nn", "torch.ao.nn"))


def is_inplace(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` writes into its first argument (and returns it)."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        if getattr(module, "inplace", False):
            return True
        # an opaque leaf holding an in-place module may apply it to its input first
        return _opaque(module) and any(getattr(m, "inplace", False) is True for m in module.modules())
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return True
    if node.op in ("call_function", "call_method"):
        name = _name(node.target)
        return node.kwargs.get("inplace", False) is True or (
            name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITING)
    return False


def written_inputs(node: fx.Node, root: nn.Module) -> list[fx.Node]:
    """The argument nodes whose memory ``node`` writes: an in-place op's first argument, an ``out=``."""
    found = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) and is_inplace(node, root) else []
    fx.node.map_arg(node.kwargs.get("out"), lambda n: found.append(n) or n)
    return found


def alias_sources(node: fx.Node, root: nn.Module) -> list[fx.Node]:
    """The argument nodes whose memory ``node``'s result may share."""
    first = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        aliasing = isinstance(module, _RETURNING_INPUT) or _opaque(module) or is_inplace(node, root)
        return first if aliasing else []
    if node.op not in ("call_function", "call_method"):
        return []
    name = _name(node.target)
    if node.op == "call_function" and name in _ALL_ARGUMENTS:
        return list(node.all_input_nodes)
    if node.op == "call_function" and node.target is builtins.getattr:
        return first if len(node.args) > 1 and node.args[1] in _SAME_MEMORY_ATTRIBUTES else []
    if node.target is operator.getitem or name in _SAME_MEMORY or is_inplace(node, root):
        return first
    return []


def aliases_of(sources: Iterable[fx.Node], root: nn.Module) -> set[fx.Node]:
    """``sources`` and every node whose value may share memory with one of them."""
    found = set(sources)
    stack = list(found)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in found and node in alias_sources(user, root):
                found.add(user)
                stack.append(user)
    return found


def written_buffers(gm: fx.GraphModule) -> set[str]:
    """Qualified names of the buffers of ``gm`` that running it may change: those of its leaf modules (a
    training BatchNorm's running statistics) and those that an op writes, through any alias."""
    names: set[str] = set()
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            names.update(f"{node.target}.{name}" for name, _ in
                         gm.get_submodule(node.target).named_buffers(remove_duplicate=False))
        elif node.op == "get_attr" and node.target in buffers:
            shared = aliases_of([node], gm)
            for user in {u for n in shared for u in n.users}:
                statistics = [a for a in user.all_input_nodes[1:]
                              if user.op == "call_function" and _name(user.target) in _UPDATING_STATISTICS]
                if shared.intersection(written_inputs(user, gm) + statistics):
                    names.add(node.target)
                    break
    return names
