"""pp × dp: a plan's pipeline on the ``pp`` dimension of a ``DeviceMesh``, every stage replicated (DDP) or sharded
(FSDP2, HSDP) along the data-parallel dims.

``MeshPipelineRank(plan, model_fn, loss_fn, mesh=init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp")))``
(or ``mesh=ParallelDims(pp=..., dp_shard=...).build_mesh()``, :mod:`fxpipe.distributed.parallel.dims`) runs the
plan's ``pp`` workers as :class:`fxpipe.distributed.PipelineRank` over this rank's ``pp`` sub-group (so the same
schedule interpreter and transport as without dp), and each of the ``dp`` replicas of that pipeline trains its share
of the batch (``torch.tensor_split`` along the plan's batch dimensions: shares differ by at most one sample). The
mesh's dim names choose the data parallelism: ``"dp"`` replicates each stage with ``DistributedDataParallel``
(:mod:`fxpipe.distributed.parallel.ddp`: gradients accumulated locally, all-reduced once per step); ``"dp_shard"``
shards its parameters, gradients and optimizer state with FSDP2 ``fully_shard``
(:mod:`fxpipe.distributed.parallel.fsdp`: all-gathered once by the step's first forward, gradients accumulated
unsharded over every micro-batch and split weight pass, reduce-scattered once per step), and ``"dp_replicate"`` with
``"dp_shard"`` is HSDP. Both average over every data-parallel rank. The step weighs its micro-batches over the whole
batch (:class:`fxpipe.runtime.losses.Replicas`): a micro-batch of ``n`` samples counts ``dp * n / N`` of a mean, and
a token loss's count (``reduction="token"``, or ``"auto"`` finding an ``F.cross_entropy`` mean) is summed over the
replicas before any rank divides by it, so the gradients and the returned loss are the whole batch's, as one process
would compute them, even when the shares differ. Under ``"auto"`` the last stages' replicas also check their
reference samples against each other (:meth:`fxpipe.runtime.sample_mean_check.SampleMeanCheck.tie`) before they end
the step, so a loss whose samples weigh differently is refused on every rank even where each replica's own samples
weigh alike.

The reduction (all-reduce, or reduce-scatter) overlaps the pipeline's drain: it starts the moment this rank's own
operations of the step are over (the transport's ``when_local_done``), not when the whole pipeline's are, so a late
stage's gradients are reduced while the earlier stages still run their last backwards; only the first stage's
all-reduce, which ends the step, is not hidden. Before the gradients, the replicas all-reduce one flag saying
whether any of their steps failed, so no replica waits in the gradients' all-reduce for one that will never join it,
and every replica of a failed step raises. The ``dp`` group is made here with ``timeout_s`` as its timeout: a
replica that died ends the others' all-reduce with an error, not a hang (FSDP2's groups too:
:func:`fxpipe.distributed.parallel.fsdp.dp_mesh`). A tied weight's gradient is summed over the pp ranks that hold it
after the dp reduction (:mod:`fxpipe.distributed.tied`).

A ``tp`` dim (``("pp", "tp")``, ``("pp", "dp_shard", "tp")``, HSDP's ``("pp", "dp_replicate", "dp_shard",
"tp")``) shards this rank's stages with tensor parallelism first (:func:`fxpipe.distributed.parallel.tp.
shard_stages`, ``tp_plan=`` or the default plan), then FSDP2 shards their ``DTensor`` parameters along
``dp_shard`` (HSDP: and replicates them along ``dp_replicate``); a step that fails on a tensor-parallel rank raises
there with the rank and its tp group named. FSDP2 over TP needs both sub-meshes sliced from one root, so their
waits are the root mesh's groups': a mesh whose groups would wait longer than ``timeout_s`` (``init_device_mesh``'s
wait 30 minutes under gloo) is made again over groups of ``timeout_s`` (:mod:`fxpipe.distributed.parallel.bounded`;
a mesh from ``ParallelDims.build_mesh(timeout_s=...)`` is used as it is), so every wait of every dim ends after
``timeout_s``.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.distributed.parallel.bounded import bounded_mesh, mesh_timeout_s
from fxpipe.distributed.parallel.ddp import ReplicatedStages, SoloStages
from fxpipe.distributed.parallel.dims import ParallelDims
from fxpipe.distributed.parallel.fsdp import ShardedStages
from fxpipe.distributed.parallel.tp import shard_stages, sum_partial_grads, tp_mesh_of
from fxpipe.distributed.clip import mark_copies
from fxpipe.distributed.tied import COUNTED_ELSEWHERE
from fxpipe.distributed.rank import PipelineRank
from fxpipe.errors import FxpipeError, LossReductionError, PlanMismatchError
from fxpipe.planning.plan import Plan, load_plan
from fxpipe.runtime.losses import REDUCTIONS, Replicas
from fxpipe.runtime.microbatch import BatchLayout, scatter

__all__ = ["MeshPipelineRank"]


class MeshPipelineRank:
    """This rank's stages of ``plan`` in one of ``dp`` pipeline replicas; :meth:`step` trains its share of a batch
    and leaves the whole batch's gradients in ``.grad`` (averaged over ``dp``; under FSDP2 this rank's shard of
    them, in ``DTensor`` parameters). ``mesh`` is a ``DeviceMesh`` whose ``pp`` size is the plan's number of
    workers, with dims named ``("pp", "dp")`` (DDP), ``("pp", "dp_shard")`` (FSDP2) or ``("pp", "dp_replicate",
    "dp_shard")`` (HSDP), as :class:`fxpipe.distributed.parallel.ParallelDims` builds them. ``reduction`` is
    :meth:`fxpipe.Pipeline.step`'s (default ``"auto"``); other keywords go to :class:`PipelineRank`. The optimizer
    steps :meth:`parameters` (FSDP2: the local shards, so its state is sharded too). A ``tp`` dim last (``("pp",
    "tp")``, ``("pp", "dp_shard", "tp")``, ...) shards the stages' blocks over it (module doc); ``tp_plan`` (module
    path patterns → torch's ``ColwiseParallel``/``RowwiseParallel``) replaces the default plan."""

    def __init__(self, plan: Plan | str | Path, model_fn: Callable[[], nn.Module],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, *, mesh: Any, reduction: str = "auto",
                 tp_plan: dict[str, Any] | None = None, **rank_kwargs: Any) -> None:
        plan = load_plan(plan) if isinstance(plan, (str, Path)) else plan   # a plan or its path, as PipelineRank
        dims = ParallelDims.from_mesh(mesh)   # names that say pp and a data parallelism (or tp), or the fix
        if dims.tp > 1 and dims.dp > 1 and not dims.sharded:
            raise ValueError(f"mesh {mesh.mesh_dim_names} replicates tensor-parallel stages with "
                             "DistributedDataParallel, which fxpipe does not offer: shard them with FSDP2 instead "
                             "(ParallelDims(pp=..., dp_shard=..., tp=...).build_mesh())")
        if tp_plan is not None and dims.tp == 1:
            raise ValueError("tp_plan was given but the mesh has no 'tp' dimension: add one "
                             "(ParallelDims(pp=..., tp=...).build_mesh()) or drop tp_plan")
        if dims.pp != plan.workers:
            world, w = mesh.size(), plan.workers
            fix = (f"make the mesh ({w}, {world // w})" if world % w == 0 else
                   f"start a multiple of {w} processes (pp={w} times dp)")
            raise PlanMismatchError(f"the plan runs on {w} workers but the mesh's pp dimension has "
                                    f"{dims.pp} ranks: {fix}, or plan for {dims.pp} devices")
        if loss_fn is None:
            raise ValueError("MeshPipelineRank needs a loss_fn: training on the loss the model computes itself "
                             "(loss_fn=None) needs the token count over every dp replica, which only PipelineRank "
                             "(pp alone) combines today; pass loss_fn(output, target)")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        timeout_s = float(rank_kwargs.get("timeout_s", 300.0))
        both = dims.tp > 1 and dims.dp > 1   # FSDP2 over TP: both meshes sliced from this one (one root)
        if both:   # so their waits are the root's groups': made again where they would outlast timeout_s
            mesh = self._bounded(mesh, timeout_s)
        self.mesh, self.dims = mesh, dims
        grid = ParallelDims.dp_ranks(mesh)   # this rank's dp ranks: rows are replicas, columns shards
        flat = [r for row in grid for r in row]
        self.dp, self.dp_rank = dims.dp, flat.index(dist.get_rank())
        self.dp_group = dist.new_group(flat, timeout=datetime.timedelta(seconds=timeout_s),
                                       use_local_synchronization=True)
        self.timeout_s = timeout_s
        self.reduction = reduction
        self.loss_fn = loss_fn
        self.ranked = PipelineRank(plan, model_fn, loss_fn, group=mesh.get_group("pp"),
                                   reduction=reduction, **rank_kwargs)
        self.layout = BatchLayout.of(plan.batch_dims)
        own = [self.ranked.specs[k].module for k in self.ranked.own]
        # tensor parallelism, then data parallelism over it (FSDP2 shards the DTensor parameters along dp, as in
        # torchtitan); their shards replace the parameters: put them where the model and the traced graph name them
        holders = [self.ranked.model, self.ranked.pipe._graph[0]]
        elsewhere = {n for n, p in self.ranked.named_parameters() if getattr(p, COUNTED_ELSEWHERE, False)}
        self.tp_ranks: list[int] = []
        if dims.tp > 1:
            if self.ranked.pipe.compiled is not None:
                raise ValueError("tensor parallelism on compiled stages (the plan's or compile_stages=...) is not "
                                 "verified: pass compile_stages=False (CompileOptions(compile_stages=False)) with a "
                                 "'tp' mesh dim, or drop the 'tp' dim")
            tp_mesh = tp_mesh_of(mesh, timeout_s, from_root=both)
            self.tp_ranks = [int(r) for r in tp_mesh.mesh.flatten()]
            self.tp_plan = shard_stages(own, tp_mesh, tp_plan, model=self.ranked.model, holders=holders)
            self._tp_group = tp_mesh.get_group()
        if dims.tp > 1 and dims.dp == 1:
            self.data = SoloStages(own)   # no data parallelism: nothing to reduce
        elif dims.sharded:
            dp_sub = mesh[ParallelDims.dp_names(mesh)] if both else None
            self.data = ShardedStages(own, grid, self.dp_group, mesh.device_type, timeout_s, holders, dp_sub)
        else:
            self.data = ReplicatedStages(own, self.dp_group)
        # a global gradient norm (fxd.clip_grad_norm_) counts each piece once: the sharded parameters replaced the
        # ones a tied weight's marks were on
        for name, param in self.ranked.named_parameters():
            if name in elsewhere:
                setattr(param, COUNTED_ELSEWHERE, True)
        mark_copies(self.ranked.parameters(), dims.dp * dims.tp)
        # a per-head norm's weight (TPPlan.summed): the parameters FSDP2 left, resolved once
        summed = set(self.tp_plan.summed) if self.tp_ranks else set()
        self._summed = [p for n, p in self.ranked.named_parameters() if n in summed]
        # after the dp reduction: a tied weight's all-reduce over the pp ranks that hold it (fxpipe.distributed.tied),
        # which sums the dp-averaged gradients (FSDP2: this rank's shard of them; the owners hold the same shard)
        self._rank_done = self.ranked.pipe.transport.when_local_done
        self.ranked.pipe.transport.when_local_done = self._reduce_when_done
        self._reduced: BaseException | str | None = None
        # (start, end) wall-clock times of the last step's gradient all-reduce, comparable across processes
        self.all_reduce_s: tuple[float, float] | None = None

    @staticmethod
    def _bounded(mesh: Any, timeout_s: float) -> Any:
        """``mesh``, or where its groups wait longer than ``timeout_s`` (``init_device_mesh``'s: 30 minutes for
        gloo), the same mesh over groups of ``timeout_s`` (:mod:`fxpipe.distributed.parallel.bounded`)."""
        waits = mesh_timeout_s(mesh)
        if waits is not None and waits <= timeout_s:
            return mesh
        if mesh.size() != dist.get_world_size():   # only a mesh over the world can be made again by every rank
            raise ValueError(f"a ('pp', 'dp_shard', 'tp') mesh of {mesh.size()} of the {dist.get_world_size()} "
                             f"ranks whose groups wait {waits} s, longer than timeout_s={timeout_s:g}: make it "
                             "with ParallelDims(...).build_mesh(timeout_s=...) or bounded_mesh, or over every rank")
        return bounded_mesh(mesh.device_type, mesh.mesh, mesh.mesh_dim_names, timeout_s)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.ranked.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by their names in the model: under FSDP2, its shards (``DTensor`` s)."""
        return self.ranked.named_parameters()

    @property
    def model(self) -> nn.Module:
        return self.ranked.model

    def _share(self, inputs: Any, target: Any) -> tuple[tuple, Any, int, int]:
        """This replica's inputs and target, its samples and the batch's."""
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        names = [p.target for p in self.ranked.pipe.inputs.placeholders[:len(inputs)]]
        dims = [*self.layout.input_dims(names), self.layout.target]
        shares = scatter([*inputs, target], self.dp, dims)
        sizes = [t[-1].size(self.layout.target) for t in shares]
        mine = shares[self.dp_rank]
        return tuple(mine[:-1]), mine[-1], sizes[self.dp_rank], sum(sizes)

    def _wire_device(self) -> torch.device:
        device = next(iter(self.data.parameters()), torch.empty(0)).device
        return device if dist.get_backend(self.dp_group) == "nccl" else torch.device("cpu")

    def _sum_counts(self, count: Any) -> Any:
        """The step's token count summed over the replicas, divided by ``dp`` (DDP averages the gradients each
        replica divides by it); ``None`` where no replica has one. Every replica calls it after its all-reduce."""
        self._raise_if_not_reduced()
        got = torch.tensor([0.0 if count is None else float(count), 0.0 if count is None else 1.0],
                           dtype=torch.float64, device=self._wire_device())
        dist.all_reduce(got, group=self.dp_group)
        if got[1].item() == 0:
            return None
        if got[1].item() != self.dp:
            raise LossReductionError(
                f"rank {dist.get_rank()}: loss_fn returned a token loss ((loss_sum, count), or an F.cross_entropy/"
                f"F.nll_loss mean) on {int(got[1].item())} of the {self.dp} data-parallel replicas and a per-sample "
                "mean on the others: one step cannot weight its micro-batches both ways; return (loss_sum, count) "
                "on every replica and pass reduction='token'", stage=-1, micro_batch=-1, node=None)
        return got[0].item() / self.dp

    def _tie(self, auto: Any, failed: bool) -> BaseException | None:
        """On a last stage's rank: every replica's reference sample against replica 0's (``"auto"``'s check).
        All the last stages' replicas call it once per step, failed or not. Never raises: returns the refusal."""
        try:
            checker = auto.checker
            ref = None if failed or checker is None or auto.kind != "sample" else checker.references.get(None)
            gathered: list[Any] = [None] * self.dp
            dist.all_gather_object(gathered, None if ref is None else ref.to("cpu"), group=self.dp_group)
            if any(r is None for r in gathered):
                return None   # a failure, a token loss (counted over the replicas instead) or nothing checked
            checker.tie(auto.loss_fn, [r.to(ref.device) for r in gathered])
            return None
        except BaseException as exc:   # the refusal, or a failed exchange: this step fails on every rank
            return exc

    def _raise_if_not_reduced(self) -> None:
        if self._reduced == "failed":
            raise FxpipeError(f"rank {dist.get_rank()}: another dp replica of this rank's stages failed its step, "
                              "so the gradients were not reduced; that replica's processes report the error")
        if isinstance(self._reduced, BaseException):
            raise FxpipeError(f"rank {dist.get_rank()}: the reduction of this rank's gradients over its dp group "
                              f"failed ({type(self._reduced).__name__}: {self._reduced}); a replica that died or "
                              f"took longer than timeout_s={self.timeout_s:g} s ends it") from self._reduced
        if self._reduced is not None:
            raise FxpipeError(f"rank {dist.get_rank()}: the step ended without this rank's dp reduction "
                              f"({self._reduced})")

    def _reduce_when_done(self, failed: bool) -> None:
        """The transport's call once this rank's operations are over: reduce the gradients over ``dp``
        unless a replica's step failed. Never raises (the transport is ending its step); :meth:`step` does."""
        try:
            flag = torch.tensor([1.0 if failed else 0.0], device=self._wire_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_group)
            if flag.item() > 0:
                self._reduced = "failed"
            else:
                started = time.time()
                self.data.reduce()
                if self._summed:   # a per-head norm's weight: each tp rank summed its heads' gradients only
                    sum_partial_grads(self._summed, self._tp_group)
                self.all_reduce_s = (started, time.time())
                self._reduced = None
        except BaseException as exc:   # raised by step, after the transport has heard the other ranks
            self._reduced = exc
        if self._rank_done is not None:   # every owner of a tie calls it, failed or not (it never raises)
            self._rank_done(failed or self._reduced is not None)

    def step(self, inputs: Any, target: Any, **kwargs: Any) -> torch.Tensor | None:
        """One training step of the whole batch (the same ``inputs`` and ``target`` on every rank). Returns the
        whole batch's loss on every ``dp`` replica's last-stage rank (with ``broadcast_loss`` on every rank)."""
        inputs, target, mine, total = self._share(inputs, target)
        transport = self.ranked.pipe.transport
        transport.replicas = Replicas(self.dp, total, self._sum_counts, self._tie if self.ranked.last else None)
        self._reduced, self.all_reduce_s = "not run", None
        self.data.begin()
        try:
            loss = self.ranked.step(inputs, target, **kwargs)   # its transport all-reduces when this rank is done
        except Exception as exc:
            if not self.tp_ranks:
                raise
            raise FxpipeError(f"rank {dist.get_rank()}: its step failed ({type(exc).__name__}: {exc}); its stages "
                              f"are tensor-parallel with ranks {self.tp_ranks}, and one of them that failed or died "
                              "ends this rank's tp collectives: that rank's own error says why") from exc
        self._raise_if_not_reduced()
        if loss is None:
            return None
        whole = loss.detach() / self.dp   # this share's part of the batch's loss
        dist.all_reduce(whole, group=self.dp_group)
        return whole

