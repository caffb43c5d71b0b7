"""Recomputation per block: a stage's repeated blocks (a transformer's layers) each run under ``torch.utils.checkpoint``.

Beside the whole-stage modes (``"always"``, ``"except_last"``: a micro-batch keeps only the stage's inputs and
its backward recomputes the whole stage), a stage may recompute block by block, as torchtitan's activation
checkpointing does:

- ``"blocks"``: every block of the stage is checkpointed (torchtitan's ``full``): a micro-batch keeps each block's
  inputs and what lies outside the blocks, and its backward recomputes one block at a time;
- ``"blocks:K"``: every K-th block of the model (the blocks whose position in the model is a multiple of ``K``,
  torchtitan's selective ``layer`` mode with ``selective_ac_option=K``); the others keep everything;
- ``"selective"``: every block checkpointed with torch's selective policy
  (:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`): the outputs of the matrix products and
  of attention are kept, the cheap operations between them (norms, activations, rotary embeddings, residual
  adds) recomputed (torchtitan's selective ``op`` mode).

The blocks are the planner's (:func:`fxpipe.planning.blocks.repeated_blocks`: the children of one container,
of one class, called in turn). :func:`recompute_blocks` rewrites a stage module in place: each block's operations
are fused into one submodule with torch.fx's own pass (:func:`torch.fx.passes.utils.fuser_utils.fuse_by_partitions`)
and called through :func:`fxpipe.runtime.backward.recompute.checkpoint_stage` (so a block that updates a buffer, a
BatchNorm's statistics, replays it in its recomputation rather than updating it twice). The parameters stay where
they are: ``get_attr`` nodes are left outside the fused blocks and reach them as arguments, and a block's layers
(``call_module``) are the stage's own module objects, held by a wrapper that does not register them, so the
stage's ``state_dict``, ``named_parameters``, tensor parallelism's and FSDP2's parameter slots are unchanged.

It runs after tensor parallelism (which rewrites the stage graph's layer calls and shapes) and before the stage is
compiled (lazily, at its first call) or wrapped by FSDP2/DDP: :func:`apply_recompute`, called by
:func:`fxpipe.runtime.execute.assemble.build_pipeline` and :class:`fxpipe.distributed.PipelineRank`. A split backward
(ZB-H1, ZB-V) asks a checkpointed block for its saved tensors in both passes: torch's non-reentrant checkpoint
recomputes the block for each, so those schedules run it with the recomputation paid twice (as the time model
charges it).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.utils.checkpoint import CheckpointPolicy

from fxpipe.errors import FxpipeError
from fxpipe.planning.block_figures import OPERATIONS
from fxpipe.planning.blocks import repeated_blocks
from fxpipe.planning.memory_model import block_mode
from fxpipe.runtime.backward.recompute import checkpoint_stage

__all__ = ["recompute_blocks", "apply_recompute", "block_spans", "selective_policy", "KEPT_BY_SELECTIVE"]

_DONE = "fxpipe_block_recompute"   # the stage module's meta key: the mode it was rewritten for
_PREFIX = "fxpipe_recomputed_block_"

_aten = torch.ops.aten
# what the selective mode keeps (torchtitan's _save_list, less the collectives, which a traced stage does not hold)
KEPT_BY_SELECTIVE = frozenset(op for op in (
    getattr(_aten.mm, "default", None), getattr(_aten.addmm, "default", None), getattr(_aten.bmm, "default", None),
    getattr(_aten.baddbmm, "default", None), getattr(_aten.convolution, "default", None),
    *(getattr(getattr(_aten, name), "default", None) for name in (
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm",
        "_flash_attention_forward", "_efficient_attention_forward") if hasattr(_aten, name)),
) if op is not None)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torch's selective checkpoint policy: keep :data:`KEPT_BY_SELECTIVE`, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


class _Recomputed(nn.Module):
    """One fused block, called under activation checkpointing. The block is kept out of the module tree (its
    layers are the stage's own, registered there): nothing is added to the stage's state."""

    def __init__(self, block: fx.GraphModule, selective: bool) -> None:
        super().__init__()
        self.__dict__["block"] = block
        self.selective = selective

    def forward(self, *args: Any) -> Any:
        return checkpoint_stage(self.__dict__["block"], *args, preserve_rng_state=True,
                                policy=selective_policy if self.selective else None)


def block_spans(stage: fx.GraphModule, blocks: list[list[str]]) -> list[tuple[int, dict[fx.Node, None]]]:
    """Each block's span of the stage's operations, in the model's block order: every operation from the block's
    first to its last in graph order (``get_attr`` reads left outside). A span of a topological order is convex,
    so fusing it makes no cycle, also where a pass after tracing (tensor parallelism's module calls) added nodes
    inside a block under new names; spans never overlap. Each span with the index of its block in ``blocks``;
    blocks this stage does not run are left out."""
    order = list(stage.graph.nodes)
    where = {n.name: i for i, n in enumerate(order)}
    parts, end = [], -1
    for b, names in enumerate(blocks):
        found = [where[name] for name in names if name in where and order[where[name]].op in OPERATIONS]
        if not found:
            continue
        first, last = max(min(found), end + 1), max(found)
        part = {n: None for n in order[first:last + 1] if n.op in OPERATIONS}
        if part:
            parts.append((b, part))
        end = max(end, last)
    return parts


def recompute_blocks(stage: fx.GraphModule, blocks: dict[str, list[str]], mode: str) -> fx.GraphModule:
    """Rewrite ``stage`` in place so that its blocks of ``blocks`` (block path -> node names, the whole model's, in
    order) run under the block mode ``mode``; return it. Nothing changes for a stage that holds no block."""
    parsed = block_mode(mode)
    if parsed is None:
        raise ValueError(f"{mode!r} is not a block recomputation mode ('blocks', 'blocks:K', 'selective')")
    done = stage.meta.get(_DONE)
    if done is not None:
        if done != mode:
            raise FxpipeError(f"this stage module was set to recompute {done!r}, not {mode!r}: build the stages again")
        return stage
    every, selective = parsed
    chosen = [names for i, names in enumerate(blocks.values()) if i % every == 0]
    parts = [part for _, part in block_spans(stage, chosen)]
    stage.meta[_DONE] = mode
    if not parts:
        return stage
    fuse_by_partitions(stage, parts, prefix=_PREFIX)
    for name, child in list(stage.named_children()):
        if name.startswith(_PREFIX) and isinstance(child, fx.GraphModule):
            setattr(stage, name, _Recomputed(child, selective))
    stage.recompile()
    return stage


def apply_recompute(graph_module: fx.GraphModule, stages: Iterable[tuple[fx.GraphModule, str]]) -> None:
    """Each ``(stage module, mode)`` of ``stages`` with a block mode rewritten by :func:`recompute_blocks`, the
    blocks found once in ``graph_module`` (the whole traced model)."""
    todo = [(module, mode) for module, mode in stages if block_mode(mode) is not None]
    if not todo:
        return
    blocks = repeated_blocks(graph_module)
    if not blocks:
        raise FxpipeError(f"checkpoint={todo[0][1]!r} recomputes per block, but this model has no repeated blocks "
                          "(children of one container, of one class, called in turn): use checkpoint='always' "
                          "or 'except_last' (whole stages)")
    for module, mode in todo:
        recompute_blocks(module, blocks, mode)

