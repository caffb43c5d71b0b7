"""The graph torch.export makes of a deep stack of identical layers, predicted from the graphs of a few of them.

torch.export traces every operation of every layer: a 32-layer Llama-3-8B-shaped model is 2,480 operations and
about 8 s on this machine, an 80-layer 70B-shaped one 20 s, nearly all of it in torch's tracer (a few ms an
operation, spread over fake tensors, symbolic shapes and graph building, no hot spot of fxpipe's). A planner
that never runs the graph (:func:`fxpipe.plan`) needs only the graph's nodes, their names and their shapes, and
in a stack of identical layers those repeat with a pattern: each layer's operations are the previous layer's,
their names' counters advanced by one layer's count of each operation, their parameters the next layer's.

So for a model whose longest ``nn.ModuleList`` holds :data:`MIN_LAYERS` or more layers that are alike (the same
classes, parameter shapes and plain attributes, a layer index aside; the first layer may differ, as T5's holds
the relative position bias), this exports the model cut to 2 and to 3 layers, reads one layer's nodes off their
difference, and writes the graph of ``L`` layers: the layers' nodes repeated in place with their names,
targets, inputs and module paths advanced, every other node's counter moved on by ``L - 3`` layers. The same
prediction made for 4 layers must equal torch.export's own graph of the model cut to 4 layers (every node's
name, operation, target, arguments and module path, and the graph's input and output structure), or the full
model is exported as before. Nothing is written by hand that torch.export would write otherwise: the result is
the graph :func:`fxpipe.frontend.export.export_graph` returns, node for node.

What the prediction cannot see is a layer past the fourth that its own code makes different without an
attribute saying so (a forward that branches on ``layer_idx`` or reads a per-layer list from the config).
That is why only a caller that never runs the graph takes it (``capture(..., other_mode=False)``, that is
:func:`fxpipe.plan`): processes that train capture the whole model again (:func:`capture_as_planned`), and a
graph that differed from the predicted one would differ in its fingerprint, which they refuse with the fix.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch.fx as fx
from torch import nn

from fxpipe.errors import TraceError
from fxpipe.frontend.model_loss import MODEL_LOSS

__all__ = ["MIN_LAYERS", "layer_stack", "predicted_export"]

MIN_LAYERS = 8
"""The smallest stack worth predicting: three exports of 2-4 layers cost about as much as one of 8."""

_PLAIN = (bool, int, float, str, type(None))
_COUNTER = re.compile(r"^(.*?)(?:_(\d+))?$")


def _signature(layer: nn.Module) -> tuple:
    """What makes two layers compute alike: each submodule's class and plain attributes, and every parameter's
    and buffer's name, shape and dtype."""
    modules = []
    for name, sub in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items() if not k.startswith("_") and k != "training"
                             and (isinstance(v, _PLAIN) or isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v))))
        modules.append((name, type(sub).__qualname__, attrs))
    tensors = tuple((n, tuple(t.shape), t.dtype, isinstance(t, nn.Parameter) and t.requires_grad)
                    for n, t in [*layer.named_parameters(), *layer.named_buffers()])
    return tuple(modules), tensors


def _alike(first: tuple, other: tuple, index: int) -> bool:
    """Layer 1's :func:`_signature` and layer ``index``'s are the same but for a layer index (``layer_idx``: an
    attribute that is 1 in layer 1 and ``index`` in this one)."""
    if first[1] != other[1] or len(first[0]) != len(other[0]):
        return False
    for (name, kind, attrs), (name2, kind2, attrs2) in zip(first[0], other[0]):
        if (name, kind) != (name2, kind2) or [k for k, _ in attrs] != [k for k, _ in attrs2]:
            return False
        if any(v != w and not (type(v) is int and type(w) is int and (v, w) == (1, index))
               for (_, v), (_, w) in zip(attrs, attrs2)):
            return False
    return True


def layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The path and the list of the model's longest stack of :data:`MIN_LAYERS` or more alike layers (all but
    the first alike), or ``None``."""
    best: tuple[str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < MIN_LAYERS or not path:
            continue
        if best is not None and len(module) <= len(best[1]):
            continue
        first = _signature(module[1])
        if all(_alike(first, _signature(module[i]), i) for i in range(2, len(module))):
            best = (path, module)
    return best


def _cut(model: nn.Module, path: str, depth: int, export: Callable[[], fx.GraphModule]) -> fx.GraphModule:
    """``export()`` of ``model`` with the stack at ``path`` cut to its first ``depth`` layers."""
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    whole = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList(list(whole)[:depth]))
    try:
        return export()
    finally:
        setattr(parent, attr, whole)


def _split(name: str) -> tuple[str, int]:
    base, number = _COUNTER.match(name).groups()
    return (base, int(number)) if number is not None else (name, 0)


def _join(base: str, number: int) -> str:
    return base if number == 0 else f"{base}_{number}"


class _Stack:
    """One layer of the graph of 3 layers read against the graph of 2: which nodes are layer 2 (and layer 1),
    and how a name, target or module path moves from one layer to the next."""

    def __init__(self, path: str, two: fx.GraphModule, three: fx.GraphModule) -> None:
        self.path, self.flat = path, path.replace(".", "_")
        self.nodes = list(three.graph.nodes)
        layer = {n: self.layer_of(n) for n in self.nodes}
        self.block = [n for n in self.nodes if layer[n] == 2]
        self.previous = [n for n in self.nodes if layer[n] == 1]
        rest = [n for n in self.nodes if layer[n] != 2]
        before = list(two.graph.nodes)
        if (not self.block or len(self.block) != len(self.previous) or len(rest) != len(before)
                or any(a.op != b.op for a, b in zip(self.block, self.previous))
                or any(a.op != b.op or _split(a.name)[0] != _split(b.name)[0] for a, b in zip(rest, before))):
            raise ValueError("the graphs of 2 and 3 layers differ by more than one layer")
        self.earlier = dict(zip(rest, before))                   # node of 3 layers -> its node of 2
        self.back = dict(zip(self.block, self.previous))         # layer 2's node -> layer 1's
        self.forward_ = dict(zip(self.previous, self.block))     # layer 1's node -> layer 2's
        start = self.nodes.index(self.block[0])
        self.after_block = {n for n in self.nodes[start:] if layer[n] is None or layer[n] < 1}

    def layer_of(self, node: fx.Node) -> int | None:
        if node.op == "get_attr" and isinstance(node.target, str) and node.target.startswith(self.path + "."):
            head = node.target[len(self.path) + 1:].split(".")[0]
            return int(head) if head.isdigit() else None
        for value in (node.meta.get("nn_module_stack") or {}).values():
            where = value[0] if isinstance(value, tuple) else str(value)
            if where.startswith(self.path + "."):
                head = where[len(self.path) + 1:].split(".")[0]
                if head.isdigit():
                    return int(head)
        return None

    def moved(self, text: str, layer: int) -> str:
        """``text`` (a target, name or module path of layer 2) for ``layer``."""
        text = re.sub(rf"(^|\.){re.escape(self.path)}\.2(?=\.|$)", rf"\g<1>{self.path}.{layer}", text)
        return re.sub(rf"(^|_){re.escape(self.flat)}_2(?=_|$)", rf"\g<1>{self.flat}_{layer}", text)

    def name(self, node: fx.Node, layers: int, copy: int | None) -> str:
        """``node``'s name in the graph of ``layers`` layers (``copy``: which repetition of the layer)."""
        if copy is None:   # not a layer node: its counter moves on by the layers added
            base, now = _split(node.name)
            _, then = _split(self.earlier[node].name)
            return _join(base, now + (layers - 3) * (now - then))
        if node.op in ("get_attr", "placeholder"):
            return self.moved(node.name, 2 + copy)
        base, now = _split(node.name)
        _, then = _split(self.back[node].name)
        return _join(base, now + copy * (now - then))


def _predict(stack: _Stack, three: fx.GraphModule, layers: int) -> fx.Graph:
    """The graph of ``layers`` layers (module doc)."""
    graph = fx.Graph()
    graph._codegen = three.graph._codegen
    made: dict[tuple[fx.Node, int | None], fx.Node] = {}
    last = layers - 3   # the copy that is the last layer
    block = set(stack.block)

    def mapped(arg: Any, copy: int | None, user: fx.Node) -> Any:
        def one(node: fx.Node) -> fx.Node:
            if node in block:     # a node of layer 2: the same copy, or from outside the layers the last one
                return made[(node, last if copy is None else copy)]
            if node in stack.forward_ and copy is not None:   # layer 1, read by layer 2: the layer before
                return made[(node, None)] if copy == 0 else made[(stack.forward_[node], copy - 1)]
            if node in stack.forward_ and user in stack.after_block and last >= 1:   # the layer before the last
                return made[(stack.forward_[node], last - 1)]
            return made[(node, None)]
        return fx.map_arg(arg, one)

    def emit(node: fx.Node, copy: int | None) -> None:
        name = stack.name(node, layers, copy)
        target = stack.moved(node.target, 2 + copy) if copy is not None and node.op == "get_attr" else node.target
        new = graph.create_node(node.op, target, mapped(node.args, copy, node), mapped(node.kwargs, copy, node),
                                name=name, type_expr=node.type)
        if new.name != name:
            raise ValueError(f"the name {name!r} is taken")
        new.meta = dict(node.meta)
        if copy is not None and "nn_module_stack" in node.meta:
            new.meta["nn_module_stack"] = {stack.moved(k, 2 + copy): (stack.moved(v[0], 2 + copy), *v[1:])
                                           if isinstance(v, tuple) else v
                                           for k, v in node.meta["nn_module_stack"].items()}
        made[(node, copy)] = new

    run: list[fx.Node] = []
    for node in [*stack.nodes, None]:
        if node is not None and node in block:
            run.append(node)
            continue
        for copy in range(layers - 2):   # a run of layer 2's nodes, once per layer from the third
            for x in run:
                emit(x, copy)
        run = []
        if node is not None:
            emit(node, None)
    return graph


def _same(a: fx.Graph, b: fx.Graph) -> bool:
    """Node for node: name, operation, target, arguments (by name) and module paths."""
    def shape(n: fx.Node) -> tuple:
        def arg(x: Any) -> Any:
            return fx.map_arg(x, lambda m: ("node", m.name))
        stack = [v[0] if isinstance(v, tuple) else v for v in (n.meta.get("nn_module_stack") or {}).values()]
        return n.name, n.op, n.target if isinstance(n.target, str) else id(n.target), repr(arg(n.args)), \
            repr(arg(n.kwargs)), stack
    left, right = list(a.nodes), list(b.nodes)
    return len(left) == len(right) and all(shape(x) == shape(y) for x, y in zip(left, right))


def predicted_export(model: nn.Module, export: Callable[[], fx.GraphModule]) -> tuple[fx.GraphModule, str] | None:
    """``export()``'s graph of ``model`` predicted from cut models (module doc) and a note saying so, or ``None``
    where the model has no stack to predict or the prediction for 4 layers is not torch.export's own."""
    found = layer_stack(model)
    if found is None:
        return None
    path, layers = found
    try:
        two, three, four = (_cut(model, path, depth, export) for depth in (2, 3, 4))
        stack = _Stack(path, two, three)
        if not _same(_predict(stack, three, 4), four.graph) or _meta(three) != _meta(four):
            return None
        graph = _predict(stack, three, len(layers))
    except (TraceError, ValueError, KeyError, AttributeError):   # a cut model export cannot trace: the whole one
        return None
    root: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op == "get_attr":   # the model's own tensors; a constant export lifted is the cut graph's
            try:
                root[node.target] = _attribute(model, node.target)
            except AttributeError:
                root[node.target] = _attribute(three, node.target)
    gm = fx.GraphModule(root, graph, type(three).__name__)
    gm.meta.update(three.meta)
    if MODEL_LOSS in gm.meta:   # the model's own loss reads its class weights, if any, from this graph
        gm.meta[MODEL_LOSS] = dataclasses.replace(gm.meta[MODEL_LOSS], owner=gm)
    return gm, (f"its {len(layers)} layers of {path} predicted from the graphs of 2 and 3 of them (checked "
                f"against 4; fxpipe/frontend/repeats.py)")


def _meta(gm: fx.GraphModule) -> str:
    """``gm.meta`` as text to compare across depths: the graph's input and output structure, batch dims, the
    model's own loss (without the graph that holds it, which is ``gm`` itself)."""
    meta = dict(gm.meta)
    if MODEL_LOSS in meta:
        meta[MODEL_LOSS] = dataclasses.replace(meta[MODEL_LOSS], owner=None)
    return repr(meta)


def _attribute(gm: nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
