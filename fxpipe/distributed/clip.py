"""Gradient clipping by the norm over every rank's parameters: what ``torch.nn.utils.clip_grad_norm_`` computes on
the whole model, when each rank holds only its own stages' parameters."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    group: Any = None) -> torch.Tensor:
    """Scale this rank's gradients so that the norm over all ranks' gradients is at most ``max_norm``; return that
    norm (the same on every rank). Collective: every rank of ``group`` calls it, with its own parameters
    (``stage.parameters()``: each parameter on one rank, or a tied one on each rank whose stages read it, counted
    by the first of them only: :mod:`fxpipe.distributed.tied`)."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    counted = [p.grad for p in params if not getattr(p, "fxpipe_counted_elsewhere", False)]
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        local = torch.stack([g.detach().abs().max().float().cpu() for g in counted]).max() if counted else torch.zeros(())
        op = dist.ReduceOp.MAX
    else:   # sum of |g|^p over this rank; the p-th root after the sum over ranks
        local = sum((torch.linalg.vector_norm(g.detach().float(), norm_type).cpu() ** norm_type for g in counted),
                    torch.zeros((), dtype=torch.float32))
        op = dist.ReduceOp.SUM
    total = local.reshape(1).to(torch.float64)
    dist.all_reduce(total, op=op, group=group)
    norm = total[0] if norm_type == float("inf") else total[0] ** (1.0 / norm_type)
    coef = max_norm / (float(norm) + 1e-6)   # torch.nn.utils.clip_grad_norm_'s epsilon and clamp
    if coef < 1.0:
        for g in grads:
            g.detach().mul_(coef)
    return norm.to(torch.float32)
