"""The dict types of a traced forward's result, which torch.fx keeps only as plain dicts.

torch.fx stores the graph's output as arguments of its ``output`` node, and ``Tracer.create_arg`` turns
every dict there into a plain one: a model returning an ``OrderedDict`` (torchvision's segmentation models)
or another ``dict`` subclass (a ``defaultdict``, a dataclass such as Hugging Face's ``ModelOutput``) would
come back from the pipeline as a ``dict``. :class:`RecordingDictTypes` (a tracer) records with
:func:`dict_types`, while tracing, where in the result such dicts sit and of which type;
:func:`with_dict_types` rebuilds them around the pipeline's values. Nothing in torch keeps these types for fx (``torch.export`` records a pytree spec instead, and its
front end gives the model's own types back through that spec).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch.fx as fx

__all__ = ["DictTypes", "RecordingDictTypes", "dict_types", "with_dict_types"]

DictTypes = Any
"""``None`` (no dict subclass below), ``("seq", [DictTypes, ...])`` for a list or tuple, or
``("dict", type or None, default_factory or None, {key: DictTypes})`` for a dict."""


def dict_types(value: Any) -> DictTypes:
    """Where ``value`` (the forward's result, as traced) holds dicts of a type other than ``dict``; None if nowhere."""
    if isinstance(value, dict):
        inner = {k: dict_types(v) for k, v in value.items()}
        kind = None if type(value) is dict else type(value)
        if kind is None and all(t is None for t in inner.values()):
            return None
        factory = value.default_factory if isinstance(value, defaultdict) else None
        return ("dict", kind, factory, inner)
    if isinstance(value, (list, tuple)):
        inner_seq = [dict_types(v) for v in value]
        return None if all(t is None for t in inner_seq) else ("seq", inner_seq)
    return None


class RecordingDictTypes(fx.Tracer):
    """A tracer that keeps the traced forward's dict types in ``output_dict_types``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arg_depth = 0
        self._outermost_arg: Any = None
        self.output_dict_types: DictTypes = None

    def create_arg(self, a: Any) -> Any:
        # fx makes the output node from create_arg(forward's result): the last outermost argument made
        # before the output node is that result, its dicts still of their own types
        self._arg_depth += 1
        try:
            return super().create_arg(a)
        finally:
            self._arg_depth -= 1
            if self._arg_depth == 0:
                self._outermost_arg = a

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> fx.Node:
        if kind == "output":
            self.output_dict_types = dict_types(self._outermost_arg)
        return super().create_node(kind, target, args, kwargs, name, type_expr)


def _rebuilt(kind: type, factory: Any, items: dict) -> Any:
    if issubclass(kind, defaultdict):
        return kind(factory, items)
    if dataclasses.is_dataclass(kind):   # Hugging Face's ModelOutput: fields by keyword
        return kind(**items)
    return kind(items)


def with_dict_types(value: Any, types: DictTypes) -> Any:
    """``value`` (the pipeline's result, containers already plain) with the dicts :func:`dict_types` recorded
    rebuilt as their own types."""
    if types is None:
        return value
    if types[0] == "seq" and isinstance(value, (list, tuple)):
        items = [with_dict_types(v, t) for v, t in zip(value, types[1])]
        if isinstance(value, tuple) and hasattr(value, "_fields"):   # a named tuple takes its fields in order
            return type(value)(*items)
        return type(value)(items)
    if types[0] == "dict" and isinstance(value, dict):
        _, kind, factory, inner = types
        items = {k: with_dict_types(v, inner.get(k)) for k, v in value.items()}
        return items if kind is None else _rebuilt(kind, factory, items)
    return value
