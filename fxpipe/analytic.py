"""``fxpipe.plan``: a plan for devices described by numbers, without allocating the model.

The model is captured as :func:`fxpipe.compile` captures it (:func:`fxpipe.frontend.capture.capture`: torch.fx
where it traces the model faithfully, ``torch.export`` otherwise, so a Hugging Face model on ``meta`` is
exported) and costed under ``FakeTensorMode`` (profile mode ``"analytic"``): FLOPs, saved-activation bytes and
parameter bytes come from shapes only, so a model built on the ``meta`` device — billions of parameters on a
laptop — plans as well as a real one. Times come from the target devices' roofline
(:class:`fxpipe.cost.devices.Devices`) at the dtype the model trains in (its parameters': build it in
bfloat16 to plan bfloat16 training), links from their link classes. The plan is then made by the planner
``compile`` uses (:class:`fxpipe.planning.planner.Planner`, and :func:`fxpipe.planning.auto.plan_auto` for
``schedule="auto"`` / ``chunks="auto"``), so the plan can later run on the real devices with
``compile(model, ..., plan=plan)``.

:func:`cost_model` and :func:`planner_for` (:mod:`fxpipe.analytic_model`) are the two halves of :func:`plan` (a
benchmark costs a model once and plans it for several device counts, or costs a split it chose itself with
``Planner.costed``); with ``mesh=``, :mod:`fxpipe.analytic_mesh` plans the mesh.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from fxpipe.checks import auto_schedules, check_arguments, worker_devices
from fxpipe.cost.devices import Devices
from fxpipe.cost.optimizer_state import OPTIMIZER_STATE, optimizer_state_factor
from fxpipe.options import CompileOptions, ProfileOptions
from fxpipe.errors import InfeasiblePlanError
from fxpipe.planning.auto import plan_auto, search_rows
from fxpipe.planning.plan import Plan
from solvers.schedule_search import chunk_choices
from fxpipe.analytic_mesh import plan_costed_mesh, plan_mesh
from fxpipe.analytic_model import AnalyticModel, cost_model, planner_for, with_model_flops

IF_NEEDED = "if_needed"   # fxpipe.plan's default mesh: one pipeline where it holds the model on one node, else "auto"

__all__ = ["AnalyticModel", "cost_model", "planner_for", "plan", "plan_costed_mesh", "plan_mesh", "OPTIMIZER_STATE"]


def plan(
    model: nn.Module,
    devices: Devices,
    example_inputs: tuple,
    *,
    example_kwargs: dict[str, Any] | None = None,
    chunks: int | str | None = "auto",
    schedule: str = "auto",
    stages: int | None = None,
    virtual_stages: int | None = None,
    optimizer: str = "adam",
    checkpoint: str = "auto",
    mesh: str | dict[str, Any] | None = "if_needed",
    options: CompileOptions | None = None,
) -> Plan:
    """Plan ``model`` for ``devices`` (e.g. ``fxpipe.Devices.preset("h100", 8)``) from shapes alone.

    Args:
        model: an ``nn.Module``, typically built on ``meta`` (``with torch.device("meta"): ...``), in the dtype
            it trains in: its parameters' dtype sets the roofline rate, the activations' bytes and the
            optimizer memory (:mod:`fxpipe.cost.optimizer_state`: a bfloat16 model is charged a float32
            master copy and float32 Adam moments, 16 bytes per parameter as a float32 one).
        devices: :class:`fxpipe.Devices`, e.g. ``Devices.preset("h100", "0:0-7,1:0-7")``.
        example_inputs, example_kwargs: one full batch (real or ``meta`` tensors), as for :func:`fxpipe.compile`.
        chunks, schedule, stages, virtual_stages: as for :func:`fxpipe.compile`; ``"auto"`` (default) makes a
            plan per schedule and micro-batch count and keeps the fastest simulated one that fits.
        optimizer: ``"adam"`` (default), ``"momentum"``, ``"sgd"`` or ``"none"``: the memory kept per parameter.
        checkpoint: ``"auto"`` (default: per device the cheapest mode that fits), or ``"always"``,
            ``"except_last"``, ``"never"``.
        mesh: ``"if_needed"`` (default): one pipeline over all the devices where the devices are one node's
            and one pipeline holds the model, else ``"auto"`` (devices on several nodes, or no pipeline that fits;
            ``plan.solver["mesh_because"]`` and the summary say why). ``None``: one pipeline over all the devices,
            whatever it costs. ``"auto"``: the devices as a
            pp x dp x tp mesh (tensor parallel inside the fastest islands of links, data parallel replicated
            or FSDP-sharded), the shape searched jointly with the stage cuts, the schedule, the micro-batches
            and recomputation (:mod:`solvers.mesh_search`; :mod:`solvers.mesh` says what each dimension is
            charged). ``"pp=2,dp=4,tp=1"`` (or a dict; ``dp_mode=shard|replicate``, ``order=pp-dp-tp|dp-pp-tp``
            optional; or ``dp_shard=4`` / ``dp_replicate=4``, as ``python -m fxpipe.launch --mesh`` spells it:
            :mod:`solvers.layout`; ``pp`` left out: what ``dp x tp`` leaves) fixes the shape; HSDP (both
            ``dp_replicate`` and ``dp_shard`` over 1) is refused. The plan is the pipeline of the dp x tp position of device 0, its stages'
            costs those of one device of the mesh; ``plan.mesh`` records the shape and ``plan.summary()`` the
            best plan of every other shape. ``chunks`` is then the micro-batches of one dp replica's share,
            ``stages``/``virtual_stages`` are not taken (interleaved-1f1b runs 2 stages per device).
            With tensor parallelism the activations outside its matmuls are also sharded by sequence
            (Megatron-LM's sequence parallelism), as ``PipelineRank`` then runs it
            (:mod:`fxpipe.distributed.parallel.sequence`), as torchtitan runs tensor parallelism; ``sp=0`` in
            the spelling (``"pp=2,tp=4,sp=0"``, ``"auto,sp=0"``) plans (and runs) them whole on every tp rank.
        options: as for :func:`fxpipe.compile`: the front end and ``leaf_modules``, ``batch_dim``,
            ``concrete_args``, ``keep_blocks_whole``, ``memory_bytes`` per device, and ``time_limit_s``, the
            solver's limit per solve (default here 2 s; the auto search solves once or twice per schedule and
            micro-batch count, and a search stopped by it says so with its gap in the plan).

    Raises :class:`fxpipe.InfeasiblePlanError` when nothing fits.
    """
    if not isinstance(devices, Devices):
        raise TypeError("devices must be fxpipe.Devices, e.g. fxpipe.Devices.preset('h100', 8)")
    optimizer_state_factor(optimizer, torch.float32)   # the optimizer's name, before anything is traced
    if chunks is not None and chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int)
                                                    or chunks < 1):
        raise ValueError(f"chunks must be a positive integer or 'auto' (the planner picks), got {chunks!r}")
    auto_chunks = chunks is None or chunks == "auto"
    if mesh == IF_NEEDED:
        planning = functools.partial(plan, model, devices, example_inputs, example_kwargs=example_kwargs,
                                     chunks=chunks, schedule=schedule, optimizer=optimizer, checkpoint=checkpoint,
                                     options=options)
        return _pipeline_or_mesh(planning, len(set(devices.nodes)), stages, virtual_stages)
    if mesh is not None:
        if stages is not None or virtual_stages is not None:
            raise ValueError("with mesh=, the mesh search chooses the stages: leave stages and virtual_stages unset")
        check_arguments(checkpoint, schedule, None, None, ProfileOptions())
        return plan_mesh(model, devices, example_inputs, mesh, example_kwargs=example_kwargs,
                         chunks=None if auto_chunks else chunks, schedule=schedule, optimizer=optimizer,
                         checkpoint=checkpoint, options=options)
    v = check_arguments(checkpoint, schedule, virtual_stages, None, ProfileOptions())
    # costs at one micro-batch count (4 per worker, as compile profiles); the auto search scales them to others
    workers = len(worker_devices([torch.device(i) for i in devices.ids], "gpipe" if schedule == "auto" else schedule,
                                 v, stages, None if auto_chunks else chunks))
    costed = cost_model(model, example_inputs, devices.specs[0], None if auto_chunks else chunks, workers=workers,
                        example_kwargs=example_kwargs, options=options)
    planner = planner_for(costed, devices, schedule="gpipe" if schedule == "auto" else schedule, stages=stages,
                          virtual_stages=v, optimizer=optimizer, checkpoint=checkpoint, options=options)
    try:
        if schedule == "auto" or auto_chunks:                                                # 3. plan
            counts = chunk_choices(costed.most, workers) if auto_chunks else [chunks]
            search = plan_auto(planner, costed.costs, costed.profiled, counts,
                               auto_schedules(None, checkpoint) if schedule == "auto" else (schedule,),
                               virtual_stages=v if v > 1 else 2,
                               overhead_s=costed.spec.launch_s)
            result = search.plan
            result.solver["search"] = search_rows(search.trials, search.best)
            return with_model_flops(result, costed)
        return with_model_flops(planner.plan(costed.costs), costed)
    except InfeasiblePlanError as exc:   # a pipeline alone keeps every parameter's state on one device
        raise InfeasiblePlanError(f"{exc}; or plan with mesh='auto', which also shards the parameters, gradients "
                                  "and optimizer states over data-parallel devices (FSDP) or splits the layers "
                                  "(tensor parallel)", exc.min_peak_bytes) from exc


def _pipeline_or_mesh(planning: Callable[..., Plan], nodes: int, stages: int | None,
                      virtual_stages: int | None) -> Plan:
    """``fxpipe.plan``'s default mesh (:data:`IF_NEEDED`): one pipeline (``planning(mesh=None)``) where the
    devices are one node's and it fits, or where the pipeline's shape is fixed (``stages``, ``virtual_stages``);
    else the mesh search (``mesh="auto"``), ``plan.solver["mesh_because"]`` saying why."""
    pipeline_error = None
    fixed = stages is not None or virtual_stages is not None
    if fixed or nodes == 1:
        try:
            return planning(stages=stages, virtual_stages=virtual_stages, mesh=None)
        except InfeasiblePlanError as exc:
            if fixed:
                raise
            pipeline_error = str(exc).split("; or plan with mesh='auto'")[0]   # that is what is done next
    because = (f"the devices are on {nodes} nodes" if pipeline_error is None else
               f"no single pipeline holds the model ({pipeline_error.split(';')[0]})")
    try:
        result = planning(mesh="auto")
    except InfeasiblePlanError as exc:
        raise InfeasiblePlanError(f"{pipeline_error or because}; and no mesh of the devices fits either: {exc}",
                                  exc.min_peak_bytes) from exc
    result.solver["mesh_because"] = because
    return result
