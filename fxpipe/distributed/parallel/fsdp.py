"""FSDP2 per pipeline stage: each of this rank's stage modules ``fully_shard``-ed over the data-parallel mesh.

:func:`apply_fsdp` wraps every stage module of this rank with ``torch.distributed.fsdp.fully_shard`` over the
``dp`` sub-mesh (1-D ``dp_shard``: FSDP; 2-D ``dp_replicate`` x ``dp_shard``: HSDP), each module its own FSDP
root. :class:`ShardedStages` drives it through a pipeline step the way ``torch.distributed.pipelining`` drives
FSDP2 (``stage.py``: ``backward_maybe_with_nosync``, ``start_gradient_reduction``):

- parameters are all-gathered once, by the step's first forward, and stay unsharded over every micro-batch
  (``reshard_after_forward=False``, ``set_reshard_after_backward(False)``): no all-gather per micro-batch;
- every backward, the split passes of ZB-H1/ZB-V too, only accumulates into the unsharded gradients
  (``set_requires_gradient_sync(False)``); with ``set_manual_backward_finalization(True)`` FSDP2's own hooks
  never end the backward iteration. fxpipe's runtime splits a backward by hand
  (:mod:`fxpipe.runtime.split_backward`): the input pass is an ``autograd.grad`` that fires FSDP2's
  post-backward hook before the weight gradients exist, and the weight pass a later ``autograd.backward`` into
  the unsharded parameters (``module.parameters()`` at that time): neither reduces anything here;
- :meth:`ShardedStages.reduce` (called once this rank's last backward and weight pass are over: the
  transport's ``when_local_done``, so while the other stages still drain) turns gradient sync and resharding
  on and calls ``finalize_backward()``: one reduce-scatter per parameter group per step (plus, under HSDP, one
  all-reduce over the replicas), leaving each rank's shard of the averaged gradient in the sharded
  parameters' ``.grad`` and the parameters sharded again until the next step's first forward.

The reduction averages over every data-parallel rank (FSDP2's default ``ReduceOp.AVG`` over the shard group and,
under HSDP, over the replicate group; no custom divide factor), exactly what ``DistributedDataParallel`` does on
the replicated path, so :class:`fxpipe.runtime.losses.Replicas` weighs micro-batches identically on both.
Every replica starts from dp rank 0's weights (broadcast before sharding, as DDP does). The mesh is made from
process groups with the step's ``timeout_s`` (``DeviceMesh.from_group``), so a collective with a dead replica
ends with an error, not a hang.
"""

from __future__ import annotations

import datetime
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ShardedStages", "apply_fsdp", "broadcast_states", "dp_mesh", "repoint"]


def dp_mesh(grid: list[list[int]], device_type: str, timeout_s: float) -> Any:
    """This rank's data-parallel ``DeviceMesh`` from the grid :meth:`ParallelDims.dp_ranks` gives (rows:
    replicas, columns: shards), on process groups whose waits end after ``timeout_s``: 1-D ``("dp_shard",)``
    for one row, 2-D ``("dp_replicate", "dp_shard")`` (HSDP) for several."""
    from torch.distributed.device_mesh import DeviceMesh
    me = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    row = next(r for r in grid if me in r)
    shard = dist.new_group(row, timeout=timeout, use_local_synchronization=True)
    if len(grid) == 1:
        return DeviceMesh.from_group(shard, device_type, mesh_dim_names=("dp_shard",))
    column = [r[row.index(me)] for r in grid]
    replicate = dist.new_group(column, timeout=timeout, use_local_synchronization=True)
    return DeviceMesh.from_group([replicate, shard], device_type, mesh=torch.tensor(grid),
                                 mesh_dim_names=("dp_replicate", "dp_shard"))


def apply_fsdp(modules: Iterable[nn.Module], mesh: Any) -> list[Any]:
    """``fully_shard`` each module over ``mesh`` (1-D: FSDP, 2-D replicate x shard: HSDP), parameters kept
    unsharded from a step's first forward to its :meth:`ShardedStages.reduce`; returns the ``FSDPModule`` s.
    Called after tensor parallelism (whose DTensor parameters FSDP2 then shards along ``dp``)."""
    from torch.distributed.fsdp import fully_shard
    out = []
    for module in modules:
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        module.set_manual_backward_finalization(True)   # this rank's schedule says when the step's backward ends
        out.append(module)
    return out


def broadcast_states(modules: Iterable[nn.Module], src: int, group: Any) -> None:
    """Every parameter and buffer of ``modules`` made ``src``'s over ``group`` (a tensor-parallel ``DTensor``: its
    local shard, the same shard on every rank of ``group``); tensors on ``meta`` are left alone."""
    from torch.distributed.tensor import DTensor
    with torch.no_grad():
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                if t.device.type != "meta":
                    dist.broadcast(t.to_local() if isinstance(t, DTensor) else t.data, src=src, group=group)


def repoint(holders: Iterable[nn.Module], replaced: dict[int, nn.Parameter]) -> None:
    """Put ``fully_shard``'s sharded parameters wherever ``holders`` (the model, the traced graph) held the ones
    they replace (by identity), so that lookups by name find the shards: ``named_parameters``, a tied weight's
    primary (:class:`fxpipe.runtime.tied.TiedCopy.primary`), checkpoints."""
    for holder in holders:
        for sub in holder.modules():
            for name, param in list(sub._parameters.items()):
                if param is not None and id(param) in replaced:
                    sub._parameters[name] = replaced[id(param)]


class ShardedStages:
    """This rank's stage modules under FSDP2 for a pipeline step: :meth:`begin` before it, :meth:`reduce` once
    its last backward is over. ``group`` (every data-parallel rank, replica-major) broadcasts dp rank 0's weights."""

    def __init__(self, modules: list[nn.Module], grid: list[list[int]], group: Any, device_type: str,
                 timeout_s: float, holders: Iterable[nn.Module] = (), mesh: Any = None) -> None:
        broadcast_states(modules, grid[0][0], group)   # every replica starts from the same weights, as DDP's do
        # ``mesh``: the dp dims sliced from the mesh that tensor parallelism's ``tp`` is sliced from (FSDP2 needs one
        # root for both); else groups of their own with ``timeout_s``
        self.mesh = mesh if mesh is not None else dp_mesh(grid, device_type, timeout_s)
        before = [dict(m.named_parameters()) for m in modules]
        self.modules = apply_fsdp(modules, self.mesh)
        repoint(holders, {id(old[name]): new for old, m in zip(before, self.modules)
                          for name, new in m.named_parameters()})

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()

    def begin(self) -> None:
        """Before a step: gradients only accumulate, parameters stay unsharded, until :meth:`reduce`."""
        for module in self.modules:
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_backward(False)

    def reduce(self) -> None:
        """After this rank's last backward and weight pass of the step: reduce-scatter (HSDP: and all-reduce) the
        accumulated gradients once, averaged over data parallelism, and reshard the parameters."""
        for module in self.modules:
            module.set_requires_gradient_sync(True)
            module.set_reshard_after_backward(True)
            module.finalize_backward()
