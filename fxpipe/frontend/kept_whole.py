"""The operations of named modules in a traced graph, from the ``nn_module_stack`` metadata both front ends
record: what ``leaf_modules`` keeps whole in one stage when the graph is torch.export's (which has no
``call_module`` nodes; fx keeps a leaf whole by not tracing into it). The groups go to the planner in
``gm.meta["fxpipe_keep_whole"]`` (label -> node names), which hands them to :mod:`solvers.together`.
Also here: the reads of one Parameter under two names (tied weights), which must share a stage as well.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch.fx as fx

__all__ = ["class_name", "module_stack", "module_groups", "operations", "tied_parameters", "with_parameters",
           "KEEP_WHOLE"]

KEEP_WHOLE = "fxpipe_keep_whole"   # the graph's meta key of the groups


def class_name(t: Any) -> str:
    """A module class as ``module.QualName`` (fx records the class, torch.export its name)."""
    return t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}"


def module_stack(node: fx.Node) -> list[tuple[str, str, str]]:
    """(call key, module path, class name) of the modules whose forward made ``node``, outermost first;
    the key tells two calls of one module apart (torch.export writes ``path@1`` for the second)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(str(key), str(path), class_name(cls)) for key, (path, cls) in stack.items()]


def with_parameters(gm: fx.GraphModule, groups: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each group with the ``get_attr`` nodes (parameters) that only it reads."""
    owner = {name: label for label, names in groups.items() for name in names}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users and node.name not in owner:
            labels = {owner.get(u.name) for u in node.users}
            if len(labels) == 1 and None not in labels:
                label = labels.pop()
                groups[label].append(node.name)
    return groups


def operations(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's computing nodes (not inputs, parameters or the output)."""
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def module_groups(gm: fx.GraphModule, modules: Iterable[Any]) -> tuple[dict[str, list[str]], list[Any]]:
    """The operations of every call of the given modules (a module path, or a class: each of its
    instances), outermost first; and the entries that matched no operation."""
    wanted = list(modules)
    groups: dict[str, list[str]] = {}
    matched: set[int] = set()
    for node in operations(gm):
        for key, path, cls in module_stack(node):
            hits = [i for i, m in enumerate(wanted)
                    if (isinstance(m, str) and m == path) or (isinstance(m, type) and class_name(m) == cls)]
            if hits:
                matched.update(hits)
                groups.setdefault(path + (key[key.index("@"):] if "@" in key else ""), []).append(node.name)
                break     # inside a kept module everything is kept with it
    return with_parameters(gm, groups), [m for i, m in enumerate(wanted) if i not in matched]


def tied_parameters(gm: fx.GraphModule) -> dict[str, list[str]]:
    """The ``get_attr`` nodes that read one Parameter object under different names (a tied embedding and
    head): kept in one stage, so that the Parameter lives in exactly one stage module and the other stages
    receive it as a value."""
    by_object: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":    # an unused read too: its stage module would hold the Parameter as well
            continue
        try:
            value = gm.get_parameter(node.target)
        except AttributeError:     # a buffer, a constant or a module: not a shared Parameter
            continue
        by_object.setdefault(id(value), []).append(node.name)
        first.setdefault(id(value), str(node.target))
    return {f"tied {first[k]}": names for k, names in by_object.items() if len(names) > 1}
