"""``fxpipe.plan(mesh=...)``: a costed model (:mod:`fxpipe.analytic_model`) planned as a pp x dp x tp mesh: the
chain of pieces, the mesh search (:func:`solvers.mesh_search.search_mesh`) and its choice costed node by node
(:mod:`fxpipe.planning.mesh_plan`), the layout stored whole in the plan."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Any

from torch import nn

from fxpipe.cost.devices import Devices
from fxpipe.options import CompileOptions
from fxpipe.errors import InfeasiblePlanError
from fxpipe.planning.mesh_chain import chain_pieces, levels_of, pipeline_ranks, with_experts
from fxpipe.planning.mesh_plan import MeshAsked, ask_mesh, mesh_costs, mesh_record, mesh_rows, plan_for_choice
from fxpipe.planning.plan import Plan
import solvers
from solvers.experts import held_bytes
from solvers.layout import Layout, refusal
from solvers.mesh import MeshProblem, state_bytes
from solvers.mesh_search import MeshChoice, choice_layout, least_simulated_s, least_step_s, search_mesh, simulate_choice
from solvers.schedules import ONE_STAGE, SCHEDULES, get_schedule, stages_per_worker
from fxpipe.analytic_model import AnalyticModel, cost_model, planner_for, with_model_flops

__all__ = ["plan_costed_mesh", "plan_mesh"]


def plan_mesh(model: nn.Module, devices: Devices, example_inputs: tuple, mesh: str | dict[str, Any] | MeshAsked, *,
              example_kwargs: dict[str, Any] | None = None, chunks: int | None = None, schedule: str = "auto",
              optimizer: str = "adam", checkpoint: str = "auto", options: CompileOptions | None = None) -> Plan:
    """:func:`plan` with ``mesh=``: capture and cost as :func:`plan` does, build the chain of pieces
    (:mod:`fxpipe.planning.mesh_chain`), search (:func:`solvers.mesh_search.search_mesh`), and cost the
    choice node by node (:mod:`fxpipe.planning.mesh_plan`); a choice the node-level memory model refuses gives
    way to the next fastest shape. ``plan.solver["mesh_search_s"]`` is the search's time."""
    asked = ask_mesh(mesh, len(devices))   # read once: a mesh the planner cannot take is refused before costing
    costed = cost_model(model, example_inputs, devices.specs[0], workers=len(devices), example_kwargs=example_kwargs,
                        options=options)
    return plan_costed_mesh(costed, devices, asked, chunks=chunks, schedule=schedule, optimizer=optimizer,
                            checkpoint=checkpoint, options=options)


def plan_costed_mesh(costed: AnalyticModel, devices: Devices, mesh: str | dict[str, Any] | MeshAsked, *,
                     chunks: int | None = None, schedule: str = "auto", optimizer: str = "adam",
                     checkpoint: str = "auto", options: CompileOptions | None = None) -> Plan:
    """The second half of :func:`plan_mesh`, for a model costed once (:func:`cost_model`) and planned for several
    meshes or devices (``mesh`` a spelling, or as :func:`fxpipe.planning.mesh_plan.ask_mesh` read it)."""
    asked = ask_mesh(mesh, len(devices))
    fixed, sequence_parallel = list(asked.shapes), asked.sequence_parallel
    levels = levels_of(devices)
    island = levels[0].size
    # the tps the search tries (inside the island) and a fixed mesh's own, which may lie past it
    tps = sorted({t for t in range(2, island + 1) if island % t == 0} | {m.tp for m in fixed[:1] if m.tp > 1})
    refused = {t: why for t in tps if (why := costed.tp_refusal(t))}
    for m in fixed[:1]:
        if (why := refusal(m, batch=costed.batch, experts={r.path: r.num_experts for r in costed.experts})):
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
    pieces = with_experts(pieces, piece_nodes, costed.experts, samples)   # what ep shards and moves
    factor = costed.state_factor(optimizer)
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
    # or its own schedule's simulation could (least_simulated_s: its fullest device's work, fill and drain), so
    # a shape that cannot beat the best found is not simulated (Qwen3-235B-A22B on 256: 33 of 0.01-11 s each)
    queue = [(c.iteration_s if c.simulated else max(least_step_s(c), least_simulated_s(problem, c)), next(order), c)
             for c in search.shapes]
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
    result.layout = dataclasses.replace(choice_layout(choice, problem), precision=result.layout.precision)
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
    whole = sum(held_bytes(piece.param_bytes, piece.experts, m.ep) / (m.tp if piece.tp_sharded else 1)
                for piece in problem.pieces)
    held = sum(state_bytes(problem, m, choice.candidate.micro_batches,
                           get_schedule(choice.candidate.schedule).split_backward and m.pp > 1,
                           (choice.stage_modes or ["never"])[0]))
    planner = dataclasses.replace(planner, chunks=choice.candidate.micro_batches,
                                  optimizer_state_factor=held / whole - 1.0 if whole > 0 else grad + optimizer_state,
                                  memory_bytes=[problem.memory_bytes] * len(planner.devices))
    scaled = mesh_costs(costed.costs, costed.batch / costed.profiled, choice, problem, piece_nodes,
                        costed.spec.launch_s, costed.experts)
    result = plan_for_choice(planner, scaled, choice, piece_nodes)
    pipeline = result.predicted["iteration_s"]
    result.predicted.update(pipeline_iteration_s=pipeline, iteration_s=pipeline + choice.iteration_s - choice.pipeline_s,
                            data_parallel_sync_s=list(choice.sync_s), bubble=choice.bubble)
    result.predicted["throughput_samples_per_s"] = costed.batch / result.predicted["iteration_s"]
    return result
