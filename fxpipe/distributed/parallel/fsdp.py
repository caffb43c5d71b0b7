"""FSDP2 per pipeline stage and per block: this rank's stage modules ``fully_shard``-ed over the data-parallel mesh.

:func:`apply_fsdp` shards, as torchtitan's ``apply_fsdp`` does, each repeated block of a stage (its
:class:`fxpipe.runtime.backward.block_units.BlockUnit`, one FSDP2 unit each) and then the stage module itself, the root
unit of what lies outside the blocks (the embedding, the head, a stage without blocks), over the ``dp`` sub-mesh
(1-D ``dp_shard``: FSDP; 2-D ``dp_replicate`` x ``dp_shard``: HSDP). A block's parameters are all-gathered by its
own forward pre-hook, so on a GPU the next block's all-gather overlaps this block's compute (FSDP2's all-gather
stream), and only the root's all-gather stands before the first operation. :class:`ShardedStages` drives the
units through a pipeline step the way ``torch.distributed.pipelining`` drives FSDP2 (``stage.py``:
``backward_maybe_with_nosync``, ``start_gradient_reduction``):

- with a pipeline (``pp`` > 1), or under a split backward, parameters are all-gathered once, by the step's first
  forward, and stay unsharded over every micro-batch (torchtitan's ``reshard_after_forward=False`` with
  pipelining): no all-gather per micro-batch; without one (``pp=1``: FSDP alone, torchtitan's default) each
  block reshards after its forward and after its backward and is gathered again for its backward, so a rank
  holds one or two blocks unsharded at a time (:meth:`ShardedStages.begin`);
- every backward but a stage's last of the step, and every pass of ZB-H1/ZB-V, only accumulates into the
  unsharded gradients (``set_requires_gradient_sync(False)``); before a stage's last backward under the other
  schedules :meth:`ShardedStages.reduce_from_here` turns sync on, so each block's post-backward hook
  reduce-scatters its gradients as its backward ends, while the blocks before it still run theirs (as
  ``torch.distributed.pipelining`` syncs a stage's last backward); with ``set_manual_backward_finalization(True)``
  FSDP2's own hooks never end the backward iteration. fxpipe's runtime splits a backward by hand
  (:mod:`fxpipe.runtime.backward.split_backward`): the input pass is an ``autograd.grad`` that fires FSDP2's
  post-backward hook before the weight gradients exist, and the weight pass a later ``autograd.backward`` into
  the unsharded parameters (``module.parameters()`` at that time): neither reduces anything here;
- :meth:`ShardedStages.reduce` (called once this rank's last backward and weight pass are over: the
  transport's ``when_local_done``, so while the other stages still drain, and after the replicas agreed that
  none failed) turns gradient sync and resharding on and calls ``finalize_backward()``: it waits for the blocks'
  reduce-scatters and makes the rest (the root's; every unit's under a split backward), one per unit per step (plus, under HSDP, one all-reduce over the replicas), leaving each rank's shard of the averaged
  gradient in the sharded parameters' ``.grad`` and the parameters sharded again until the next step's first
  forward.

The reduction averages over every data-parallel rank (FSDP2's default ``ReduceOp.AVG`` over the shard group and,
under HSDP, over the replicate group; no custom divide factor), exactly what ``DistributedDataParallel`` does on
the replicated path, so :class:`fxpipe.runtime.losses.losses.Replicas` weighs micro-batches identically on both.
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

from fxpipe.distributed.parallel.expert_calls import is_expert_shard
from fxpipe.runtime.backward.block_units import units_of

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


def apply_fsdp(modules: Iterable[nn.Module], mesh: Any, mp_policy: Any = None) -> list[Any]:
    """``fully_shard`` each module's block units (:func:`fxpipe.runtime.backward.block_units.units_of`), then the module,
    over ``mesh`` (1-D: FSDP, 2-D replicate x shard: HSDP), with ``mp_policy`` (FSDP2's ``MixedPrecisionPolicy``:
    ``"bf16-mixed"``'s gathers bfloat16 parameters and reduces float32 gradients); returns the ``FSDPModule`` s (the
    roots). Called after tensor parallelism (whose DTensor parameters FSDP2 then shards along ``dp``) and the block
    units' rewrite."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    assert mp_policy is None or isinstance(mp_policy, MixedPrecisionPolicy)
    out = []
    for module in modules:
        # expert shards differ from rank to rank: expert parallelism reduces them (expert_parallel.ExpertGrads),
        # or FSDP2 over their peers, in units of their own made before (expert_fsdp: DTensors by now)
        ignored = {"ignored_params": shards} if (shards := {p for p in module.parameters() if is_expert_shard(p)
                                                            and not hasattr(p, "to_local")}) else {}
        for unit in units_of(module):
            fully_shard(unit, mesh=mesh, reshard_after_forward=False, **policy, **ignored)
        fully_shard(module, mesh=mesh, reshard_after_forward=False, **policy, **ignored)
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
                if t.device.type != "meta" and not is_expert_shard(t):   # expert parallelism's own
                    dist.broadcast(t.to_local() if isinstance(t, DTensor) else t.data, src=src, group=group)


def repoint(holders: Iterable[nn.Module], replaced: dict[int, nn.Parameter]) -> None:
    """Put ``fully_shard``'s sharded parameters wherever ``holders`` (the model, the traced graph) held the ones
    they replace (by identity), so that lookups by name find the shards: ``named_parameters``, a tied weight's
    primary (:class:`fxpipe.runtime.boundaries.tied.TiedCopy.primary`), checkpoints."""
    for holder in holders:
        for sub in holder.modules():
            for name, param in list(sub._parameters.items()):
                if param is not None and id(param) in replaced:
                    sub._parameters[name] = replaced[id(param)]


class ShardedStages:
    """This rank's stage modules under FSDP2 for a pipeline step: :meth:`begin` before it, :meth:`reduce` once
    its last backward is over. ``group`` (every data-parallel rank, replica-major) broadcasts dp rank 0's weights."""

    def __init__(self, modules: list[nn.Module], grid: list[list[int]], group: Any, device_type: str,
                 timeout_s: float, holders: Iterable[nn.Module] = (), mesh: Any = None, pipelined: bool = True,
                 stage_ids: list[int] | None = None, mp_policy: Any = None) -> None:
        broadcast_states(modules, grid[0][0], group)   # every replica starts from the same weights, as DDP's do
        # ``mesh``: the dp dims sliced from the mesh that tensor parallelism's ``tp`` is sliced from (FSDP2 needs one
        # root for both); else groups of their own with ``timeout_s``
        self.mesh = mesh if mesh is not None else dp_mesh(grid, device_type, timeout_s)
        before = [dict(m.named_parameters()) for m in modules]
        self.modules = apply_fsdp(modules, self.mesh, mp_policy)
        self.pipelined = pipelined   # a pipeline of several stages: blocks stay unsharded through the step
        self.stage_ids = list(range(len(self.modules))) if stage_ids is None else list(stage_ids)
        repoint(holders, {id(old[name]): new for old, m in zip(before, self.modules)
                          for name, new in m.named_parameters()})

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()

    def begin(self, split: bool = False) -> None:
        """Before a step (``split``: under a split backward): gradients only accumulate until :meth:`reduce`;
        parameters stay unsharded through the step in a pipeline and under a split backward (whose weight pass
        needs the parameters its input pass saw), and are resharded after each block's forward and backward
        otherwise (module docstring). The root unit stays unsharded from its forward to the reduction."""
        keep = self.pipelined or split
        for module in self.modules:
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_forward(not keep)
            module.set_reshard_after_forward(False, recurse=False)
            module.set_reshard_after_backward(not keep)
            module.set_reshard_after_backward(False, recurse=False)

    #: the step may reduce each block's gradients as its last backward ends (:meth:`reduce_from_here`)
    reduces_in_backward = True

    def reduce_from_here(self, stage: int) -> None:
        """Before ``stage``'s last backward of the step (not under a split backward): each of its units
        reduce-scatters its accumulated gradients and reshards as its backward ends (FSDP2's post-backward hook),
        overlapping the backwards of the blocks before it; :meth:`reduce` then waits for them and reduces the root's."""
        module = self.modules[self.stage_ids.index(stage)]
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
        module.set_reshard_after_backward(False, recurse=False)

    def reduce(self) -> None:
        """After this rank's last backward and weight pass of the step: reduce-scatter (HSDP: and all-reduce) the
        accumulated gradients once, averaged over data parallelism, and reshard the parameters."""
        for module in self.modules:
            module.set_requires_gradient_sync(True)
            module.set_reshard_after_backward(True)
            module.finalize_backward()
