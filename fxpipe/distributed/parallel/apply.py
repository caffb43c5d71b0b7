"""Each parallelism of a mesh applied to one rank's pipeline stages, by a function of its own, as torchtitan's
``parallelize`` applies ``apply_tp`` then ``apply_fsdp``.

:class:`fxpipe.distributed.PipelineRank` builds this rank's stages over the mesh's ``pp`` group
(:class:`fxpipe.distributed.stages.RankStages`), then, in this fixed order:

1. :func:`apply_tensor_parallel`: the stages' blocks sharded over the ``tp`` dim
   (:func:`fxpipe.distributed.parallel.tp.shard_stages`; ``tp_plan=`` or the default plan), and with
   ``ParallelDims.sequence_parallel`` the activations between them by sequence
   (:mod:`fxpipe.distributed.parallel.sequence`); compiled stages are refused here (tensor parallelism on
   compiled stages is not verified);
2. recomputation and compilation are the plan's and were applied when the stages were built (the runtime's
   ``checkpoint=`` policy, ``compile_stages=``);
3. :func:`apply_data_parallel`: the (tensor-parallel) stages replicated with DDP, sharded with FSDP2, or both
   (HSDP) over the data-parallel dims (:mod:`fxpipe.distributed.parallel.ddp`, :mod:`.fsdp`), or nothing to
   reduce where the mesh has no data parallelism.

Each function puts the parameters it replaces (``DTensor`` s) wherever the model and the traced graph held the old
ones, so names still find them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fxpipe.distributed.parallel.ddp import ReplicatedStages, SoloStages
from fxpipe.distributed.parallel.dims import ParallelDims
from fxpipe.distributed.parallel.fsdp import ShardedStages
from fxpipe.distributed.parallel.tp import shard_stages, tp_mesh_of

__all__ = ["TensorParallel", "apply_data_parallel", "apply_tensor_parallel"]


@dataclass
class TensorParallel:
    """What :func:`apply_tensor_parallel` did: this rank's tp group and its ranks (empty without ``tp``), and the
    parameters whose gradients each tp rank holds only its heads' part of (summed once a step)."""

    ranks: list[int] = field(default_factory=list)
    group: Any = None
    plan: Any = None
    summed: list[nn.Parameter] = field(default_factory=list)


def apply_tensor_parallel(stages: Any, mesh: Any, dims: ParallelDims, tp_plan: dict[str, Any] | None,
                          timeout_s: float) -> TensorParallel:
    """Shard ``stages``' (:class:`fxpipe.distributed.stages.RankStages`) own modules over the mesh's ``tp`` dim;
    nothing where ``dims.tp`` is 1."""
    if dims.tp == 1:
        return TensorParallel()
    if stages.pipe.compiled is not None:
        raise ValueError("tensor parallelism on compiled stages (the plan's or compile_stages=...) is not "
                         "verified: pass compile_stages=False (CompileOptions(compile_stages=False)) with a "
                         "'tp' mesh dim, or drop the 'tp' dim")
    tp_mesh = tp_mesh_of(mesh, timeout_s, from_root=dims.dp > 1)
    own = [stages.specs[k].module for k in stages.own]
    pipeline = ([spec.module for spec in stages.specs], list(stages.own)) if dims.sequence_parallel else None
    planned = shard_stages(own, tp_mesh, tp_plan, model=stages.model, holders=[stages.model, stages.pipe._graph[0]],
                           pipeline=pipeline)
    return TensorParallel([int(r) for r in tp_mesh.mesh.flatten()], tp_mesh.get_group(), planned, [])


def apply_data_parallel(stages: Any, mesh: Any, dims: ParallelDims, grid: list[list[int]], group: Any,
                        timeout_s: float) -> Any:
    """``stages``' own modules replicated (DDP), sharded (FSDP2; HSDP for two dp dims) over ``group``, the
    data-parallel ranks of ``grid`` (rows replicas, columns shards), or left alone without data parallelism; the
    object whose ``begin()``/``reduce()`` a step calls. FSDP2 over tensor parallelism shards along the dp dims
    sliced from ``mesh`` itself (one root for both)."""
    own = [stages.specs[k].module for k in stages.own]
    if dims.dp == 1:
        return SoloStages(own)
    if dims.dp_mode == "replicate":
        return ReplicatedStages(own, group)
    dp_sub = mesh[ParallelDims.dp_names(mesh)] if dims.tp > 1 else None
    return ShardedStages(own, grid, group, mesh.device_type, timeout_s, [stages.model, stages.pipe._graph[0]],
                         dp_sub, pipelined=len(stages.specs) > 1, stage_ids=list(stages.own))
