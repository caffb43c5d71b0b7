"""Gradient clipping by the norm over every rank's parameters: what ``torch.nn.utils.clip_grad_norm_`` computes on
the whole model, when each rank holds only its own stages' parameters.

Each value is counted once, however many ranks hold it. A tied weight's copies on other stages' ranks are marked
``fxpipe_counted_elsewhere`` (:mod:`fxpipe.distributed.tied`). On a mesh, the ranks of one pipeline position (its
``dp × tp`` ranks) hold their stages' gradients as DDP replicas (whole, ``dp`` copies), FSDP2 shards (one each;
HSDP: ``dp_replicate`` copies), tensor-parallel shards (one each) or tp-replicated tensors (``tp`` copies):
:func:`mark_copies` writes on each parameter how many ranks hold its stage (``fxpipe_stage_ranks``), and each rank
adds its gradients' ``|g|^p`` divided by the copies of each: those ranks over the pieces the gradient's own
placements cut it into (a gradient may be placed otherwise than its parameter: GPT-2's replicated ``c_attn`` bias
gets a strided-sharded one). torchtitan gets the same norm from DTensor's ``full_tensor`` and a pp
all-reduce; this sum over ranks needs no per-parameter collective and covers DDP replicas, which are not DTensors.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm_", "mark_copies", "COPIES"]

COPIES = "fxpipe_stage_ranks"   # a Parameter attribute: how many ranks hold its stage (default 1)


def _distinct(param: torch.Tensor) -> int:
    """How many different pieces of ``param`` (a gradient) its DTensor mesh holds (1 for a plain tensor)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard   # FSDP2 over tp's dim-0 shards, GPT-2's
    if not isinstance(param, DTensor):                                   # c_attn: not a Shard subclass in torch 2.15
        return 1
    pieces = 1
    for i, placement in enumerate(param.placements):
        if isinstance(placement, (Shard, _StridedShard)):
            pieces *= param.device_mesh.size(i)
    return pieces


def mark_copies(parameters: Iterable[torch.Tensor], ranks_per_stage: int) -> None:
    """Write on each parameter how many ranks (``ranks_per_stage``) hold its stage."""
    for p in parameters:
        setattr(p, COPIES, ranks_per_stage)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    group: Any = None) -> torch.Tensor:
    """Scale this rank's gradients so that the norm over all ranks' gradients is at most ``max_norm``; return that
    norm (the same on every rank). Collective: every rank of ``group`` calls it, with its own parameters
    (``stage.parameters()`` of a ``PipelineRank``: each value counted once, module doc).
    ``group``: the ranks whose norm it is (default: every rank)."""
    params = [p for p in parameters if p.grad is not None]
    grads = [_local(p.grad) for p in params]
    counted = [(_local(p.grad), max(1, getattr(p, COPIES, 1) // _distinct(p.grad))) for p in params
               if not getattr(p, "fxpipe_counted_elsewhere", False)]
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        local = torch.stack([g.detach().abs().max().float().cpu() if g.numel() else torch.zeros(())
                             for g, _ in counted]).max() if counted else torch.zeros(())
        op = dist.ReduceOp.MAX
    else:   # sum of |g|^p over this rank, each piece divided by its copies; the p-th root after the sum over ranks
        local = sum((torch.linalg.vector_norm(g.detach().double(), norm_type).cpu() ** norm_type / copies
                     for g, copies in counted), torch.zeros((), dtype=torch.float64))
        op = dist.ReduceOp.SUM
    total = local.reshape(1).to(torch.float64)
    dist.all_reduce(total, op=op, group=group)
    norm = total[0] if norm_type == float("inf") else total[0] ** (1.0 / norm_type)
    coef = max_norm / (float(norm) + 1e-6)   # torch.nn.utils.clip_grad_norm_'s epsilon and clamp
    if coef < 1.0:
        for g in grads:
            g.detach().mul_(coef)
    return norm.to(torch.float32)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad
