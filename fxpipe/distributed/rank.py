"""``fxpipe.distributed.PipelineRank``: this process's part of a plan's run, on one pipeline or on a mesh.

Run one process per device of the run (``torchrun --nproc-per-node <devices per node>``, or any launcher that
initialises ``torch.distributed``). Without a mesh the processes are one pipeline: the process at the plan's
(node, local device) of a stage runs it (:mod:`fxpipe.distributed.placement`; one stage per process, several with
``interleaved-1f1b``). With a mesh (``pp`` × data parallel × ``tp``, the one the plan was made for by default)
each pipeline runs on the mesh's ``pp`` dim, and this rank's stages are built
(:func:`fxpipe.distributed.stages.build_stages`, a :class:`~fxpipe.distributed.stages.RankStages` record), then
parallelised in one fixed order, each by its own function
(:mod:`fxpipe.distributed.parallel.apply`, as torchtitan's ``parallelize``): tensor parallelism over ``tp``, then
DDP, FSDP2 or HSDP over the data-parallel dims. A step gives each data-parallel replica its share of the batch
(:mod:`fxpipe.distributed.parallel.replicas`) and leaves the whole batch's gradients, as one process computes them.

With ``weights=`` every process builds ``model_fn()`` without memory (on ``meta``; under torch.export as fake
CPU tensors: :func:`fxpipe.distributed.materialise.empty_model`), traces it there (the trace must give the plan's
fingerprint) and materialises only its own stages' parameters and buffers, read from the weights: no process ever
holds the whole model. Without, it builds the model for real and keeps only its own stages' tensors. The step is
:meth:`fxpipe.Pipeline.step` itself, the same schedule interpreter as in one process, with values and gradients
crossing ranks through :class:`fxpipe.distributed.transport.P2P`. Every rank is given the same batch
(``step(x, y)``, ``step(ids, labels=labels)``): a later stage may read a model input directly, and the
micro-batches' shapes tell each rank which boundary shapes it has already been sent.

A ``tp`` mesh dim with FSDP2 needs both sub-meshes sliced from one root, so their waits are the root mesh's
groups': a ``DeviceMesh`` whose groups would wait longer than ``timeout_s`` (``init_device_mesh``'s wait 30
minutes under gloo) is made again over groups of ``timeout_s`` (:mod:`fxpipe.distributed.parallel.bounded`), so
every wait of every dim ends after ``timeout_s``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.distributed.parallel.apply import parallelize
from fxpipe.distributed.parallel.bounded import bounded_mesh, mesh_timeout_s
from fxpipe.distributed.parallel.dims import ParallelDims
from fxpipe.distributed.parallel.replicas import DataParallelStep
from fxpipe.distributed.placement import rank_device_type
from fxpipe.distributed.stages import build_stages, train_step
from fxpipe.errors import FxpipeError, PlanMismatchError
from fxpipe.options import CompileOptions
from fxpipe.planning.memory_model import planned_mode
from fxpipe.planning.plan import Plan, load_plan
from fxpipe.runtime.losses.losses import REDUCTIONS
from solvers.layout import refusal

__all__ = ["PipelineRank"]


class PipelineRank:
    """This rank's stages of ``plan``; :meth:`step` trains one batch and returns the loss on the last stage's rank.

    ``plan`` is a :class:`fxpipe.Plan` or the path of a saved one; ``model_fn()`` builds the model (the same
    on every rank, e.g. from the same seed or checkpoint). The model is traced as the plan's was, with the
    plan's front end and its recorded example inputs' shapes (:func:`fxpipe.frontend.capture.capture_as_planned`):
    a Hugging Face model planned with ``torch.export`` runs here too. ``loss_fn=None`` trains on the loss the
    model computes itself (``step(ids, labels=labels)``, :meth:`fxpipe.Pipeline.step`), on a mesh too.

    ``mesh`` says how the processes run the plan: ``None`` (default) the layout the plan was made for
    (``plan.layout``, e.g. from ``fxpipe.plan(mesh="auto")``), or one pipeline over every process for a plan of
    one pipeline; a ``torch.distributed`` process group: one pipeline over its ranks (the others run something
    else); a spelling as ``fxpipe plan --mesh`` takes it (``"dp_shard=2,tp=2"``,
    ``"dp=2,dp_mode=replicate"``; ``"dp=1"`` runs one pipeline even where the plan has a mesh); a
    :class:`fxpipe.distributed.ParallelDims`; or a ``DeviceMesh`` with dims named ``("pp", "dp")`` (DDP),
    ``("pp", "dp_shard")`` (FSDP2), ``("pp", "dp_replicate", "dp_shard")`` (HSDP), each optionally with
    ``"tp"`` last. The mesh's ``pp`` size is the plan's workers. ``tp_plan`` (module path patterns → torch's
    ``ColwiseParallel``/``RowwiseParallel``) replaces the default tensor-parallel plan
    (:mod:`fxpipe.distributed.parallel.tp`). With a ``tp`` dim the activations between the blocks also run on
    sequence shards (sequence parallelism, :mod:`fxpipe.distributed.parallel.sequence`), as the plan's mesh says
    (``plan.layout.sequence_parallel``) or, for a mesh given here, unless it says ``sp=0``
    (``ParallelDims(sequence_parallel=False)``). On a mesh ``.grad`` holds the whole batch's gradients, averaged over
    data parallelism (FSDP2: this rank's shard of them, in ``DTensor`` parameters); the optimizer steps
    :meth:`parameters`.

    ``weights`` (a state dict, the path of a ``torch.save``'d one or a ``.safetensors`` file, or a
    ``torch.distributed.checkpoint`` directory) builds the model on ``meta`` instead and loads only this rank's
    tensors from there. ``loss_fn(output, target)`` and ``reduction`` are :meth:`fxpipe.Pipeline.step`'s: the loss
    runs on the last stage's rank, which sends the token count it found (``"auto"``, ``"token"``) to every rank at
    the step's end (summed over the data-parallel replicas on a mesh), before any rank's gradients are final; a
    loss that ``"auto"`` refuses ends every rank's step with the error, their gradients left as before it.
    ``device`` puts this rank's stages elsewhere than the plan says (e.g. ``cuda:<LOCAL_RANK>``); by default they
    run on the plan's device where this process has it, else on its own
    (:func:`fxpipe.distributed.placement.rank_devices`: a plan made for H100s from shapes runs on gloo CPU
    processes too, with a warning). ``timeout_s`` bounds every wait for another rank.
    ``checkpoint``: the recomputation (:meth:`fxpipe.Pipeline.step`'s modes, per block too); ``None`` (default) the
    plan's, as it was planned: each stage's chosen mode for ``checkpoint="auto"``, else the plan's mode.
    ``options`` (:class:`fxpipe.CompileOptions`, as ``fxpipe.compile`` takes them; every rank must be given the
    same): its ``compression`` compresses what crosses stage boundaries (``"int8"``, ``"topk:0.01"``,
    ``"fp16/int8"``, or a dict by stage); its ``compile_stages`` (``True``, a dict of ``torch.compile`` arguments,
    ``False``) compiles this rank's stage modules (:mod:`fxpipe.runtime.execute.compiled`), by default (``None``)
    as the plan's were (``plan.compiled``), eager for a plan of eager stages; its ``deferred_batch_norm``
    updates BatchNorm statistics once a batch; its ``leaf_modules`` are those the plan was made with, traced as one
    node each here too. Its planning fields do not apply to a plan already made.
    """

    def __init__(self, plan: Plan | str | Path, model_fn: Callable[[], nn.Module],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *, mesh: Any = None,
                 tp_plan: dict[str, Any] | None = None, reduction: str = "auto", checkpoint: str | None = None,
                 device: str | torch.device | None = None, timeout_s: float = 300.0, broadcast_loss: bool = False,
                 weights: Any = None, options: CompileOptions | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise FxpipeError("fxpipe.distributed needs torch.distributed initialised: run under torchrun and call "
                              "torch.distributed.init_process_group('gloo' or 'nccl') before PipelineRank")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        plan = load_plan(plan) if isinstance(plan, (str, Path)) else plan
        group = mesh if isinstance(mesh, dist.ProcessGroup) else None   # one pipeline over that group's ranks
        self.mesh, self.dims = _mesh("dp=1" if group is not None else mesh, plan, float(timeout_s))
        if tp_plan is not None and (self.dims is None or self.dims.tp == 1):
            raise ValueError("tp_plan was given but the mesh has no 'tp' dimension: add one "
                             "(mesh='tp=2', or ParallelDims(pp=..., tp=...)) or drop tp_plan")
        pp_group = group if self.mesh is None else self.mesh.get_group("pp")
        checkpoint = checkpoint or planned_mode(plan)
        self.ranked = build_stages(plan, model_fn, loss_fn, reduction=reduction, checkpoint=checkpoint,
                                   group=pp_group, device=device, timeout_s=timeout_s,
                                   broadcast_loss=broadcast_loss, weights=weights, options=options)
        parallel = parallelize(self.ranked, self.dims, self.mesh, tp_plan, float(timeout_s))
        self.tp, self.experts = parallel.tp, parallel.experts   # experts: this rank's share of ep (ep=1: none)
        self.replicas: DataParallelStep | None = None if parallel.data is None else DataParallelStep(
            self.ranked, parallel.grid, parallel.group, parallel.data, parallel.tp, float(timeout_s))

    # -- this rank's stages, as a user and the tools see them -------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self.ranked.model

    @property
    def pipe(self) -> Any:
        return self.ranked.pipe

    @property
    def own(self) -> list[int]:
        return self.ranked.own

    @property
    def specs(self) -> list[Any]:
        return self.ranked.specs

    @property
    def plan(self) -> Plan:
        return self.ranked.plan

    @property
    def rank(self) -> int:
        return self.ranked.rank

    @property
    def last(self) -> bool:
        return self.ranked.last

    @property
    def loss_fn(self) -> Any:
        return self.ranked.loss_fn

    @loss_fn.setter
    def loss_fn(self, value: Any) -> None:
        self.ranked.loss_fn = value

    @property
    def dp(self) -> int:
        """Data-parallel replicas of this rank's stages (1 without a mesh)."""
        return 1 if self.replicas is None else self.replicas.dp

    @property
    def dp_group(self) -> Any:
        """The data-parallel ranks' process group; ``None`` without data parallelism."""
        return None if self.replicas is None else self.replicas.group

    @property
    def tp_ranks(self) -> list[int]:
        return self.tp.ranks

    @property
    def all_reduce_s(self) -> tuple[float, float] | None:
        """(start, end) wall-clock times of the last step's gradient reduction over the replicas."""
        return None if self.replicas is None else self.replicas.all_reduce_s

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (each once): what its optimizer updates. A tied parameter that this rank's stages
        read is one of them (its copy, where another rank holds the model's own: :mod:`fxpipe.distributed.tied`);
        under FSDP2 and tensor parallelism, its shards (``DTensor`` s)."""
        return self.ranked.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by their names in the model (``model_fn()``'s ``named_parameters``): the ones its
        stage modules hold now (a ``DTensor`` where ``fully_shard`` or tensor parallelism replaced one)."""
        return self.ranked.named_parameters()

    def step(self, inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor | None:
        """One training step of the batch ``inputs`` (the model's input; a tuple for several) against
        ``target``, the same on every rank; ``.grad`` of this rank's parameters then holds the batch's gradients.
        Other keywords are :meth:`fxpipe.Pipeline.step`'s and the model's (``labels=labels``, or a dict batch as
        ``kwargs=batch``); on a mesh each data-parallel replica trains its share of all of them. Returns the whole
        batch's loss on the last stage's ranks (on every rank with ``broadcast_loss=True``), else ``None``."""
        if self.replicas is None:
            return train_step(self.ranked, inputs, target, **kwargs)
        return self.replicas.step(inputs, target, kwargs)


def _mesh(mesh: Any, plan: Plan, timeout_s: float) -> tuple[Any, ParallelDims | None]:
    """The ``DeviceMesh`` and degrees ``mesh`` (:class:`PipelineRank`) names, or ``(None, None)`` for one pipeline."""
    if isinstance(mesh, (str, dict)):
        dims, given = ParallelDims.from_spec(mesh, plan.workers), f"mesh={mesh!r}"
    elif isinstance(mesh, ParallelDims):
        dims, given = mesh, f"mesh={mesh}"
    elif mesh is None:
        try:
            dims = ParallelDims.planned(plan)
        except ValueError as exc:
            raise PlanMismatchError(f"the plan's mesh: {exc}; pass mesh= with one fxpipe runs") from exc
        given = f"the plan's mesh ({dims}; mesh='dp=1' runs one pipeline instead)"
    else:
        return _user_mesh(mesh, plan, timeout_s)
    if dims is None or (dims.dp == 1 and dims.tp == 1):
        return None, None
    _refuse_ddp_over_tp(dims, given)
    if (why := refusal(dims.layout, workers=plan.workers)) is not None:
        raise PlanMismatchError(f"{given}: {why.message}")
    try:
        built = dims.build_mesh(rank_device_type([st.device for st in plan.stages]), timeout_s=timeout_s)
    except ValueError as exc:
        raise PlanMismatchError(f"{given}: {exc}") from exc
    return built, dims


def _user_mesh(mesh: Any, plan: Plan, timeout_s: float) -> tuple[Any, ParallelDims]:
    """A ``DeviceMesh`` the user made: its degrees checked against the plan, its waits bounded by ``timeout_s``."""
    dims = ParallelDims.from_mesh(mesh)   # names that say pp and a data parallelism (or tp), or the fix
    _refuse_ddp_over_tp(dims, f"mesh {mesh.mesh_dim_names}")
    if dims.pp != plan.workers:
        world, w = mesh.size(), plan.workers
        fix = (f"make the mesh ({w}, {world // w})" if world % w == 0 else
               f"start a multiple of {w} processes (pp={w} times dp)")
        raise PlanMismatchError(f"the plan runs on {w} workers but the mesh's pp dimension has "
                                f"{dims.pp} ranks: {fix}, or plan for {dims.pp} devices")
    if dims.tp > 1 and dims.dp > 1:   # FSDP2 over TP: both meshes sliced from this one, so their waits are its
        mesh = _bounded(mesh, timeout_s)
    return mesh, dims


def _refuse_ddp_over_tp(dims: ParallelDims, given: str) -> None:
    """A layout the runtime does not run (:func:`solvers.layout.refusal`: DDP over tensor-parallel stages, the
    pipeline not outermost), whichever way it was given, refused naming the fix."""
    why = refusal(dims.layout)
    if why is not None:
        raise ValueError(f"{given}: {why.message}")


def _bounded(mesh: Any, timeout_s: float) -> Any:
    """``mesh``, or where its groups wait longer than ``timeout_s`` (``init_device_mesh``'s: 30 minutes for gloo),
    the same mesh over groups of ``timeout_s`` (:mod:`fxpipe.distributed.parallel.bounded`)."""
    waits = mesh_timeout_s(mesh)
    if waits is not None and waits <= timeout_s:
        return mesh
    if mesh.size() != dist.get_world_size():   # only a mesh over the world can be made again by every rank
        raise ValueError(f"a ('pp', 'dp_shard', 'tp') mesh of {mesh.size()} of the {dist.get_world_size()} "
                         f"ranks whose groups wait {waits} s, longer than timeout_s={timeout_s:g}: make it "
                         "with ParallelDims(...).build_mesh(timeout_s=...) or bounded_mesh, or over every rank")
    return bounded_mesh(mesh.device_type, mesh.mesh, mesh.mesh_dim_names, timeout_s)
