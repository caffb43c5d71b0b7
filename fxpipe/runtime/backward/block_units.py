"""Each repeated block of a stage as a module of its own that owns its parameters: the units FSDP2 shards one by one.

FSDP2 (``torch.distributed.fsdp.fully_shard``) gathers a module's parameters in a forward pre-hook, frees them
again after its forward and reduces their gradients after its backward, per module it was applied to. A traced
stage graph calls no block: it reads every parameter with ``get_attr``, so the whole stage is one unit, gathered
before its first operation and held to its last. torchtitan shards each transformer block, then the model as the
root for what lies outside the blocks, so that only a block or two is unsharded at a time and the next block's
all-gather overlaps the current block's compute. :func:`block_units` gives a stage graph the same structure.

It rewrites a stage in place: each block's operations (:func:`fxpipe.runtime.backward.block_recompute.block_spans`)
and the
``get_attr`` reads of the parameters and buffers that only those operations read are fused into one graph
(torch.fx's :func:`~torch.fx.passes.utils.fuser_utils.fuse_by_partitions`), run by a :class:`BlockUnit` installed
at the block's own path (``model.layers.3``) and called there by the stage graph. The unit and its graph share one
set of submodules and parameter slots (the stage's own, under that path), so:

- the stage's parameter names, ``state_dict`` and checkpoints are unchanged (``model.layers.3.mlp.up_proj.weight``);
- when FSDP2 swaps a parameter (sharded, unsharded) in its slot, the graph reads the swapped one.

A block some of whose parameters are read outside it (a weight tied across blocks), or whose operations call a
module outside it, stays in the stage graph (its parameters then belong to the stage's root unit).

The stage's per-block recomputation (``"blocks"``, ``"blocks:K"``, ``"selective"``:
:mod:`fxpipe.runtime.backward.block_recompute`) runs inside the unit: the block's graph under ``torch.utils.checkpoint``
within the FSDP2 unit, as torchtitan wraps a block in ``checkpoint_wrapper`` before ``fully_shard``. The rewrite
runs after tensor parallelism and in place of :func:`~fxpipe.runtime.backward.block_recompute.apply_recompute`
(:func:`apply_units`); stages that run compiled are not rewritten (FSDP2 then shards each stage whole).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch.fx as fx
from torch import nn
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from fxpipe.errors import FxpipeError
from fxpipe.planning.blocks import repeated_blocks
from fxpipe.planning.memory_model import block_mode
from fxpipe.runtime.backward.block_recompute import block_spans, selective_policy
from fxpipe.runtime.backward.recompute import checkpoint_stage

__all__ = ["BlockUnit", "apply_units", "block_units", "units_of"]

_DONE = "fxpipe_block_units"   # the stage module's meta key: the recomputation mode its units run
_PREFIX = "fxpipe_unit_"
_SHARED = ("_parameters", "_buffers", "_modules")


class BlockUnit(nn.Module):
    """One block of a stage: its fused graph, run whole or under activation checkpointing (``recompute``: ``None``,
    ``"full"`` or ``"selective"``). Its submodules and parameter slots are the block's own in the stage (shared with
    the graph, which is kept out of the module tree)."""

    def __init__(self, holder: nn.Module, graph: fx.GraphModule, recompute: str | None) -> None:
        super().__init__()
        for name in _SHARED:   # one set of slots: what FSDP2 swaps in here, the graph reads
            self.__dict__[name] = holder.__dict__[name]
            graph.__dict__[name] = holder.__dict__[name]
        self.__dict__["graph"] = graph
        self.recompute = recompute

    def forward(self, *args: Any) -> Any:
        graph = self.__dict__["graph"]
        if self.recompute is None:
            return graph(*args)
        return checkpoint_stage(graph, *args, preserve_rng_state=True,
                                policy=selective_policy if self.recompute == "selective" else None)


def _unit_part(stage: fx.GraphModule, path: str, part: dict[fx.Node, None]) -> dict[fx.Node, None] | None:
    """``part`` (a block's operations) with the ``get_attr`` reads of the block's own parameters and buffers, or
    ``None`` where the block cannot be a unit: something outside it reads one of them, one of its operations calls
    a module outside it, or the stage holds nothing of it."""
    prefix = path + "."
    try:
        stage.get_submodule(path)
    except AttributeError:
        return None
    if any(n.op == "call_module" and not str(n.target).startswith(prefix) for n in part):
        return None
    # what the stage reads of the block: parameters and buffers (torch.export), layers called whole (torch.fx)
    under = [n for n in stage.graph.nodes if n.op in ("get_attr", "call_module") and str(n.target).startswith(prefix)]
    if not under or any(n.op == "call_module" and n not in part for n in under):
        return None
    reads = [n for n in under if n.op == "get_attr"]
    if any(u not in part for n in reads for u in n.users):
        return None
    return {**{n: None for n in reads}, **part}


def block_units(stage: fx.GraphModule, blocks: dict[str, list[str]], mode: str | None = None) -> list[BlockUnit]:
    """Rewrite ``stage`` in place so that each of its blocks of ``blocks`` (block path -> node names, the whole
    model's, in order) runs as a :class:`BlockUnit`, those ``mode`` recomputes (a block mode, or ``None`` and
    whole-stage modes: none) under checkpointing; return the units."""
    parsed = block_mode(mode) if mode is not None else None
    done = stage.meta.get(_DONE)
    if done is not None:
        if done != (mode, ):
            raise FxpipeError(f"this stage module was made into block units for {done[0]!r}, not {mode!r}: build the "
                              "stages again")
        return units_of(stage)
    paths = list(blocks)
    found = [(b, _unit_part(stage, paths[b], part)) for b, part in block_spans(stage, list(blocks.values()))]
    found = [(b, part) for b, part in found if part is not None]
    stage.meta[_DONE] = (mode, )
    if not found:
        return []
    fuse_by_partitions(stage, [part for _, part in found], prefix=_PREFIX)
    for j, (b, _) in enumerate(found):
        _install(stage, f"{_PREFIX}{j}", paths[b], None if parsed is None or b % parsed[0] else
                 ("selective" if parsed[1] else "full"))
    stage.recompile()
    return units_of(stage)


def _install(stage: fx.GraphModule, fused: str, path: str, recompute: str | None) -> None:
    """The fused graph ``fused`` made the :class:`BlockUnit` at ``path``, where its call now points."""
    sub = getattr(stage, fused)
    for node in sub.graph.nodes:   # the block's reads, relative to the block
        if node.op in ("get_attr", "call_module"):
            node.target = str(node.target)[len(path) + 1:]
    holder = stage.get_submodule(path)
    unit = BlockUnit(holder, fx.GraphModule(holder, sub.graph), recompute)
    parent, _, name = path.rpartition(".")
    (stage.get_submodule(parent) if parent else stage)._modules[name] = unit
    delattr(stage, fused)
    for node in stage.graph.nodes:
        if node.op == "call_module" and node.target == fused:
            node.target = path


def units_of(stage: nn.Module) -> list[BlockUnit]:
    """The :class:`BlockUnit` s of ``stage``, in the model's order."""
    return [m for m in stage.modules() if isinstance(m, BlockUnit)]


def apply_units(graph_module: fx.GraphModule, stages: Iterable[tuple[fx.GraphModule, str | None]]) -> None:
    """Each ``(stage module, recomputation mode)`` of ``stages`` made into block units (:func:`block_units`), the
    blocks found once in ``graph_module`` (the whole traced model); a model without repeated blocks is left
    alone, unless a stage asks for a block mode (refused, as
    :func:`~fxpipe.runtime.backward.block_recompute.apply_recompute` refuses it)."""
    todo = list(stages)
    blocks = repeated_blocks(graph_module)
    if not blocks:
        modes = [mode for _, mode in todo if mode is not None and block_mode(mode) is not None]
        if modes:
            raise FxpipeError(f"checkpoint={modes[0]!r} recomputes per block, but this model has no repeated blocks "
                              "(children of one container, of one class, called in turn): use checkpoint='always' "
                              "or 'except_last' (whole stages)")
        return
    for module, mode in todo:
        block_units(module, blocks, mode if mode is not None and block_mode(mode) is not None else None)
