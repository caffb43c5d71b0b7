"""Replicated data parallelism per pipeline stage: ``DistributedDataParallel`` round this rank's stage modules.

The pipeline accumulates every micro-batch's gradients locally (DDP's hooks stay idle, as under ``no_sync``);
:meth:`ReplicatedStages.reduce` then has DDP's reducer all-reduce (and average over ``dp``) the accumulated
gradients once, in its buckets. DDP broadcasts replica 0's parameters and buffers at construction, so every
replica starts from the same weights. :class:`SoloStages` stands in where the mesh has no data parallelism
(``("pp", "tp")``): nothing to reduce.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fxpipe.distributed.parallel.expert_calls import is_expert_shard

__all__ = ["ReplicatedStages", "SoloStages"]


class ReplicatedStages:
    """This rank's stage modules replicated over ``group`` (every data-parallel rank)."""

    def __init__(self, modules: list[nn.Module], group: Any) -> None:
        together = nn.ModuleList(modules)
        # a rank whose stages hold no trained parameter (a first stage of masks and positions) has nothing to
        # reduce, and DDP refuses such a module: its replicas are left as they are
        trained = any(p.requires_grad and not is_expert_shard(p) for p in together.parameters())
        # expert shards differ from rank to rank: expert parallelism reduces them (expert_parallel.ExpertGrads)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            together, [n for n, p in together.named_parameters() if is_expert_shard(p)])
        self.ddp = DistributedDataParallel(together, process_group=group) if trained else None
        self.modules = together

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.modules.parameters()

    def begin(self, split: bool = False) -> None:
        """Nothing to set: DDP's hooks are armed only by :meth:`reduce`."""

    def reduce(self) -> None:
        """DDP's reducer all-reduces (and averages over ``dp``) the gradients the pipeline accumulated: armed by
        ``prepare_for_backward``, its hooks fire on a backward that adds zero to every parameter's gradient."""
        if self.ddp is None:
            return
        params = [p for p in self.ddp.parameters() if p.requires_grad and not is_expert_shard(p)]
        for p in params:
            if p.grad is None:   # a parameter no micro-batch reached still takes part in the all-reduce
                p.grad = torch.zeros_like(p)
        self.ddp.reducer.prepare_for_backward([])
        torch.autograd.backward([(p * 0).sum() for p in params])


class SoloStages:
    """This rank's stage modules where the mesh has no data parallelism (``("pp", "tp")``): nothing to reduce."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = nn.ModuleList(modules)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.modules.parameters()

    def begin(self, split: bool = False) -> None:
        """Nothing to set."""

    def reduce(self) -> None:
        """Nothing to reduce: the step's gradients are whole on this rank (tensor parallelism's own
        collectives made them so)."""
