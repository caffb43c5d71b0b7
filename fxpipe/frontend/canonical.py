"""An exported graph made the same whichever device it was traced on: the graph a plan records is the graph a rank
traces again.

``torch.export`` records what the example tensors' layouts made the model's code do, and a layout is the device's:
``x.transpose(1, 2).contiguous()`` after attention is a copy (``aten.contiguous``) on ``meta`` (where
:func:`fxpipe.plan` traces a model it never allocates) and no node at all on the CPU, whose attention kernel returns
the transposed layout already; export's node names count every operation it made, so the names after such a node
differ too. A plan made from shapes for GPUs would then never match the graph a process traces from the real model
(``PlanMismatchError`` on every rank). Two steps make the graph the device's no longer:

- every ``view`` becomes a ``reshape``: the same view wherever the view was possible, and a copy where a layout
  makes it impossible (so ``view`` would have raised), and a ``contiguous`` whose result only feeds reads is
  dropped (its readers take its input). One whose result, or a view of it, is written in place stays: there the
  copy keeps the write off its input.
- the operations are renamed in graph order, each name its operation's base and a count (``mul``, ``mul_1``, ...),
  as export names them where it drops nothing: the same structure gives the same names, which the plan's stage
  assignment and the fingerprint are keyed on.

Placeholders, parameters (``get_attr``) and the output keep their names. No library does this: torch.export's
names and layout copies are its trace's, by design.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx
from torch.fx.graph import _Namespace

__all__ = ["canonical_graph"]

_COUNTER = re.compile(r"^(.*?)(?:_(\d+))?$")
_aten = torch.ops.aten
_VIEWS = (_aten.view.default, _aten._unsafe_view.default)


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s result may share memory with an input (a view, ``getitem`` of one)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        return any(r.alias_info is not None for r in returns)
    return node.op == "call_function" and getattr(target, "__name__", "") == "getitem"


def _writes(node: fx.Node, value: fx.Node) -> bool:
    """Whether ``node`` may write ``value`` in place (an argument its schema marks written, or an unknown call)."""
    target = node.target
    if node.op == "output":
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return node.op != "call_function" or getattr(target, "__name__", "") != "getitem"
    schema = target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        given = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if given is value or (isinstance(given, (list, tuple)) and value in given):
            return True
    return False


def _only_read(node: fx.Node) -> bool:
    """Whether nothing writes ``node``'s result or a view of it."""
    for user in node.users:
        if _writes(user, node) or (user.op == "call_function" and _aliases(user) and not _only_read(user)):
            return False
    return True


def _drop_layout_copies(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _VIEWS:
            node.target = _aten.reshape.default
        elif (node.target is _aten.contiguous.default and _only_read(node)
              and node.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _rename(gm: fx.GraphModule) -> None:
    """Every operation named anew in graph order from its base (module doc), in a namespace of the graph's names
    alone: the old names (and the gaps in their counts) are forgotten."""
    names = _Namespace()
    for node in gm.graph.nodes:
        keep = node.op in ("placeholder", "get_attr", "output")
        node.name = names.create_name(node.name if keep else _COUNTER.match(node.name).group(1), None)
        names.associate_name_with_obj(node.name, node)
    gm.graph._graph_namespace = names


def canonical_graph(gm: fx.GraphModule) -> None:
    """Make ``gm`` (a flat exported graph) the same whichever device it was traced on (module doc), in place."""
    _drop_layout_copies(gm)
    _rename(gm)
    gm.graph.lint()
    gm.recompile()
