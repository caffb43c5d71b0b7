"""Each stage's repeated blocks as the memory and time model of per-block recomputation sees them.

For every block (:func:`fxpipe.planning.blocks.repeated_blocks`, found once by the planner) a stage holds,
:func:`block_figures` records on the stage (``PlanStage.blocks``, saved in the plan) its position among the
model's blocks (``"blocks:K"`` recomputes the positions that are multiples of ``K``), the activations its
operations save, the bytes of the values it reads from the stage's other operations (what a checkpointed block
keeps instead; a value several blocks read, a rotary table or a mask, counted once), its forward seconds, and what
the ``"selective"`` mode keeps: the outputs of its matrix products and attention and their forward seconds
(recomputed: the rest). :func:`fxpipe.planning.memory_model.stage_bytes` and
:func:`~fxpipe.planning.memory_model.recompute_s` read them.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn

from fxpipe.planning.memory_model import block_mode, checkpointed
from fxpipe.planning.plan import Plan

__all__ = ["OPERATIONS", "block_figures", "kept_by_selective", "recompute_fractions"]

OPERATIONS = ("call_function", "call_method", "call_module")   # what a block's figures and its fusion count
# the graph-level names of what torch's selective policy keeps at dispatch
# (fxpipe.runtime.backward.block_recompute.KEPT_BY_SELECTIVE): matrix products, convolutions, attention
_KEPT = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "conv1d", "conv2d", "conv3d", "convolution",
         "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm", "einsum"}


def kept_by_selective(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether the ``"selective"`` mode keeps ``node``'s output (a matrix product, convolution or attention)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) or type(module).__name__ == "Conv1D"
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(target, "__name__", None) or str(target)
    return str(name).split(".")[-1] in _KEPT


def block_figures(gm: fx.GraphModule, costs: dict[str, Any], plan: Plan, blocks: dict[str, list[str]]) -> None:
    """Set ``blocks`` on each stage of ``plan``: the figures (module docstring) of the repeated blocks of ``gm``
    (``blocks``: :func:`~fxpipe.planning.blocks.repeated_blocks`) it holds, in order."""
    nodes = {n.name: n for n in gm.graph.nodes}
    stage_of = plan.stage_of()
    seen: dict[int, set[str]] = {}
    for st in plan.stages:
        st.blocks = []
    for position, names in enumerate(blocks.values()):
        by_stage: dict[int, list[fx.Node]] = {}
        for name in names:
            if nodes[name].op in OPERATIONS and name in stage_of:
                by_stage.setdefault(stage_of[name], []).append(nodes[name])
        for k, ops in by_stage.items():
            members = {n.name for n in ops}
            entering = {a.name for n in ops for a in n.all_input_nodes
                        if a.name not in members and a.op not in ("get_attr", "placeholder")
                        and stage_of.get(a.name) == k}
            new = entering - seen.setdefault(k, set())
            seen[k] |= entering
            kept = [n for n in ops if kept_by_selective(gm, n)]

            def total(field: str, of: list[fx.Node]) -> float:
                return float(sum(getattr(costs[n.name], field) for n in of if n.name in costs))
            plan.stages[k].blocks.append({
                "position": position, "act_bytes": total("act_bytes", ops),
                "input_bytes": float(sum(costs[a].output_bytes for a in new if a in costs)),
                "fwd_s": total("fwd_s", ops), "kept_bytes": total("output_bytes", kept),
                "kept_fwd_s": total("fwd_s", kept)})


def recompute_fractions(gm: fx.GraphModule, plan: Plan, blocks: dict[str, list[str]]) -> dict[str, float]:
    """Node name -> the share of its forward its backward recomputes on average, under its stage's mode:
    the checkpointed share of micro-batches for a whole-stage mode; 1 for the operations of the blocks (of
    ``blocks``, the graph's repeated blocks) a block mode recomputes (``"selective"``: those it does not keep;
    block modes are refused under a split backward)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out: dict[str, float] = {}
    for st in plan.stages:
        mode, m = st.checkpoint or plan.checkpoint, plan.chunks
        parsed = block_mode(mode)
        if parsed is None:
            share = sum(checkpointed(mode, i, m) for i in range(m)) / m
            out.update({name: share for name in st.nodes})
            continue
        every, selective = parsed
        mine = set(st.nodes)
        for position, names in enumerate(blocks.values()):
            if position % every:
                continue
            for name in names:
                node = nodes[name]
                if name in mine and node.op in OPERATIONS and not (selective and kept_by_selective(gm, node)):
                    out[name] = 1.0
    return out
