"""Each parallelism of a mesh applied to one rank's pipeline stages, by a function of its own, as torchtitan's
``parallelize_llama`` applies ``apply_tp``, ``apply_ac``, ``apply_compile`` then ``apply_fsdp``.

:class:`fxpipe.distributed.PipelineRank` builds this rank's stages over the mesh's ``pp`` group
(:class:`fxpipe.distributed.stages.RankStages`), then calls :func:`parallelize`, which reads top to bottom, in
this fixed order:

1. :func:`apply_tensor_parallel`: the stages' blocks sharded over the ``tp`` dim
   (:func:`fxpipe.distributed.parallel.tp.shard_stages`; ``tp_plan=`` or the default plan), and with
   ``ParallelDims.sequence_parallel`` the activations between them by sequence
   (:mod:`fxpipe.distributed.parallel.sequence`); compiled stages are refused here (tensor parallelism on
   compiled stages is not verified);
2. :func:`~fxpipe.distributed.parallel.expert_parallel.apply_expert_parallel`: each mixture-of-experts layer's
   experts sharded over ``ep`` of the data-parallel ranks, their tokens exchanged by all-to-all, their gradients
   reduced over the ranks holding the same experts (data parallelism leaves them alone);
3. :func:`apply_recomputation`: per-block recomputation where the plan or ``checkpoint=`` asks for it
   (:mod:`fxpipe.runtime.backward.block_recompute`), under FSDP2 each block made a unit of its own that
   recomputes inside it (:mod:`fxpipe.runtime.backward.block_units`); whole-stage recomputation is the
   executor's, per micro-batch;
4. :func:`apply_compile`: ``torch.compile`` of each stage module where the plan's stages were compiled or
   ``CompileOptions.compile_stages`` asks (:mod:`fxpipe.runtime.execute.compiled`), on this rank's devices, after
   recomputation and before data parallelism (torchtitan's order); tensor parallelism refuses compiled stages, and
   FSDP2 makes block units of eager stages only;
5. :func:`apply_data_parallel`: the (tensor-parallel) stages replicated with DDP, sharded with FSDP2, or both
   (HSDP) over the data-parallel dims (:mod:`fxpipe.distributed.parallel.ddp`, :mod:`.fsdp`), or nothing to
   reduce where the mesh has no data parallelism; on a sharded mesh the expert shards first, each by FSDP2 over
   the data-parallel ranks holding the same experts (:mod:`.expert_fsdp`, torchtitan's ``dp_shard_mod_ep``);
6. :func:`count_once`: the marks a global gradient norm reads, so each piece of a parameter is counted once
   over the mesh (:mod:`fxpipe.distributed.clip`).

Without a mesh only recomputation applies. Each function puts the parameters it replaces (``DTensor`` s) wherever
the model and the traced graph held the old ones, so names still find them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxpipe.distributed.clip import mark_copies
from fxpipe.distributed.parallel.ddp import ReplicatedStages, SoloStages
from fxpipe.distributed.parallel.dims import ParallelDims
from fxpipe.distributed.parallel.expert_fsdp import apply_expert_fsdp
from fxpipe.distributed.parallel.expert_parallel import ExpertGrads, ExpertParallel, apply_expert_parallel
from fxpipe.distributed.parallel.fsdp import ShardedStages
from fxpipe.distributed.parallel.replicas import DataParallelStep
from fxpipe.distributed.parallel.tp import shard_stages, tp_mesh_of
from fxpipe.distributed.tied import COUNTED_ELSEWHERE
from fxpipe.frontend.precision import COMPUTE_DTYPE, is_mixed
from fxpipe.runtime.backward.block_recompute import apply_recompute
from fxpipe.runtime.execute.compiled import compile_stages
from fxpipe.runtime.backward.block_units import apply_units

__all__ = ["Parallelized", "TensorParallel", "apply_compile", "apply_data_parallel", "apply_recomputation", "apply_tensor_parallel",
           "count_once", "parallelize"]


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
                         dp_sub, pipelined=len(stages.specs) > 1, stage_ids=list(stages.own),
                         mp_policy=mixed_precision_policy(stages.plan.layout.precision))


def mixed_precision_policy(precision: str | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a plan's precision: ``"bf16-mixed"`` gathers bfloat16 parameters and
    reduces float32 gradients (torchtitan's ``param_dtype=bfloat16, reduce_dtype=float32``); ``None`` otherwise
    (the parameters' own dtype). Without FSDP2 the plan's graph computes with the same bfloat16 copies
    (:mod:`fxpipe.frontend.precision`)."""
    if not is_mixed(precision):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPE, reduce_dtype=torch.float32)


def apply_compile(stages: Any) -> None:
    """``torch.compile`` of ``stages``' own modules with the keyword arguments the stages were built for
    (``stages.pipe.compiled``); nothing for eager stages."""
    if stages.pipe.compiled is not None:
        compile_stages([stages.specs[k].module for k in stages.own], stages.pipe.compiled)


def apply_recomputation(stages: Any, units: bool) -> None:
    """Per-block recomputation of ``stages``' own modules where the plan or ``checkpoint=`` asks for it; with
    ``units`` (FSDP2, eager stages) every block made a module of its own that recomputes as asked."""
    pipe = stages.pipe
    (apply_units if units else apply_recompute)(
        pipe._graph[0], [(stages.specs[k].module, pipe.stage_checkpoint(k)) for k in stages.own])


def count_once(stages: Any, elsewhere: set[str], copies: int, tp: TensorParallel) -> None:
    """Mark ``stages``' parameters for a global gradient norm (:func:`fxpipe.distributed.clip_grad_norm_`): those
    named in ``elsewhere`` (a tied weight another rank counts) again, now that sharding replaced them, every one
    held by ``copies`` ranks, and the tensor-parallel plan's summed parameters resolved to the ones FSDP2 left."""
    for name, param in stages.named_parameters():
        if name in elsewhere:
            setattr(param, COUNTED_ELSEWHERE, True)
    mark_copies(stages.parameters(), copies)
    if tp.plan is not None:   # a per-head norm's weight: the parameter FSDP2 left, resolved once
        summed = set(tp.plan.summed)
        tp.summed = [p for n, p in stages.named_parameters() if n in summed]


@dataclass
class Parallelized:
    """What :func:`parallelize` applied: the tensor parallelism, and over a mesh this rank's data-parallel grid
    (rows replicas, columns shards), their process group and the stages' reducer (``None`` without a mesh)."""

    tp: TensorParallel
    grid: list[list[int]] = field(default_factory=list)
    group: Any = None
    data: Any = None
    experts: ExpertParallel = field(default_factory=ExpertParallel)


def parallelize(stages: Any, dims: ParallelDims | None, mesh: Any, tp_plan: dict[str, Any] | None,
                timeout_s: float) -> Parallelized:
    """Every parallelism of ``dims`` (the layout, :class:`ParallelDims`) on ``stages``
    (:class:`fxpipe.distributed.stages.RankStages`) over ``mesh``, in the order of the module docstring;
    ``dims`` ``None``: one pipeline, recomputation alone."""
    if dims is None:
        apply_recomputation(stages, units=False)
        apply_compile(stages)
        return Parallelized(TensorParallel())
    elsewhere = {n for n, p in stages.named_parameters() if getattr(p, COUNTED_ELSEWHERE, False)}
    grid = ParallelDims.dp_ranks(mesh)
    group = DataParallelStep.group_of(grid, timeout_s)
    tp = apply_tensor_parallel(stages, mesh, dims, tp_plan, timeout_s)
    experts = apply_expert_parallel(stages, dims, grid, timeout_s)
    apply_recomputation(stages, units=dims.dp_mode == "shard" and dims.dp > 1 and stages.pipe.compiled is None)
    apply_compile(stages)
    sharded = bool(experts.modules) and dims.dp_mode == "shard" and apply_expert_fsdp(
        stages, experts, grid, dims.dp, mixed_precision_policy(stages.plan.layout.precision))
    data = apply_data_parallel(stages, mesh, dims, grid, group, timeout_s)
    if experts.params and not sharded:
        data = ExpertGrads(data, experts, dims.dp)
    count_once(stages, elsewhere, dims.dp * dims.tp, tp)
    mark_copies(experts.params, dims.dp * dims.tp // experts.ep)   # each expert shard: on dp / ep ranks
    return Parallelized(tp, grid, group, data, experts)
