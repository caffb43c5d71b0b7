"""This process's stages of a plan over one pipeline's ranks (the ``pp`` group), trained with the plan's schedule.

:class:`RankStages` is the pipeline part of :class:`fxpipe.distributed.PipelineRank`, which applies tensor and
data parallelism to it where a mesh asks for them (:mod:`fxpipe.distributed.rank`).

Run one process per device of the plan (``torchrun --nproc-per-node <devices per node>``, or any launcher
that initialises ``torch.distributed``); the process at the plan's (node, local device) of a stage runs it
(:mod:`fxpipe.distributed.placement`; one stage per process, several with ``interleaved-1f1b``). With
``weights=`` every process builds ``model_fn()`` without memory (on ``meta``; under torch.export, whose trace
records the device of the tensors a forward creates, as fake CPU tensors:
:func:`fxpipe.distributed.materialise.empty_model`), traces it there (the trace must give the plan's
fingerprint) and materialises only its own stages' parameters and buffers, read from the weights
(:mod:`fxpipe.distributed.materialise`): no process ever holds the whole model. Without, it builds the model
for real and keeps only its own stages' tensors: the others' become ``meta`` tensors, which hold no memory. The step is
:meth:`fxpipe.Pipeline.step` itself, the same schedule interpreter as in one process, with values and
gradients crossing ranks through :class:`fxpipe.distributed.transport.P2P`.

Every rank is given the same batch (``step(x, y)``): a later stage may read a model input directly, and
the micro-batches' shapes tell each rank which boundary shapes it has already been sent.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.distributed.materialise import empty_model, is_empty, materialise
from fxpipe.distributed.placement import rank_devices, stage_ranks, world_mismatch
from fxpipe.distributed.tied import RankTies, install_representatives
from fxpipe.distributed.transport import P2P
from fxpipe.distributed.weights import open_weights
from fxpipe.errors import FxpipeError, PlanMismatchError
from fxpipe.frontend.capture import capture_as_planned
from fxpipe.frontend.precision import check_precision
from fxpipe.options import CompileOptions, stage_compile_kwargs
from fxpipe.planning.plan import Plan, load_plan
from fxpipe.runtime.execute.batchnorm import convert_deferred_batch_norm
from fxpipe.runtime.execute.codegen import StageSpec, move_stage, split_graph
from fxpipe.runtime.execute.compiled import (planned_compilation,
                                             refuse_split_backward)
from fxpipe.runtime.boundaries.compression import BoundaryCompression
from fxpipe.runtime.execute.pipeline import Pipeline
from fxpipe.runtime.boundaries.tied import TiedWeights

__all__ = ["RankStages", "build_stages", "train_step"]


def _drop(module: nn.Module, keep: set[int]) -> None:
    """Replace every parameter and buffer of ``module`` not in ``keep`` (by id) with a ``meta`` tensor."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) not in keep and param.device.type != "meta":
                sub._parameters[name] = nn.Parameter(_meta(param), param.requires_grad)
        for name, buf in list(sub._buffers.items()):
            if buf is not None and id(buf) not in keep and buf.device.type != "meta":
                sub._buffers[name] = _meta(buf)


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A plain ``meta`` tensor shaped as ``t`` (also where ``t`` is a fake one: ``weights=`` under torch.export)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if is_empty(t) else t.detach().to("meta")


@dataclass
class RankStages:
    """This rank's stages of a plan in the pipeline of one ``pp`` group, as :func:`build_stages` made them: the
    model (only this rank's tensors real), the stage modules and which are this rank's (``own``), the
    :class:`fxpipe.Pipeline` that runs them with the transport, the tied weights' bookkeeping, the loss and whether
    this rank holds the last stage. :class:`fxpipe.distributed.PipelineRank` parallelises and steps it."""

    plan: Plan
    model: nn.Module
    rank: int
    own: list[int]
    specs: list[StageSpec]
    pipe: Pipeline
    ties: RankTies
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    reduction: str
    broadcast_loss: bool
    last: bool = False
    slots: dict[tuple[int, str], str] = field(default_factory=dict)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (each once): what its optimizer updates. A tied parameter that this rank's stages
        read is one of them (its copy, where another rank holds the model's own: :mod:`fxpipe.distributed.tied`)."""
        seen: set[int] = self.pipe.tied.replicas()
        for k in self.own:
            for param in self.specs[k].module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by their names in the model (``model_fn()``'s ``named_parameters``): the ones its
        stage modules hold now (a ``DTensor`` where ``fully_shard`` or tensor parallelism replaced one)."""
        seen: set[int] = set()
        for k in self.own:
            for local, param in self.specs[k].module.named_parameters():
                if (k, local) in self.slots and id(param) not in seen:
                    seen.add(id(param))
                    yield self.slots[(k, local)], param


def build_stages(plan: Plan | str | Path, model_fn: Callable[[], nn.Module],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *, reduction: str = "auto",
                 checkpoint: str = "except_last", group: Any = None, device: str | torch.device | None = None,
                 timeout_s: float = 300.0, broadcast_loss: bool = False, weights: Any = None,
                 options: CompileOptions | None = None) -> RankStages:
    """This rank's stages of ``plan`` in the pipeline of ``group`` (module docstring); the arguments are
    :class:`fxpipe.distributed.PipelineRank`'s."""
    if not dist.is_available() or not dist.is_initialized():
        raise FxpipeError("fxpipe.distributed needs torch.distributed initialised: run under torchrun and call "
                          "torch.distributed.init_process_group('gloo' or 'nccl') before PipelineRank")
    options = options or CompileOptions()   # its codec names were checked when it was made
    compression, compile_stages = options.compression, options.compile_stages
    plan = load_plan(plan) if isinstance(plan, (str, Path)) else plan
    compiled = (stage_compile_kwargs(compile_stages) if compile_stages is not None else
                planned_compilation(plan.compiled))
    refuse_split_backward(plan.schedule, compiled)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mismatch = world_mismatch(plan, world)
    if mismatch is not None:
        raise mismatch
    source = open_weights(weights) if weights is not None else None   # a bad path fails before any build
    tracing: Any = contextlib.nullcontext()
    if source is not None:   # nothing allocated (meta, or fake under torch.export): this rank's become real below
        model, tracing = empty_model(model_fn, plan.frontend)
    else:
        model = model_fn()
    check_precision(plan.layout.precision, model, f"rank {rank}: ")
    with tracing:   # bf16-mixed: traced and rewritten as the plan's graph was
        captured = capture_as_planned(model, plan.frontend, options.leaf_modules, precision=plan.layout.precision)
    if captured.fingerprint != plan.fingerprint:
        raise PlanMismatchError(f"rank {rank}: " + (captured.dtype_mismatch(plan.profile.get("dtype")) or
            f"the plan was made for another model ({plan.model}, fingerprint "
            f"{plan.fingerprint[:12]}) but model_fn() traces to {captured.fingerprint[:12]}; plan this model "
            "(fxpipe.compile or fxpipe.plan, then plan.save) and load that plan on every rank"))
    if options.deferred_batch_norm:
        convert_deferred_batch_norm(captured.graph)
    p = len(plan.stages)
    stage_rank = stage_ranks(plan, rank, world, group)
    # a parameter several stages read (a tied weight): a copy in each later reading stage
    # (fxpipe.runtime.boundaries.tied), each owning rank's own parameter, all-reduced over the owners (fxpipe.distributed.tied)
    specs = split_graph(captured.graph, plan.stage_of(), p, copies=True)
    own = [k for k in range(p) if stage_rank[k] == rank]
    tied = TiedWeights([s.module for s in specs], local=lambda k: k in own)
    install = install_representatives(tied, [captured.graph, model])
    keep = {id(t) for k in own for t in [*specs[k].module.parameters(), *specs[k].module.buffers()]}
    for k in range(p):   # another rank's stages keep nothing real here
        if k not in own:
            _drop(specs[k].module, keep)
    _drop(captured.graph, keep)
    _drop(model, keep)   # the model's modules the trace did not keep (a tied head read through get_attr)
    install()   # this rank's copy of a tied parameter whose first reader is another rank's, under its names
    devices = [torch.device(device) if device is not None and k in own else planned
               for k, planned in enumerate(rank_devices([st.device for st in plan.stages]))]
    if source is not None:
        followers = tied.replicas()   # a second copy on this rank: made from the first once that is loaded
        tensors = {id(t): (t, devices[k]) for k in own
                   for t in [*specs[k].module.parameters(), *specs[k].module.buffers()] if id(t) not in followers}
        materialise(model, [captured.graph, *(s.module for s in specs)], tensors, source, model_fn, rank)
        for tie in tied:
            rep = tied.representative(tie)
            for c in tied.followers(tie):
                c.weight = nn.Parameter(rep.detach().clone(), requires_grad=rep.requires_grad)
    for k in own:
        move_stage(specs[k], devices[k])
    # compiled=: recorded here, applied by parallelize (fxpipe.distributed.parallel.apply.apply_compile), after
    # recomputation and before data parallelism, as torchtitan's parallelize_llama applies torch.compile
    pipe = Pipeline(captured.graph, specs, devices, plan, checkpoint=checkpoint,
                    mode_dependent=captured.dependence, compiled=compiled)
    pipe.compression = BoundaryCompression.of_stages(compression, specs, pipe._output.args[0])
    pipe.transport = P2P(rank, stage_rank, group, timeout_s)
    pipe.tied = tied
    ties = RankTies(tied, stage_rank, rank, group, timeout_s)
    pipe.transport.when_local_done = ties.when_local_done
    stages = RankStages(plan, model, rank, own, specs, pipe, ties, loss_fn, reduction, broadcast_loss,
                        last=rank == stage_rank[-1])
    # (stage, name in its module) -> name in the model: named_parameters then still names a parameter that
    # FSDP2's fully_shard or tensor parallelism replaced in its module slot (by a DTensor)
    model_name = {id(param): name for name, param in model.named_parameters()}
    mine = {id(param) for param in stages.parameters()}
    stages.slots.update({
        (k, local): model_name[id(param)] for k in own
        for local, param in specs[k].module.named_parameters() if id(param) in mine and id(param) in model_name})
    return stages


def train_step(stages: RankStages, inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """One training step of ``stages`` on the batch ``inputs`` against ``target``, given on every rank (tied weights
    checked before anything runs and all-reduced over their owners after); the keywords are
    :meth:`fxpipe.Pipeline.step`'s and the model's. Returns the loss on the last stage's rank (on every rank with
    ``broadcast_loss``), else ``None``. :meth:`fxpipe.distributed.PipelineRank.step` calls it, for each data-parallel
    replica through :mod:`fxpipe.distributed.parallel.replicas`."""
    stages.ties.check()   # copies of a tied parameter that diverged: refused on every rank, before anything runs
    stages.ties.begin()
    ok = False
    try:
        loss = stages.pipe.step(inputs, target, stages.loss_fn, reduction=stages.reduction, **kwargs)
        ok = True
    finally:
        stages.ties.end(ok)
    return loss if stages.last or stages.broadcast_loss else None
