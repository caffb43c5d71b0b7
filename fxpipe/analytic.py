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

:func:`cost_model` and :func:`planner_for` are the two halves of :func:`plan` (a benchmark costs a model once
and plans it for several device counts, or costs a split it chose itself with ``Planner.costed``).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from fxpipe.checks import auto_schedules, batch_layout, check_arguments, most_micro_batches, unwrap_compiled, worker_devices
from fxpipe.cost.devices import ACHIEVABLE, PRESETS, Devices, DeviceSpec
from fxpipe.cost.optimizer_state import OPTIMIZER_STATE, optimizer_state_factor, training_dtype
from fxpipe.cost.profile import NodeCost, profile_graph
from fxpipe.distributed.parallel.tp_plans import tp_refusal
from fxpipe.frontend.capture import Captured, capture
from fxpipe.options import CompileOptions, ProfileOptions
from fxpipe.errors import InfeasiblePlanError
from fxpipe.planning.auto import plan_auto, search_rows
from fxpipe.planning.mesh_chain import chain_pieces, levels_of, pipeline_ranks
from fxpipe.planning.mesh_plan import (mesh_costs, mesh_record, mesh_rows, mesh_sequence_parallel, parse_mesh,
                                       plan_for_choice)
from fxpipe.planning.plan import Plan
from fxpipe.planning.planner import Planner
from fxpipe.planning import throughput
from fxpipe.planning.topology import links_from_classes
from fxpipe.runtime.checks.guards import input_signature
from fxpipe.runtime.execute.microbatch import BatchLayout, batch_size_of, scatter
from fxpipe.runtime.execute.structure import FlatInputs, flat_inputs
import solvers
from solvers.layout import Layout, refusal
from solvers.mesh import MeshProblem, state_bytes
from solvers.mesh_search import MeshChoice, choice_layout, least_step_s, search_mesh, simulate_choice
from solvers.schedule_search import chunk_choices
from solvers.schedules import ONE_STAGE, SCHEDULES, get_schedule, stages_per_worker

IF_NEEDED = "if_needed"   # fxpipe.plan's default mesh: one pipeline where it holds the model on one node, else "auto"

__all__ = ["AnalyticModel", "cost_model", "planner_for", "plan", "plan_costed_mesh", "plan_mesh", "OPTIMIZER_STATE"]


@dataclass
class AnalyticModel:
    """A model captured and costed from shapes on one device spec: what :func:`plan` plans from."""

    captured: Captured
    costs: dict[str, NodeCost]   # per node, for micro-batches of the batch cut in ``profiled``
    batch: int                   # samples in the example batch
    most: int                    # the most micro-batches ``chunks="auto"`` makes of it
    profiled: int
    layout: BatchLayout
    dtype: torch.dtype           # the dtype the model trains in (its parameters')
    training: bool
    model_name: str
    spec: DeviceSpec
    #: ``tp`` -> why the runtime's default tensor-parallel plan cannot shard the model over ``tp`` ranks (``None``:
    #: it can); :func:`plan_costed_mesh` plans no mesh of a refused ``tp``
    tp_refusal: Callable[[int], str | None] = lambda tp: None
    #: the example inputs' names, dtypes and shapes (:func:`fxpipe.runtime.checks.guards.input_signature`): a call of
    #: another dtype or rank is refused before its step, as for a compiled plan
    signature: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def cost_model(model: nn.Module, example_inputs: tuple, spec: DeviceSpec, micro_batches: int | None = None, *,
               workers: int = 8, example_kwargs: dict[str, Any] | None = None,
               leaf_modules: Iterable[type | str] = (), frontend: str = "auto",
               options: CompileOptions | None = None) -> AnalyticModel:
    """Capture ``model`` as compile does and cost every node for ``spec`` on micro-batches of the batch cut in
    ``micro_batches`` (default: what compile profiles at, 4 per worker of ``workers`` and at most one sample
    each)."""
    model = unwrap_compiled(model)
    options = options or CompileOptions()
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    captured = capture(model, leaf_modules, options.concrete_args, frontend, example_inputs,   # 1. trace
                       example_kwargs, options.batch_dim, other_mode=False)   # nothing here runs the graph
    inputs = example_inputs
    if captured.graph.meta.get("fxpipe_in_spec") is not None:   # torch.export's flat graph: its leaves
        inputs = FlatInputs(flat_inputs(example_inputs, example_kwargs or {}, captured.graph.meta["fxpipe_in_spec"])[0])
    layout = batch_layout(options, captured.graph)
    dims = layout.input_dims([n.target for n in captured.graph.graph.nodes if n.op == "placeholder"])
    dims = dims[:len(inputs)] + [0] * (len(inputs) - len(dims))
    batch = batch_size_of(list(inputs), dims)
    most = most_micro_batches(model, batch)
    profiled = micro_batches if micro_batches is not None else min(most, 4 * workers)
    if batch == 0 or profiled > batch:
        raise ValueError(f"example_inputs hold a batch of {batch} samples, which cannot be split into {profiled} "
                         "micro-batches: pass the batch the pipeline will train on")
    first = tuple(scatter(list(inputs), profiled, dims)[0])
    costs = profile_graph(captured.graph, first, torch.device("cpu"), mode="analytic", spec=spec)   # 2. cost
    return AnalyticModel(captured, costs, batch, most, profiled, layout, training_dtype(model), model.training,
                         type(model).__name__, spec, functools.lru_cache(functools.partial(tp_refusal, model)),
                         input_signature(captured.graph, tuple(inputs)))


def with_model_flops(result: Plan, costed: AnalyticModel) -> Plan:
    """``result`` with a step's model FLOPs and, planned for a preset, its devices' dense peak
    (:mod:`fxpipe.planning.throughput`): the costs are one micro-batch's of ``costed.profiled``."""
    dtype = str(costed.dtype).removeprefix("torch.")
    preset = costed.spec.name in {spec.name for spec, _ in PRESETS.values()}
    rate = costed.spec.flops.get(dtype, costed.spec.flops["float32"])
    throughput.record(result, sum(c.flops for c in costed.costs.values()) * costed.profiled,
                      rate / ACHIEVABLE["flops"] if preset else None)
    return result


def planner_for(costed: AnalyticModel, devices: Devices, *, schedule: str = "1f1b", stages: int | None = None,
                virtual_stages: int = 1, optimizer: str = "adam", checkpoint: str = "auto",
                options: CompileOptions | None = None, time_limit_s: float | None = 2.0) -> Planner:
    """The :class:`Planner` of ``costed`` on ``devices`` (its first ``len(devices)`` workers, or fewer for a
    fixed ``stages`` of several stages per worker), at ``costed.profiled`` micro-batches."""
    options = options or CompileOptions()
    factor = optimizer_state_factor(optimizer, costed.dtype)
    all_ids = [torch.device(i) for i in devices.ids]
    workers = worker_devices(all_ids, schedule, virtual_stages, stages, costed.profiled)
    n = len(workers)
    specs = devices.specs[:n]
    memory = list(options.memory_bytes) if options.memory_bytes is not None else [s.memory_bytes for s in specs]
    if len(memory) < n:
        raise ValueError(f"options.memory_bytes has {len(memory)} entries for {n} devices")
    dtype = str(costed.dtype).removeprefix("torch.")

    def rate(s: DeviceSpec) -> float:
        return s.flops.get(dtype, s.flops["float32"])
    return Planner(gm=costed.captured.graph, fingerprint=costed.captured.fingerprint, model_name=costed.model_name,
                   devices=workers, all_devices=all_ids, memory_bytes=memory[:n], chunks=costed.profiled,
                   stages=stages, virtual_stages=virtual_stages, schedule=schedule, checkpoint=checkpoint,
                   optimizer_state_factor=factor, batch=costed.batch, profile="analytic", training=costed.training,
                   batch_dims=costed.layout.to_dict(), frontend=costed.captured.frontend,
                   keep_blocks_whole=options.keep_blocks_whole,
                   profile_extra={"device": costed.spec.name, "dtype": dtype, "optimizer": optimizer,
                                  "inputs": costed.signature},
                   links=links_from_classes([row[:n] for row in devices.link_classes[:n]], devices.bandwidth_Bps),
                   speeds=[rate(s) / rate(specs[0]) for s in specs], hosts=list(devices.nodes[:n]),
                   time_limit_s=time_limit_s)


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
    leaf_modules: Iterable[type | str] = (),
    frontend: str = "auto",
    options: CompileOptions | None = None,
    time_limit_s: float = 2.0,
    mesh: str | dict[str, Any] | None = "if_needed",
    sequence_parallel: bool | None = None,
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
        leaf_modules, frontend, options: as for :func:`fxpipe.compile` (``options``: ``batch_dim``,
            ``concrete_args``, ``keep_blocks_whole``, ``memory_bytes`` per device).
        time_limit_s: the solver's limit per solve (default 2 s; the auto search solves once or twice per
            schedule and micro-batch count, and a search stopped by it says so with its gap in the plan).
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
        sequence_parallel: with a mesh, whether tensor parallelism also shards the activations outside its
            matmuls by sequence (Megatron-LM's sequence parallelism), as ``PipelineRank`` then runs it
            (:mod:`fxpipe.distributed.parallel.sequence`). ``None`` (default): the mesh spelling's ``sp`` key, else
            on, as torchtitan runs tensor parallelism; ``False`` plans (and runs) the activations outside the
            tensor-parallel blocks whole on every tp rank.

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
                                     leaf_modules=leaf_modules, frontend=frontend, options=options,
                                     time_limit_s=time_limit_s)
        return _pipeline_or_mesh(planning, len(set(devices.nodes)), stages, virtual_stages, sequence_parallel)
    if mesh is not None:
        if stages is not None or virtual_stages is not None:
            raise ValueError("with mesh=, the mesh search chooses the stages: leave stages and virtual_stages unset")
        check_arguments(checkpoint, schedule, None, None, ProfileOptions(), None, None)
        return plan_mesh(model, devices, example_inputs, mesh, example_kwargs=example_kwargs,
                         chunks=None if auto_chunks else chunks, schedule=schedule, optimizer=optimizer,
                         checkpoint=checkpoint, leaf_modules=leaf_modules, frontend=frontend, options=options,
                         sequence_parallel=sequence_parallel)
    v = check_arguments(checkpoint, schedule, virtual_stages, None, ProfileOptions(), None, None)
    # costs at one micro-batch count (4 per worker, as compile profiles); the auto search scales them to others
    workers = len(worker_devices([torch.device(i) for i in devices.ids], "gpipe" if schedule == "auto" else schedule,
                                 v, stages, None if auto_chunks else chunks))
    costed = cost_model(model, example_inputs, devices.specs[0], None if auto_chunks else chunks, workers=workers,
                        example_kwargs=example_kwargs, leaf_modules=leaf_modules, frontend=frontend, options=options)
    planner = planner_for(costed, devices, schedule="gpipe" if schedule == "auto" else schedule, stages=stages,
                          virtual_stages=v, optimizer=optimizer, checkpoint=checkpoint, options=options,
                          time_limit_s=time_limit_s)
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



def _pipeline_or_mesh(planning: Callable[..., Plan], nodes: int, stages: int | None, virtual_stages: int | None,
                      sequence_parallel: bool | None) -> Plan:
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
        result = planning(mesh="auto", sequence_parallel=sequence_parallel)
    except InfeasiblePlanError as exc:
        raise InfeasiblePlanError(f"{pipeline_error or because}; and no mesh of the devices fits either: {exc}",
                                  exc.min_peak_bytes) from exc
    result.solver["mesh_because"] = because
    return result


def plan_mesh(model: nn.Module, devices: Devices, example_inputs: tuple, mesh: str | dict[str, Any], *,
              example_kwargs: dict[str, Any] | None = None, chunks: int | None = None, schedule: str = "auto",
              optimizer: str = "adam", checkpoint: str = "auto", leaf_modules: Iterable[type | str] = (),
              frontend: str = "auto", options: CompileOptions | None = None,
              sequence_parallel: bool | None = None) -> Plan:
    """:func:`plan` with ``mesh=``: capture and cost as :func:`plan` does, build the chain of pieces
    (:mod:`fxpipe.planning.mesh_chain`), search (:func:`solvers.mesh_search.search_mesh`), and cost the
    choice node by node (:mod:`fxpipe.planning.mesh_plan`); a choice the node-level memory model refuses gives
    way to the next fastest shape. ``plan.solver["mesh_search_s"]`` is the search's time."""
    parse_mesh(mesh, len(devices))   # a mesh the planner cannot take is refused before the model is costed
    costed = cost_model(model, example_inputs, devices.specs[0], workers=len(devices), example_kwargs=example_kwargs,
                        leaf_modules=leaf_modules, frontend=frontend, options=options)
    return plan_costed_mesh(costed, devices, mesh, chunks=chunks, schedule=schedule, optimizer=optimizer,
                            checkpoint=checkpoint, options=options, sequence_parallel=sequence_parallel)


def plan_costed_mesh(costed: AnalyticModel, devices: Devices, mesh: str | dict[str, Any], *, chunks: int | None = None,
                     schedule: str = "auto", optimizer: str = "adam", checkpoint: str = "auto",
                     options: CompileOptions | None = None, sequence_parallel: bool | None = None) -> Plan:
    """The second half of :func:`plan_mesh`, for a model costed once (:func:`cost_model`) and planned for several
    meshes or devices."""
    fixed = parse_mesh(mesh, len(devices))
    sequence_parallel = mesh_sequence_parallel(mesh, sequence_parallel)
    levels = levels_of(devices)
    island = levels[0].size
    # the tps the search tries (inside the island) and a fixed mesh's own, which may lie past it
    tps = sorted({t for t in range(2, island + 1) if island % t == 0} | {m.tp for m in fixed[:1] if m.tp > 1})
    refused = {t: why for t in tps if (why := costed.tp_refusal(t))}
    for m in fixed[:1]:
        if (why := refusal(m, batch=costed.batch)) is not None:
            raise ValueError(f"mesh {m.label()}: {why.message}")
        if m.tp in refused:
            world = len(devices)
            runnable = [t for t in range(1, world + 1) if world % t == 0 and (t == 1 or not costed.tp_refusal(t))]
            raise ValueError(f"mesh {m.label()}: the runtime cannot run tp={m.tp} on this model: {refused[m.tp]}; "
                             f"plan a tp of {', '.join(map(str, runnable))} (the default tensor-parallel plan "
                             "shards whole heads and features), or let the planner choose (mesh='auto', "
                             "fxpipe plan --mesh auto)")
    samples = costed.batch / costed.profiled
    launch = costed.spec.launch_s
    pieces, cuts, broadcast, piece_nodes = chain_pieces(costed.captured.graph, costed.costs, samples, launch)
    factor = optimizer_state_factor(optimizer, costed.dtype)
    grad = min(1.0, factor)
    memory = (options.memory_bytes[0] if options is not None and options.memory_bytes is not None
              else devices.specs[0].memory_bytes)
    problem = MeshProblem(pieces, cuts, levels, float(memory), costed.batch, grad_factor=grad,
                          optimizer_factor=factor - grad,
                          schedules=SCHEDULES if schedule == "auto" else (schedule,),
                          sequence_parallel=sequence_parallel, fixed=fixed,
                          micro_batch_counts=(chunks,) if chunks is not None else (), broadcast_bytes=broadcast,
                          tp_refused=tuple(refused))
    try:
        search = search_mesh(problem)
    except solvers.InfeasibleError as exc:
        raise InfeasiblePlanError(str(exc), exc.min_peak_bytes) from exc
    failures: list[str] = []
    costed_rows: list[dict[str, Any]] = []   # every choice costed node by node, beside the search's figures
    best: tuple[Plan, MeshChoice] | None = None
    costed_on: dict[Layout, set[str]] = {}                # mesh -> the schedules costed node by node on it
    order = itertools.count()
    # by a lower bound on the search's simulated step, fastest first: a shape's simulated step where the search
    # simulated it, else the least any schedule could take (least_step_s; the closed form over-counts uneven stages)
    queue = [(c.iteration_s if c.simulated else least_step_s(c), next(order), c) for c in search.shapes]
    heapq.heapify(queue)
    while queue:
        estimate, _, choice = heapq.heappop(queue)
        # the plan is the fastest by the node-level costing among the shapes the search estimates faster than the
        # best found so far (its simulated estimates have been at or below the node-level figure: 405B on 64
        # nodes, 37.3 s against 42.0 s)
        if best is not None and estimate >= best[0].predicted["iteration_s"]:
            break
        if not choice.simulated:   # simulated now, and back in the queue by that
            choice = simulate_choice(problem, choice)
            heapq.heappush(queue, (choice.iteration_s, next(order), choice))
            continue
        # the same shape under its next schedule: it may fit where this one did not (fewer micro-batches in
        # flight), or cost less node by node than this one does (the search ranks a shape's schedules by its own
        # step, a lower bound)
        costed_on.setdefault(choice.mesh, set()).add(choice.candidate.schedule)
        other = _under_another_schedule(problem, choice.mesh, costed_on[choice.mesh])
        if other is not None:
            heapq.heappush(queue, (other.iteration_s, next(order), other))
        row = {"mesh": choice.mesh.label(), "schedule": choice.candidate.schedule,
               "chunks": choice.candidate.micro_batches, "searched_s": choice.iteration_s,
               "searched_peak_bytes": max(choice.peak_bytes)}
        costed_rows.append(row)
        try:
            result = _node_level(costed, devices, problem, choice, piece_nodes, optimizer, checkpoint, options)
        except (MemoryError, InfeasiblePlanError) as exc:
            failures.append(f"{choice.mesh.label()} ({choice.candidate.schedule}): {str(exc).splitlines()[0][:200]}")
            row["refused"] = failures[-1]
            continue
        row.update(iteration_s=result.predicted["iteration_s"], peak_bytes=max(result.worker_peaks()))
        if best is None or result.predicted["iteration_s"] < best[0].predicted["iteration_s"]:
            best = (result, choice)
    if best is None:
        raise InfeasiblePlanError("the mesh search's plans all exceed a device's memory under the node-level memory "
                                  "model: " + "; ".join(failures[:3]), None)
    result, choice = best
    result.mesh = mesh_record(choice, problem, pipeline_ranks(choice.mesh.pp, choice.mesh.dp, choice.mesh.tp,
                                                              choice.mesh.order))
    result.layout = choice_layout(choice, problem)
    result.solver.update(mesh_search=mesh_rows(search, problem, choice, result), mesh_search_s=search.time_s,
                         mesh_candidates=search.tried, mesh_refused=failures, mesh_costed=costed_rows)
    return with_model_flops(result, costed)


def _under_another_schedule(problem: MeshProblem, mesh: Layout, tried: set[str]) -> MeshChoice | None:
    """The search's best for ``mesh`` alone under the schedules not in ``tried``, or None (none left, or none
    fits by the search's memory)."""
    schedules = tuple(s for s in problem.schedules if s not in tried) if mesh.pp > 1 else ()
    if not schedules:
        return None
    try:
        return search_mesh(dataclasses.replace(problem, fixed=[mesh], schedules=schedules)).best
    except solvers.InfeasibleError:
        return None


def _node_level(costed: AnalyticModel, devices: Devices, problem: MeshProblem, choice: MeshChoice, piece_nodes: list,
                optimizer: str, checkpoint: str, options: CompileOptions | None) -> Plan:
    """``choice`` (a shape of the mesh search, its schedule, micro-batches and cuts) costed node by node on the
    devices its pipeline runs on: its step and per-device memory as the plan records them. The memory a device
    has and the optimizer state it keeps are the search's (``problem``). Raises ``MemoryError`` or
    :class:`InfeasiblePlanError` where the node-level memory model finds a device over."""
    m = choice.mesh
    grad, optimizer_state = problem.grad_factor, problem.optimizer_factor
    ranks = pipeline_ranks(m.pp, m.dp, m.tp, m.order)
    sub = Devices([devices.specs[r] for r in ranks], [[devices.link_classes[a][b] for b in ranks] for a in ranks],
                  [devices.ids[r] for r in ranks], [devices.nodes[r] for r in ranks], dict(devices.bandwidth_Bps))
    v = stages_per_worker(choice.candidate.schedule, problem.virtual_stages) if m.pp > 1 else 1
    planner = planner_for(dataclasses.replace(costed, profiled=choice.candidate.micro_batches), sub,
                          schedule=choice.candidate.schedule if m.pp > 1 else ONE_STAGE,
                          virtual_stages=v, optimizer=optimizer, checkpoint=checkpoint, options=options)
    # the search's state per parameter byte (FSDP2 without a pipeline reshards its blocks: solvers.mesh.state_bytes)
    whole = sum(piece.param_bytes / (m.tp if piece.tp_sharded else 1) for piece in problem.pieces)
    held = sum(state_bytes(problem, m, choice.candidate.micro_batches,
                           get_schedule(choice.candidate.schedule).split_backward and m.pp > 1,
                           (choice.stage_modes or ["never"])[0]))
    planner = dataclasses.replace(planner, chunks=choice.candidate.micro_batches,
                                  optimizer_state_factor=held / whole - 1.0 if whole > 0 else grad + optimizer_state,
                                  memory_bytes=[problem.memory_bytes] * len(planner.devices))
    scaled = mesh_costs(costed.costs, costed.batch / costed.profiled, choice, problem, piece_nodes,
                        costed.spec.launch_s)
    result = plan_for_choice(planner, scaled, choice, piece_nodes)
    pipeline = result.predicted["iteration_s"]
    result.predicted.update(pipeline_iteration_s=pipeline, iteration_s=pipeline + choice.iteration_s - choice.pipeline_s,
                            data_parallel_sync_s=list(choice.sync_s), bubble=choice.bubble)
    result.predicted["throughput_samples_per_s"] = costed.batch / result.predicted["iteration_s"]
    return result
