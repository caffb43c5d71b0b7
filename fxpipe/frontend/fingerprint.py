"""A stable fingerprint of a traced graph: its op structure and parameter shapes.

Two models with the same architecture (whatever their weights) share a
fingerprint; a plan saved for one is refused for any other.

Whether a model's graph depends on train/eval mode is the same comparison
made between its two modes' graphs, with one exception: a dropout of rate 0
(Hugging Face configs ship many) returns its input in both modes, so the
training flag torch.export records in it does not count
(:func:`inert_dropout`, ``graph_fingerprint(..., modes_alike=True)``).
"""

from __future__ import annotations

import hashlib
import json

import torch.fx as fx

__all__ = ["graph_fingerprint", "inert_dropout", "is_dropout_call"]


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', getattr(t, '__name__', repr(t)))}"


def _argument(node: fx.Node, index: int, names: tuple[str, ...], default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return next((node.kwargs[k] for k in names if k in node.kwargs), default)


def is_dropout_call(node: fx.Node) -> bool:
    """Whether ``node`` calls a functional, method or ATen dropout (``F.dropout``, ``aten.native_dropout``...)."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return "dropout" in target.lower()


def inert_dropout(node: fx.Node) -> bool:
    """Whether ``node`` is a functional or ATen dropout that draws nothing and returns its input: traced
    with ``training=False``, or with a literal rate of 0 (ATen's dropout returns its input for ``p == 0``)."""
    if not is_dropout_call(node):
        return False
    rate = _argument(node, 1, ("p",), 0.5)
    training = _argument(node, 2, ("training", "train"), True)
    return training is False or (isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate == 0)


def graph_fingerprint(gm: fx.GraphModule, frontend: str = "fx", *, modes_alike: bool = False) -> str:
    """SHA-256 of the front end that traced it, nodes (op, target, a called module's class, argument
    structure) and parameter/buffer shapes. A plan made through one front end is refused for a graph made
    through another (their node names differ even where the model is the same).

    ``modes_alike``: an :func:`inert_dropout` counts as its input alone, so the graphs of a model's two
    modes agree where they compute the same (the training flag of a rate-0 dropout differs, and is moot)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def encode(a: object) -> object:
        if isinstance(a, fx.Node):
            return ["node", index[a]]
        if isinstance(a, (list, tuple)):
            return [encode(x) for x in a]
        if isinstance(a, dict):
            return {str(k): encode(v) for k, v in a.items()}
        if isinstance(a, (int, float, bool, str)) or a is None:
            return a
        return repr(type(a).__name__)

    def module_type(n: fx.Node) -> str:   # a leaf's class: ReLU and Tanh under the same name differ
        if n.op != "call_module":
            return ""
        kind = type(gm.get_submodule(n.target))
        return f"{kind.__module__}.{kind.__qualname__}"

    def arguments(n: fx.Node) -> list[object]:
        if modes_alike and inert_dropout(n):
            return ["inert dropout", encode(n.args[0] if n.args else next(iter(n.kwargs.values()), None))]
        return [encode(n.args), encode(n.kwargs)]

    nodes = [[n.op, n.name, _target_name(n), module_type(n), *arguments(n)] for n in gm.graph.nodes]
    tensors = sorted([name, list(p.shape), str(p.dtype)] for name, p in
                     list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers()))
    document = {"nodes": nodes, "tensors": tensors}
    if frontend != "fx":   # fx graphs keep the fingerprints plans were saved with before there were others
        document["frontend"] = frontend
    blob = json.dumps(document, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
