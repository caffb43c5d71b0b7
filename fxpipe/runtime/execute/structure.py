"""The model's own output containers, given back as the user's code built them.

torch.fx stores a traced ``return {"logits": y}`` or ``return [a, b]`` as ``immutable_dict`` and
``immutable_list`` (graph arguments must not change); a pipeline that handed those back would give the
user a dict that refuses ``out["extra"] = ...``. Tuples, named tuples and other containers pass through
as they are.

A graph from the ``torch.export`` front end is flat (:mod:`fxpipe.frontend.export`): its inputs are the
leaves of the call's ``(args, kwargs)`` and its outputs the leaves of the result; :func:`flat_inputs` and
:func:`model_output` go between the user's structures (a ``ModelOutput``, a dict of tensors) and those leaves
with the pytree specs export recorded. :class:`FlatInputs` marks inputs that are already the graph's
leaves (fxpipe's own calls, which hold the flattened example).
"""

from __future__ import annotations

from typing import Any

from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from fxpipe.frontend.output_types import DictTypes, with_dict_types

__all__ = ["user_structure", "FlatInputs", "flat_inputs", "model_output"]


class FlatInputs(tuple):
    """Inputs given as the flat graph's placeholders, in order (no pytree to flatten)."""


def _children(spec: TreeSpec) -> list[TreeSpec]:
    children = getattr(type(spec), "children", None)   # torch >= 2.13; children_specs before (deprecated since)
    return list(spec.children()) if callable(children) else list(spec.children_specs)


def _by_position(args: tuple, kwargs: dict[str, Any], spec: TreeSpec, names: list[str]) -> tuple[tuple, dict]:
    """A call that names by keyword a tensor input the exported call passed by position (``pipe(input_ids=ids)``
    for a graph exported from ``model(ids)``), given as that call was: the placeholder of a positional tensor
    input is named after the forward's parameter."""
    if not names or not kwargs or spec.num_children != 2:
        return args, kwargs
    positional = _children(spec)[0]
    wanted = positional.num_children
    if len(args) >= wanted:
        return args, kwargs
    args, kwargs, leaf = list(args), dict(kwargs), 0
    for j, child in enumerate(_children(positional)):
        if j >= len(args):
            name = names[leaf] if leaf < len(names) and child.num_leaves == 1 else None
            if name not in kwargs:
                break
            args.append(kwargs.pop(name))
        leaf += child.num_leaves
    return tuple(args), kwargs


def flat_inputs(args: tuple, kwargs: dict[str, Any], spec: TreeSpec | None,
                names: list[str] | None = None) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` as the graph's positional inputs when the graph is flat (``spec`` is the exported
    call's input spec, ``names`` its placeholders' names); as given otherwise. A keyword naming an input the
    exported call passed by position is taken in its place (:func:`_by_position`). A call whose structure
    differs from the exported one is refused with both structures named: binding it leaf by leaf would feed
    one input to another's place."""
    if spec is None or isinstance(args, FlatInputs):
        return tuple(args), kwargs
    args, kwargs = _by_position(tuple(args), dict(kwargs), spec, names or [])
    leaves, got = tree_flatten((tuple(args), dict(kwargs)))
    if got != spec:
        raise TypeError(f"the pipeline was compiled for inputs structured as {spec} (positional arguments, then "
                        f"keyword arguments), but was called with {got}; call it as the model was called for "
                        "compile (the same keywords, the same nesting), or compile again with example inputs of "
                        "this structure")
    return tuple(leaves), {}


def model_output(values: Any, spec: TreeSpec | None, dict_types: DictTypes = None) -> Any:
    """The gathered outputs in the user's structure: the model's own type for a flat graph (``spec``);
    otherwise fx's immutable containers made plain, and the dicts the traced forward returned as another
    type (``dict_types``: an ``OrderedDict``, a ``ModelOutput``) rebuilt as that type."""
    if spec is None:
        return with_dict_types(user_structure(values), dict_types)
    return tree_unflatten(list(values), spec)


def user_structure(value: Any) -> Any:
    """``value`` with every fx immutable container turned into a plain ``dict`` or ``list``, recursively."""
    if isinstance(value, immutable_dict):
        return {k: user_structure(v) for k, v in value.items()}
    if isinstance(value, immutable_list):
        return [user_structure(v) for v in value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):   # a named tuple keeps its type
        return type(value)(*(user_structure(v) for v in value))
    if type(value) is tuple:
        return tuple(user_structure(v) for v in value)
    if isinstance(value, dict):
        return type(value)({k: user_structure(v) for k, v in value.items()})
    if type(value) is list:
        return [user_structure(v) for v in value]
    return value
