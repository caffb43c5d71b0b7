"""A stage graph's expert layers called as modules again, so that expert parallelism can send their tokens away.

``torch.export`` records the ATen operations of a mixture-of-experts layer's experts (the sort of the tokens by
expert, the grouped matrix products, the weighted sum over each token's experts), not the call
``experts(hidden_states, top_k_index, top_k_weights)`` (:mod:`fxpipe.frontend.experts`) that made them. Expert
parallelism needs that call: the tokens a rank routes to experts another rank holds must be sent there before the
experts run, and their outputs sent back after. :func:`restore_expert_calls` finds the operations each experts
module ran (every node whose ``nn_module_stack`` passes through the module's path), checks that they form one
region with the call's three inputs (the tokens, ``(T, H)`` floating; the chosen experts, ``(T, k)`` integer;
their weights, ``(T, k)`` floating) and one output, and replaces the region by a ``call_module`` of the module
put at that path: the operations the module's forward runs, so the stage computes what it computed before.
A graph torch.fx traced with the experts as a leaf calls them already: nothing to do there.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from fxpipe.distributed.parallel.module_calls import call_instead
from fxpipe.frontend.precision import compute_copy

__all__ = ["EXPERT_SHARD", "ExpertCallError", "is_expert_shard", "restore_expert_calls"]

#: a Parameter attribute: ``(ep rank, ep, experts)`` of an expert shard, which data parallelism leaves to expert
#: parallelism (:mod:`.expert_parallel`)
EXPERT_SHARD = "fxpipe_expert_shard"


def is_expert_shard(t: torch.Tensor) -> bool:
    """A parameter expert parallelism holds a shard of (data parallelism leaves it alone)."""
    return getattr(t, EXPERT_SHARD, None) is not None


class ExpertCallError(ValueError):
    """A stage that reads an experts module's parameters where fxpipe cannot find the module's call."""


def _paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [str(value[0]) for value in stack.values()]


def _is_size(node: fx.Node) -> bool:
    """A node of sizes (a ``SymInt`` an exported graph computes from shapes), which any stage may share."""
    val = node.meta.get("val")
    return isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool)


def _region(gm: fx.GraphModule, path: str) -> list[fx.Node]:
    """The experts' operations on tensors; their size arithmetic stays (the graph shares it between layers)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and path in _paths(n) and not _is_size(n)]


def _val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _call_inputs(path: str, outside: list[fx.Node]) -> tuple[fx.Node, fx.Node, fx.Node]:
    """The region's three inputs as the call takes them (module docstring); :class:`ExpertCallError` otherwise."""
    vals = {n: _val(n) for n in outside}
    index = [n for n, v in vals.items() if v is not None and v.dim() == 2 and not v.is_floating_point()]
    floats = [n for n, v in vals.items() if v is not None and v.is_floating_point()]
    if len(outside) == 3 and len(index) == 1 and len(floats) == 2:
        shape = vals[index[0]].shape
        weights = [n for n in floats if vals[n].shape == shape]
        tokens = [n for n in floats if vals[n].dim() == 2 and vals[n].shape[0] == shape[0] and n not in weights]
        if len(weights) == 1 and len(tokens) == 1:
            return tokens[0], index[0], weights[0]
    seen = ", ".join(f"{n.name}{tuple(vals[n].shape) if vals[n] is not None else ''}" for n in outside)
    raise ExpertCallError(
        f"the operations of the experts {path} read {len(outside)} values from outside ({seen}), not the three "
        "of a call experts(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)): fxpipe cannot send "
        "their tokens to other ranks; leave ep out (ep=1)")


def restore_expert_calls(gm: fx.GraphModule, paths: list[str],
                         module_at: Callable[[str, bool], nn.Module]) -> list[str]:
    """In ``gm`` (one stage), call the experts at each of ``paths`` that it runs as ``module_at(path, mixed)``
    (put at that path in ``gm``; ``mixed``: the region read the parameters through their bfloat16 compute copies,
    :mod:`fxpipe.frontend.precision`, as the module must). Returns the paths rewritten; ``gm`` is recompiled if
    any."""
    done = []
    for path in paths:
        region = _region(gm, path)
        if not region:
            continue
        inside = set(region)
        params = {a for n in region for a in n.all_input_nodes
                  if a.op == "get_attr" and str(a.target).startswith(path + ".")}
        outside = list(dict.fromkeys(a for n in region for a in n.all_input_nodes   # tensors: sizes stay
                                     if a not in inside and a not in params and _val(a) is not None))
        outputs = [n for n in region if any(u not in inside for u in n.users)]
        if len(outputs) != 1:
            raise ExpertCallError(f"the operations of the experts {path} give {len(outputs)} values to the rest of "
                                  "the stage, where the call experts(...) returns one: leave ep out (ep=1)")
        tokens, index, weights = _call_inputs(path, outside)
        mixed = any(n.target is compute_copy for n in region)
        # the call stands where the region's output was: its users then read the call
        last = outputs[0]
        ordered = [n for n in region if n is not last] + [last]
        call_instead(gm, path, module_at(path, mixed), (tokens, index, weights), ordered, params)
        done.append(path)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
