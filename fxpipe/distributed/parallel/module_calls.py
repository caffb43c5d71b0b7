"""A stage graph's linear layers called as modules again, so that a tensor-parallel plan by module path applies.

``torch.export`` records the ATen operations a layer runs, not the layer: ``nn.Linear(x)`` becomes
``aten.linear(x, weight, bias)`` on ``get_attr`` nodes of its parameters, a Hugging Face ``Conv1D`` (GPT-2) becomes
``aten.addmm(bias, x2d, weight)`` between two views. torch's tensor-parallel styles work through the module's
forward hooks (its input made a ``DTensor``, its output converted back), so a layer that is not called as a module
would run its sharded ``DTensor`` weights on plain tensors. :func:`restore_module_calls` replaces such an operation
by a ``call_module`` of the model's own layer (the same parameter objects, so gradients, the optimizer and
``named_parameters`` are unchanged): ``nn.Linear.forward`` is that ``aten.linear`` and ``Conv1D.forward`` on the
2-D input is that ``addmm`` followed by a view to the same shape, so the stage computes what it computed before.
A graph torch.fx traced already calls the modules (``call_module``): nothing to do there.

Under ``"bf16-mixed"`` the operation reads the parameters through their bfloat16 compute copies
(``aten.linear(x, compute_copy(weight), compute_copy(bias))``, :mod:`fxpipe.frontend.precision`): the layer is
found through the copies, the copies go with the operation, and the layer called computes with them
(:func:`fxpipe.distributed.parallel.mixed_layers.computing_in_bfloat16`), so the stage still computes what it
computed before.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.fx as fx
from torch import nn

from fxpipe.distributed.parallel.mixed_layers import computing_in_bfloat16
from fxpipe.frontend.precision import is_compute_copy, read_attribute

__all__ = ["call_instead", "restore_module_calls", "called_modules", "is_conv1d"]

_aten = torch.ops.aten


def is_conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``transformers.pytorch_utils.Conv1D`` (weight ``(in, out)``: a transposed ``nn.Linear``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _attr(node: fx.Node) -> str | None:
    """The attribute path ``node`` reads (a ``get_attr``, or its bfloat16 compute copy), or ``None``."""
    found = read_attribute(node)
    return None if found is None else found.target


def _owner(model: nn.Module, weight: str | None, bias: str | None) -> tuple[str, nn.Module] | None:
    """The layer whose ``weight`` (and ``bias``, or no bias) these attribute paths are."""
    if weight is None or not weight.endswith(".weight"):
        return None
    path = weight[: -len(".weight")]
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    own_bias = getattr(module, "bias", None)
    if (bias is None) != (own_bias is None) or (bias is not None and bias != f"{path}.bias"):
        return None
    return path, module


def restore_module_calls(gm: fx.GraphModule, model: nn.Module, paths: Iterable[str]) -> list[str]:
    """In ``gm`` (a stage of an exported graph), call the layers of ``model`` at ``paths`` as modules where their
    operation reads their parameters directly. Returns the paths rewritten; ``gm`` is recompiled if any."""
    wanted = set(paths)
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _aten.linear.default and len(node.args) >= 2:
            x, found = node.args[0], _owner(model, _attr(node.args[1]),
                                            _attr(node.args[2]) if len(node.args) > 2 else None)
            if found is None or not isinstance(found[1], nn.Linear):
                continue
        elif node.target is _aten.addmm.default and len(node.args) == 3 and not node.kwargs:
            x, found = node.args[1], _owner(model, _attr(node.args[2]), _attr(node.args[0]))
            if found is None or not is_conv1d(found[1]):
                continue
        else:
            continue
        path, module = found
        if path not in wanted:
            continue
        # the model's own layer, over the container that held its parameters (the compute copies first: each read
        # its parameter, and goes where no other node reads it)
        copies = [a for a in node.args if is_compute_copy(a)]
        params = copies + [read for a in node.args if (read := read_attribute(a)) is not None]
        call_instead(gm, path, computing_in_bfloat16(module, is_conv1d(module)) if copies else module, (x,), [node], params)
        done.append(path)
    if done:
        gm.recompile()
    return done


def call_instead(gm: fx.GraphModule, path: str, module: nn.Module, args: tuple, replaced: list[fx.Node],
                 params: Iterable[fx.Node]) -> fx.Node:
    """``module`` put at ``path`` in ``gm`` and called on ``args`` in place of the nodes ``replaced`` (in graph order;
    the last gives the value the call gives), which are erased, with the ``params`` (``get_attr``) no node reads
    any longer. Returns the call; the caller recompiles ``gm``."""
    gm.add_submodule(path, module)
    with gm.graph.inserting_before(replaced[-1]):
        call = gm.graph.call_module(path, args)
    call.meta = dict(replaced[-1].meta)
    replaced[-1].replace_all_uses_with(call)
    for node in reversed(replaced):
        gm.graph.erase_node(node)
    for p in params:
        if not p.users:
            gm.graph.erase_node(p)
    return call


def called_modules(gm: fx.GraphModule) -> set[str]:
    """The module paths ``gm``'s graph calls (``call_module`` targets)."""
    return {n.target for n in gm.graph.nodes if n.op == "call_module"}
