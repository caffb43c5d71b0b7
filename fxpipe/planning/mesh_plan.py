"""The mesh search's choice as a :class:`fxpipe.Plan`: the pipeline of one dp × tp position, costed node by node.

:func:`solvers.mesh_search.search_mesh` chooses the mesh, schedule, micro-batches and cuts between pieces;
this turns the choice into the plan the runtime runs. Every node's cost becomes what one device of the mesh
pays (:func:`mesh_costs`: the micro-batch's samples, compute and saved activations / ``tp``, parameters
/ ``tp``, the tensor-parallel collectives of each piece on its last operation) and the planner costs the
chosen stages on them (:meth:`fxpipe.planning.planner.Planner.costed`: the per-worker memory model and
checkpoint choice, the schedule simulated), its optimizer memory that of the dp mode (FSDP: the optimizer's
state / ``dp``). The plan's ``mesh`` records the shape; its ``iteration_s`` is the pipeline's plus data
parallel's exposed sync (the mesh search's simulation); ``solver["mesh_search"]`` holds the best plan of
every shape tried, for :meth:`fxpipe.Plan.summary`.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Sequence

from fxpipe.cost.expert_costs import as_experts
from fxpipe.cost.profile import NodeCost
from fxpipe.planning.lowering import problem_device_ids
from fxpipe.planning.plan import Plan
from fxpipe.planning.planner import Planner
from solvers.experts import expert_extra_s
from solvers.layout import DP_MODES, Layout, check_layout, mesh_fields, parse_layout, refusal
from solvers.mesh import MeshProblem, allreduce_s
from solvers.mesh_search import MeshChoice, MeshSearch

__all__ = ["MeshAsked", "ask_mesh", "expert_node_costs", "mesh_costs", "mesh_fields", "mesh_record", "mesh_rows", "parse_mesh",
           "plan_for_choice"]


@dataclasses.dataclass(frozen=True)
class MeshAsked:
    """A ``mesh=`` of :func:`fxpipe.plan` read once: the shapes to plan (empty: every shape, ``"auto"``) and
    whether tensor parallelism also shards the activations by sequence (the spelling's ``sp``, else on, as
    torchtitan runs tensor parallelism and ``PipelineRank`` runs it by default)."""

    shapes: tuple[Layout, ...]
    sequence_parallel: bool
    spelling: Any


def ask_mesh(spec: Any, world: int) -> MeshAsked:
    """Read ``mesh=`` once (:class:`MeshAsked`): ``"auto"`` (``"auto,sp=0"``: every shape, tensor parallelism
    without sequence parallelism) or a shape as :func:`parse_mesh` takes it; ``ValueError`` or ``TypeError``
    naming what is wrong, before anything is costed. A :class:`MeshAsked` is returned as it is."""
    if isinstance(spec, MeshAsked):
        return spec
    if isinstance(spec, str) and spec.split(",")[0].strip() == "auto":
        rest = [part.strip() for part in spec.split(",")[1:] if part.strip()]
        if {part.split("=")[0].strip() for part in rest} - {"sp"}:
            raise ValueError(f"mesh {spec!r}: 'auto' searches every shape and takes only sp= beside it "
                             "('auto,sp=0'); fix the shape instead ('pp=2,dp=4,tp=1')")
        said = parse_layout(",".join(rest)).sequence_parallel if rest else None
        return MeshAsked((), True if said is None else said, spec)
    said = parse_layout(spec).sequence_parallel if isinstance(spec, (str, dict)) else None
    return MeshAsked(tuple(parse_mesh(spec, world)), True if said is None else said, spec)


def parse_mesh(spec: Any, world: int) -> list[Layout]:
    """``"auto"`` -> [] (every shape); a mesh in either spelling of :func:`solvers.layout.parse_layout`
    (``"pp=2,dp=4,tp=1"`` with ``dp_mode=shard|replicate`` and ``order=...`` optional, or ``dp_shard=4`` /
    ``dp_replicate=4``), a string or a dict -> that shape (both dp modes when the spelling leaves the mode
    unsaid, but FSDP2 alone over tensor-parallel stages, as the runtime runs them; ``pp`` left out: the devices
    ``dp x tp`` leaves), checked by :func:`solvers.layout.refusal` against the ``world`` of devices. HSDP is
    refused: the planner cannot cost it yet."""
    if spec == "auto":
        return []
    if not isinstance(spec, (str, dict)):
        raise TypeError(f"mesh must be 'auto', a string like 'pp=2,dp=4,tp=1' or a dict, got {spec!r}")
    layout = parse_layout(spec)
    dp, tp = layout.dp, layout.tp
    if layout.hsdp:
        raise ValueError(f"mesh {spec!r}: dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard} is HSDP, "
                         f"which the planner cannot cost yet: plan dp_shard={dp} (FSDP over all {dp}) and run it "
                         f"as HSDP with python -m fxpipe.launch --mesh dp_replicate={layout.dp_replicate},"
                         f"dp_shard={layout.dp_shard}")
    pp = layout.pp if layout.pp is not None else max(1, world // (dp * tp))
    try:
        check_layout(dataclasses.replace(layout, pp=pp), world=world, runtime=False)
    except ValueError as exc:
        raise ValueError(f"mesh {spec!r}: {exc}") from None
    if layout.dp_mode is None:   # both modes, or the one the runtime runs (FSDP2 over tensor-parallel stages)
        modes = list(DP_MODES)[:1 if dp == 1 else 2]
        modes = [m for m in modes if not refusal(Layout.of(pp, dp, tp, m, layout.order, layout.ep))] or modes
    else:
        modes = ["shard" if layout.dp_mode == "shard" and layout.dp_replicate == 1 else "replicate"]
    return [Layout.of(pp, dp, tp, m, layout.order, layout.ep) for m in modes]


def mesh_costs(costs: dict[str, NodeCost], profiled_samples: float, choice: MeshChoice, problem: MeshProblem,
               piece_nodes: Sequence[Sequence[str]], launch_s: float,
               experts: Sequence[Any] = ()) -> dict[str, NodeCost]:
    """Each node's cost on one device of ``choice``'s mesh at its micro-batch (module docstring); with ``ep``, the
    experts regions' (:func:`expert_node_costs`)."""
    mesh, samples = choice.mesh, choice.samples
    f = samples / profiled_samples
    sp = problem.sequence_parallel
    tp_link = problem.links(mesh)["tp"]
    # a node of a piece tensor parallelism shards runs on 1 / tp; the others whole on every tp rank
    divisor = {n: mesh.tp if piece.tp_sharded else 1 for piece, names in zip(problem.pieces, piece_nodes)
               for n in names}

    def scaled(c: NodeCost, t: int) -> NodeCost:
        def time_of(x: float, fixed: float) -> float:
            o = min(x, fixed)
            return o + (x - o) * f / t
        return dataclasses.replace(
            c, fwd_s=time_of(c.fwd_s, launch_s), bwd_s=time_of(c.bwd_s, 2 * launch_s),
            act_bytes=int(c.act_bytes * f / t), output_bytes=int(c.output_bytes * f / (t if sp else 1)),
            param_bytes=int(c.param_bytes / t), flops=int(c.flops * f / t))
    out = {name: scaled(c, divisor.get(name, mesh.tp)) for name, c in costs.items()}
    t = mesh.tp
    for piece, names in zip(problem.pieces, piece_nodes):
        calls = [n for n in names if out[n].fwd_s > 0]
        if not calls:
            continue
        comm = piece.tp_collectives * allreduce_s(piece.tp_bytes * samples, t, tp_link)
        whole = 0 if sp or t == 1 else int(piece.replicated_act_bytes * samples * (1 - 1 / t))
        last = out[calls[-1]]
        out[calls[-1]] = dataclasses.replace(last, fwd_s=last.fwd_s + comm, bwd_s=last.bwd_s + comm,
                                             act_bytes=last.act_bytes + whole)
    return expert_node_costs(out, f, choice.mesh, problem, experts)


def expert_node_costs(out: dict[str, NodeCost], f: float, mesh: Layout, problem: MeshProblem,
                      experts: Sequence[Any]) -> dict[str, NodeCost]:
    """``out`` (a mesh's node costs at micro-batches ``f`` times the costed) with each experts region
    (:class:`fxpipe.cost.expert_costs.ExpertRegion`) under ``mesh.ep`` > 1 as :mod:`solvers.experts` charges it:
    its parameters / ``ep``, and on its last node the imbalance's share of the active experts and its all-to-alls
    (two each way) over the link the ``ep`` ranks span."""
    if mesh.ep < 2:
        return out
    for r in experts:
        for name in r.param_nodes:
            if name in out:
                out[name] = dataclasses.replace(out[name], param_bytes=int(out[name].param_bytes / mesh.ep))
        if r.nodes[-1] not in out:
            continue
        more_f, more_b = expert_extra_s(as_experts([r]), f, mesh.ep, *problem.ep_speed(mesh))
        last = out[r.nodes[-1]]
        out[r.nodes[-1]] = dataclasses.replace(last, fwd_s=last.fwd_s + more_f, bwd_s=last.bwd_s + more_b)
    return out


def plan_for_choice(planner: Planner, costs: dict[str, NodeCost], choice: MeshChoice,
                    piece_nodes: Sequence[Sequence[str]]) -> Plan:
    """The plan of ``choice``'s stages on ``planner`` (the pipeline's workers, the micro-batches, the schedule and
    the dp mode's optimizer memory already set); ``costs`` from :func:`mesh_costs`. Raises ``MemoryError`` or
    :class:`fxpipe.InfeasiblePlanError` when the node-level memory model finds a device over its memory."""
    ids = problem_device_ids(planner._solver_devices)
    cuts = choice.cuts
    stages = [SimpleNamespace(nodes=[n for names in piece_nodes[a:i] for n in names]) for a, i in zip(cuts, cuts[1:])]
    like = SimpleNamespace(stages=stages, solver={"stage_devices": [[ids[k]] for k in range(len(stages))],
                                                  "method": "mesh"},
                           problem={"recompute": choice.candidate.recompute})
    return planner.costed(costs, like)   # type: ignore[arg-type]


def mesh_record(choice: MeshChoice, problem: MeshProblem, ranks: Sequence[int]) -> dict[str, Any]:
    """What ``plan.mesh`` holds: where the mesh's dimensions run (the rank order of its dims, the links each
    crosses, this pipeline's ranks); the degrees, mode and order are the plan's ``layout``."""
    m = choice.mesh
    links = problem.links(m)
    return {"dims": ["pp", "dp", "tp"] if m.order == "pp-dp-tp" else ["dp", "pp", "tp"],
            "links": {k: (v.name if v is not None else None) for k, v in links.items()},
            "pipeline_ranks": list(ranks)}


def mesh_rows(search: MeshSearch, problem: MeshProblem, chosen: MeshChoice | None = None,
              plan: Plan | None = None) -> list[dict[str, Any]]:
    """Every shape's best plan, fastest first, ``chosen`` (default the search's best) marked, and the shapes where
    nothing fits. ``plan``: the chosen shape costed node by node, whose step, peak memory and recomputation the
    chosen row then shows (the search's own estimate kept as ``searched_s`` and ``searched_peak_bytes``)."""
    chosen = chosen or search.best
    rows = []
    # a shape refused by the node-level memory model under its best schedule may be chosen under another: its row
    # (the chosen shape simulated after the search: in place of its row)
    shapes = [chosen if c.candidate == chosen.candidate else c for c in search.shapes]
    shapes = shapes if any(c is chosen for c in shapes) else [chosen, *shapes]
    for c in shapes:
        rows.append({"pp": c.mesh.pp, "dp": c.mesh.dp, "tp": c.mesh.tp, "dp_mode": c.mesh.dp_mode,
                     "order": c.mesh.order, "ep": c.mesh.ep, "schedule": c.candidate.schedule, "chunks": c.candidate.micro_batches,
                     "recompute": any(mode != "never" for mode in c.stage_modes),
                     "recomputation": c.recomputation,
                     "iteration_s": c.iteration_s, "screened_s": c.screened_s,
                     "bubble": c.bubble, "peak_bytes": max(c.peak_bytes), "sync_s": list(c.sync_s),
                     "simulated": c.simulated,
                     "feasible": True, "chosen": c is chosen})
        if c is chosen and plan is not None:
            rows[-1].update(searched_s=c.iteration_s, searched_peak_bytes=max(c.peak_bytes),
                            iteration_s=plan.predicted["iteration_s"], peak_bytes=max(plan.worker_peaks()),
                            recompute=any((s.checkpoint or plan.checkpoint) != "never" for s in plan.stages),
                            recomputation=",".join(sorted({s.checkpoint or plan.checkpoint for s in plan.stages})))
    for mesh, why in search.infeasible.items():
        rows.append({"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp, "dp_mode": mesh.dp_mode, "order": mesh.order,
                     "ep": mesh.ep, "feasible": False, "chosen": False, "why": why})
    return rows
