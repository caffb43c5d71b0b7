"""Expert shards sharded by FSDP2 over the data-parallel ranks that ``ep`` leaves (torchtitan's ``dp_shard_mod_ep``).

Expert parallelism (:mod:`.expert_parallel`) gives each rank of an ep group ``E / ep`` experts of every layer; the
``dp / ep`` ranks holding the same experts (its *peers*) would each keep a whole copy of them. On a sharded
data-parallel mesh (``dp_mode`` shard: FSDP2 or HSDP for the rest) :func:`apply_expert_fsdp` ``fully_shard`` s
each :class:`~.expert_parallel.ExpertShard` over its peers instead, as torchtitan's ``apply_fsdp`` shards
``moe.experts`` over the mesh without ``ep``: each rank keeps ``1 / (dp / ep)`` of its experts' parameters,
gradients and optimizer state, FSDP2 all-gathers them for the forward (its pre-forward hook on the shard's call)
and reduce-scatters their gradients. The shards are wrapped before their stage's blocks and root
(:func:`.fsdp.apply_fsdp`), so those units leave them to their own unit, and the stage's driver
(:class:`.fsdp.ShardedStages`) drives them with the rest (``set_requires_gradient_sync`` and the resharding
settings recurse; ``finalize_backward`` finishes every unit of the root).

The reduction sums over the peers and divides by ``dp`` (``set_gradient_divide_factor``; a plain sum then a
division, ``set_force_sum_reduction_for_comms``, which gloo runs as NCCL does), as
:class:`~.expert_parallel.ExpertGrads` does for replicated shards: each expert's gradient already sums the tokens
of its whole ep group, and every rank's gradients weigh its share of the batch ``dp`` times. A checkpoint sees
each shard as the ``DTensor`` it is a piece of over the 2-D mesh ``(ep, peers)``
(:func:`~.expert_parallel.global_view`): ``Shard(0)`` over ``ep`` then ``Shard(0)`` over the peers, FSDP2's own
dim-0 chunks of the rank's experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fxpipe.distributed.parallel.expert_parallel import EXPERT_SHARD, ExpertParallel
from fxpipe.distributed.parallel.fsdp import repoint

__all__ = ["apply_expert_fsdp"]


def apply_expert_fsdp(stages: Any, experts: ExpertParallel, grid: list[list[int]], dp: int,
                      mp_policy: Any = None) -> bool:
    """``fully_shard`` each expert shard of ``stages`` over its peers (module docstring) where there are several
    (``dp > ep``); ``experts.params`` then name the sharded parameters. Returns whether it sharded."""
    peers = dp // experts.ep
    if not experts.modules or peers == 1:
        return False
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    device = next(experts.modules[0].parameters()).device.type
    device = "cpu" if device == "meta" else device
    peers_mesh = DeviceMesh.from_group(experts.peers, device, mesh_dim_names=("dp_experts",))
    both = _ep_by_peers(grid, experts, device)
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    replaced: dict[int, nn.Parameter] = {}
    for module in experts.modules:
        before = dict(module.named_parameters())
        fully_shard(module, mesh=peers_mesh, reshard_after_forward=False, **policy)
        module.set_gradient_divide_factor(float(dp))
        module.set_force_sum_reduction_for_comms(True)   # sum, then divide: gloo has no PREMUL_SUM
        for name, param in module.named_parameters():
            setattr(param, EXPERT_SHARD, dataclasses.replace(getattr(before[name], EXPERT_SHARD), mesh=both))
            replaced[id(before[name])] = param
    repoint([stages.model, stages.pipe._graph[0]], replaced)
    experts.params = [p for m in experts.modules for p in m.parameters()]
    return True


def _ep_by_peers(grid: list[list[int]], experts: ExpertParallel, device: str) -> Any:
    """The 2-D ``("ep", "dp_experts")`` mesh of the data-parallel ranks: ``mesh[e][p]`` holds expert slice ``e``'s
    ``p``-th piece (ranks in replica-major order form ``dp / ep`` ep groups of adjacent ranks)."""
    from torch.distributed.device_mesh import DeviceMesh
    flat = [r for row in grid for r in row]
    ep = experts.ep
    mesh = torch.tensor(flat).view(len(flat) // ep, ep).t().contiguous()
    return DeviceMesh.from_group([experts.group, experts.peers], device, mesh=mesh,
                                 mesh_dim_names=("ep", "dp_experts"))
