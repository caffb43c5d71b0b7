"""A stable fingerprint of a traced graph: its op structure and parameter shapes.

Two models with the same architecture (whatever their weights) share a
fingerprint; a plan saved for one is refused for any other.
"""

from __future__ import annotations

import hashlib
import json

import torch.fx as fx

__all__ = ["graph_fingerprint"]


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', getattr(t, '__name__', repr(t)))}"


def graph_fingerprint(gm: fx.GraphModule, frontend: str = "fx") -> str:
    """SHA-256 of the front end that traced it, nodes (op, target, a called module's class, argument
    structure) and parameter/buffer shapes. A plan made through one front end is refused for a graph made
    through another (their node names differ even where the model is the same)."""
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

    nodes = [[n.op, n.name, _target_name(n), module_type(n), encode(n.args), encode(n.kwargs)] for n in gm.graph.nodes]
    tensors = sorted([name, list(p.shape), str(p.dtype)] for name, p in
                     list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers()))
    document = {"nodes": nodes, "tensors": tensors}
    if frontend != "fx":   # fx graphs keep the fingerprints plans were saved with before there were others
        document["frontend"] = frontend
    blob = json.dumps(document, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
