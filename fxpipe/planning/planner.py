"""From node costs to a :class:`fxpipe.Plan`: the problem for the solvers, the solve, and what the plan adds.

:class:`Planner` holds everything about the target (devices and their links
and memory, micro-batches, schedule, checkpoint mode) so that a plan can be made
again from other costs (``calibrate=True``). It builds the ``solvers.Problem``
(for ``interleaved-1f1b`` one solver device per chunk and device, each with its
share of the memory, placement fixed), solves it, and fills in what only the
torch side knows: each stage's boundary, workspace and loss bytes
(:func:`stage_buffers`), each boundary's bytes with and without compression
(:mod:`fxpipe.planning.boundaries`), the schedule's simulated iteration time, and with
``checkpoint="auto"`` the mode of each device (:func:`fxpipe.planning.memory_model.choose_checkpoints`).
When no plan fits without checkpointing, ``"auto"`` and ``"except_last"`` plan again
with every stage recomputing (``Problem.recompute``: one micro-batch's activations
at a time, backward time plus forward), which ``"always"`` does at once; the
inputs a checkpointed micro-batch keeps, which the solver leaves out, are then
checked by walking the schedule per worker (:func:`fxpipe.planning.memory_model.check_fits`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

import solvers
from fxpipe._version import __version__
from fxpipe.compression_spec import BoundaryCodec, check_compression
from fxpipe.errors import InfeasiblePlanError
from fxpipe.frontend.kept_whole import KEEP_WHOLE, module_stack, tied_parameters
from fxpipe.planning.block_figures import block_figures, recompute_fractions
from fxpipe.planning.blocks import repeated_blocks
from fxpipe.planning.grouped import Grouping, solve_grouped
from fxpipe.planning.boundaries import boundary_table, charged_bytes, codecs_by_stage
from fxpipe.planning.lowering import build_problem, problem_device_ids
from fxpipe.planning.memory_model import block_mode, check_fits, checkpointed, choose_checkpoints
from fxpipe.planning.plan import Plan, PlanStage
from fxpipe.planning.tied_cost import charge_copies, tied_weights
from fxpipe.planning.topology import Links, links_for_devices, links_from_classes
from solvers.dp import solve_dp
from solvers.schedule_search import reuse
from solvers.schedules import get_schedule, stage_worker
from solvers.simulate import simulate_solution

__all__ = ["Planner", "give_stage_memory", "plan_from_solution", "recompute_attempts", "recompute_share",
           "stage_buffers", "virtual_links", "with_recomputation"]


PROXY_SHARE = 0.25
"""Of the solver's time limit, what a plan of several stages per worker (interleaved 1F1B, ZB-V) gets. Its cuts
are solved for 1F1B's bubble formula over all the stages, a proxy for the schedule's timeline, which the
simulator then times: proving them optimal for the proxy buys nothing the simulation keeps. On
Llama-3-8B-shaped ZB-V over 16 stages the DP's plan after 0.05 s is the plan after 60 s, which never closes
its gap (its bound waits on the rotary tables every layer reads); at the full 2 s each such candidate was a
third of ``fxpipe.plan``'s search."""


@dataclass
class Planner:
    """Makes plans for one traced model on one set of devices."""

    gm: Any
    fingerprint: str
    model_name: str
    devices: list[torch.device]          # the workers
    all_devices: list[torch.device]      # as the user listed them (interleaved may use fewer)
    memory_bytes: list[float]
    chunks: int
    stages: int | None
    virtual_stages: int
    schedule: str
    checkpoint: str
    optimizer_state_factor: float
    batch: int
    profile: str
    training: bool
    profile_extra: dict[str, Any] = field(default_factory=dict)
    batch_dims: dict[str, Any] = field(default_factory=dict)   # fxpipe.runtime.execute.microbatch.BatchLayout, as data
    frontend: dict[str, str] = field(default_factory=dict)     # fxpipe.frontend.capture.Captured.frontend
    # the auto search's solutions by (schedule, chunks, recompute): one under a looser memory model is
    # reused where it fits (solvers.schedule_search.reuse), not solved again
    solved: dict[tuple[str, int, bool], Any] | None = None
    keep_blocks_whole: bool = True                             # fxpipe.CompileOptions.keep_blocks_whole
    compression: Any = None            # CompileOptions.compression (a dict by stage is costed as exact)
    codec_s_per_byte: float = 0.0      # the codec's measured encode + decode time per raw byte
    # devices described by numbers (fxpipe.plan): the links between the workers (default: read from this
    # machine, nvidia-smi for GPUs), each worker's speed relative to the first, its host
    links: Links | None = None
    speeds: list[float] | None = None
    hosts: list[int] | None = None
    time_limit_s: float | None = None  # the solver's per solve (None: solvers.solve's default, 10 s)
    precision: str | None = None       # the layout's (solvers.layout.PRECISIONS; fxpipe.frontend.precision)
    # blocks kept in one stage where a plan can (fxpipe.planning.grouped): found once per graph, and carried
    # by dataclasses.replace to the planners an auto search makes (None: found from gm)
    grouping: Grouping | None = None
    # the graph's repeated blocks (fxpipe.planning.blocks), found once and carried like grouping: the grouping,
    # each plan's block figures and its recomputation read them (None: found from gm)
    blocks: dict[str, list[str]] | None = None

    def __post_init__(self) -> None:
        # one solver device per (chunk, device) for interleaved-1f1b; the links are read once
        # (on GPUs from nvidia-smi), not for every plan a calibration or checkpoint search makes
        v, devs = self.virtual_stages, self.devices
        self._owner = [stage_worker(self.schedule, k, len(devs)) for k in range(v * len(devs))]
        self._solver_devices = [devs[w] for w in self._owner]
        if self.links is None:   # read once: dataclasses.replace carries it to an auto search's planners
            self.links = links_for_devices(devs)
        self._links = virtual_links(self.links, self._owner)
        if self.blocks is None:
            self.blocks = repeated_blocks(self.gm)
        if self.grouping is None:
            self.grouping = Grouping({**self.gm.meta.get(KEEP_WHOLE, {}), **tied_parameters(self.gm)},
                                     self.blocks if self.keep_blocks_whole else {})

    def _problem(self, costs: dict[str, Any], recompute: bool) -> solvers.Problem:
        v, devs, mem = self.virtual_stages, self.devices, self.memory_bytes
        problem = build_problem(self.gm, costs, self._solver_devices, self._links, self.chunks,
                                [mem[w] / v for w in self._owner],
                                stages=v * len(devs) if v > 1 else self.stages,
                                optimizer_state_factor=self.optimizer_state_factor,
                                schedule=get_schedule(self.schedule).memory_model,
                                name=self.model_name,
                                output_bytes=self._charged(costs),
                                speeds=None if self.speeds is None else [self.speeds[w] for w in self._owner])
        problem.recompute = recompute
        return problem

    def _charged(self, costs: dict[str, Any]) -> dict[str, float] | None:
        """What a cut after each node costs under one codec for every boundary; ``None``: its bytes."""
        spec = check_compression(self.compression)
        if not isinstance(spec, BoundaryCodec):   # none, or per stage: the stages are what is being chosen
            return None
        links = [b for i, row in enumerate(self._links.bandwidth_Bps) for j, b in enumerate(row) if i != j and math.isfinite(b)]
        bandwidth = statistics.median(links) if links else 0.0
        return charged_bytes(costs, spec, self.codec_s_per_byte, bandwidth)

    def _solve(self, costs: dict[str, Any], recompute: bool) -> tuple[solvers.Problem, solvers.Solution]:
        try:
            problem = self._problem(costs, recompute)
        except solvers.InvalidProblemError as exc:   # said in the solvers' JSON words: say it in compile's
            raise ValueError(f"{str(exc).replace('use null', 'pass stages=None')}") from exc
        looser = get_schedule(self.schedule).looser
        if self.solved is not None and looser is not None:
            found = reuse(problem, self.solved.get((looser, self.chunks, recompute)))
            if found is not None:
                return problem, found

        def solve(p: solvers.Problem) -> solvers.Solution:
            if self.virtual_stages > 1:   # a proxy objective (module constant PROXY_SHARE): a share of the limit
                return solve_dp(p, placement=False, time_limit_s=PROXY_SHARE * (self.time_limit_s or 10.0))
            return solvers.solve(p, "dp", *([] if self.time_limit_s is None else [self.time_limit_s]))
        try:
            solution = solve_grouped(problem, self.grouping, solve)
        except solvers.InvalidProblemError as exc:   # only the kept-whole modules can make it invalid
            raise ValueError(f"the modules kept whole (leaf_modules) leave too few pieces for {problem.stages} "
                             f"stages ({exc}); keep fewer or smaller modules whole, or pass fewer stages") from exc
        if self.solved is not None and self.virtual_stages == 1:
            self.solved[(self.schedule, self.chunks, recompute)] = solution
        return problem, solution

    def plan(self, costs: dict[str, Any]) -> Plan:
        """The best plan for ``costs`` (node name -> :class:`fxpipe.cost.profile.NodeCost`)."""
        failure: Exception | None = None
        for recompute in recompute_attempts(self.checkpoint):
            try:
                share = recompute_share(self.checkpoint, self.chunks, recompute)
                problem, solution = self._solve(with_recomputation(costs, share), recompute)
                return self._finish(problem, solution, costs, share)
            except (solvers.InfeasibleError, MemoryError) as exc:
                failure = exc
        assert failure is not None
        hint = {"never": "checkpoint='auto' would also consider recomputation",
                "always": "with every micro-batch checkpointed: add devices or memory, or use more micro-batches",
                "except_last": "with every micro-batch but the last checkpointed; checkpoint='always' keeps less"
                }.get(self.checkpoint, "even with every stage checkpointed")
        raise InfeasiblePlanError(f"{failure} ({hint})", getattr(failure, "min_peak_bytes", None)) from failure

    def costed(self, costs: dict[str, Any], like: Plan) -> Plan:
        """``like``'s stages (the same nodes on the same devices) costed with ``costs``: what a plan made
        earlier is worth on times measured since (:func:`fxpipe.compile` picks among measured plans)."""
        recompute = bool((like.problem or {}).get("recompute", False))
        share = recompute_share(self.checkpoint, self.chunks, recompute)
        problem = self._problem(with_recomputation(costs, share), recompute)
        solution = solvers.Solution([solvers.Stage(list(st.nodes), list(devices)) for st, devices
                                     in zip(like.stages, like.solver["stage_devices"])], solver=dict(like.solver))
        solution.predicted = solvers.score(problem, solution).as_predicted()
        return self._finish(problem, solution, costs, share)

    def _charge_chosen(self, plan: Plan, problem: solvers.Problem, solution: solvers.Solution,
                       share: float) -> tuple[solvers.Problem, float]:
        """The plan's predictions with each node's backward paying what its stage's chosen mode recomputes
        (the solve charged ``share`` of every forward alike); the problem and share to simulate with."""
        fractions = recompute_fractions(self.gm, plan, self.blocks or {})
        if all(abs(fractions.get(n.id, 0.0) - share) < 1e-12 for n in problem.nodes):
            return problem, share
        # the solved problem's backwards, each moved from the share to its own fraction of the forward
        problem = dataclasses.replace(problem, nodes=[
            dataclasses.replace(n, bwd_s=n.bwd_s + (fractions.get(n.id, 0.0) - share) * n.fwd_s)
            for n in problem.nodes])
        pred = solvers.score(problem, solution).as_predicted()
        for k, st in enumerate(plan.stages):
            st.comm_s, st.stage_s = pred["comm_s"][k], pred["stage_s"][k]
        plan.problem = problem.to_dict()   # its backwards now carry each stage's recomputation
        plan.predicted.update(iteration_s=pred["iteration_s"], bottleneck_stage=pred["bottleneck"],
                              recompute_share=0.0,
                              throughput_samples_per_s=self.batch / pred["iteration_s"] if pred["iteration_s"] > 0
                              else float("inf"))
        return problem, 0.0

    def _finish(self, problem: solvers.Problem, solution: solvers.Solution, costs: dict[str, Any],
                share: float) -> Plan:
        v, workers = self.virtual_stages, len(self.devices)
        plan = plan_from_solution(problem, solution, self._solver_devices, self.fingerprint, self.model_name, self.chunks,
                                  self.checkpoint, self.batch, self.profile, str(self.devices[0]), self.training,
                                  self.profile_extra, recompute_share=share,
                                  hosts=None if self.hosts is None else [self.hosts[w] for w in self._owner])
        plan.solver["stage_devices"] = [list(st.devices) for st in solution.stages]   # the solver's device ids
        if v > 1:
            plan.devices = [str(d) for d in self.all_devices]
        plan.schedule, plan.virtual_stages = self.schedule, v
        plan.batch_dims, plan.frontend = dict(self.batch_dims), dict(self.frontend)
        if self.precision is not None:
            plan.layout = dataclasses.replace(plan.layout, precision=self.precision)
        stage_modules(self.gm, plan)
        stage_buffers(self.gm, costs, plan)
        block_figures(self.gm, costs, plan, self.blocks or {})
        if self.compression is not None:
            plan.predicted["codec_s_per_byte"] = self.codec_s_per_byte
            plan.predicted["boundaries"] = boundary_table(self.gm, costs, plan.stage_of(),
                                                          codecs_by_stage(self.compression, len(plan.stages)))
        tied = tied_weights(self.gm, costs, plan.stage_of(), self.chunks)
        if tied:
            plan.predicted["tied_weights"] = tied
            charge_copies(plan, tied, self.optimizer_state_factor)
        give_stage_memory(plan, problem, solution)
        if self.checkpoint == "auto":
            choose_checkpoints(plan)     # MemoryError when no mode fits
        elif problem.recompute or block_mode(self.checkpoint) is not None:
            check_fits(plan)             # MemoryError: the solver's model left the kept inputs (or blocks) out
        problem, share = self._charge_chosen(plan, problem, solution, share)
        # the solver's formula is 1F1B's bubble; simulated last, once
        if v > 1 or get_schedule(self.schedule).split_backward:
            # the memory fits (a shape refused above costs no simulation)
            simulated = simulate_solution(problem, solution, self.schedule, workers=workers if v > 1 else None,
                                          recompute_share=share)
            plan.predicted["iteration_s"] = simulated.iteration_s
            plan.predicted["throughput_samples_per_s"] = self.batch / simulated.iteration_s
            # the certificate is the solver's, on its objective and its devices: say which, not "device k"
            plan.solver["objective"] = (f"the solver's cuts are exact for 1F1B's bubble formula; the iteration is "
                                        f"{self.schedule} simulated on them")
            if v > 1 and "exact_over" in plan.solver:
                plan.solver["exact_over"] = plan.solver["exact_over"].replace(
                    "stage k on device k", f"stage k on its {self.schedule} worker")
        return plan


def recompute_attempts(checkpoint: str) -> tuple[bool, ...]:
    """The ``Problem.recompute`` values to plan with under ``checkpoint``, in turn: the solver's memory with
    every micro-batch's activations kept, then (a checkpointed mode) with one recomputed at a time; what that
    leaves out, the inputs a checkpointed micro-batch keeps, the caller checks by walking the schedule."""
    return {"never": (False,), "always": (True,)}.get(checkpoint, (False, True))


def give_stage_memory(plan: Plan, problem: solvers.Problem, solution: solvers.Solution) -> None:
    """Each stage's ``memory_bytes``: its solver device's (interleaved: each stage's share of its device)."""
    memory_of = {d.id: d.memory_bytes for d in problem.devices}
    for st, chosen in zip(plan.stages, solution.stages):
        st.memory_bytes = float(memory_of[chosen.devices[0]])


def recompute_share(checkpoint: str, chunks: int, recompute: bool) -> float:
    """The share of a stage's micro-batches whose backward recomputes the forward under ``checkpoint``
    (``recompute``: the plan is made with every stage checkpointed, as ``"auto"`` tries second): what the
    solver adds to each node's backward, so its cuts and its iteration pay for the recomputation."""
    if checkpoint == "auto":
        return 1.0 if recompute else 0.0
    return sum(checkpointed(checkpoint, i, chunks) for i in range(chunks)) / chunks


def with_recomputation(costs: dict[str, Any], share: float) -> dict[str, Any]:
    """``costs`` as a stage that recomputes ``share`` of its micro-batches pays them on average: that much of
    the forward again in the backward."""
    if not share:
        return costs
    return {n: dataclasses.replace(c, bwd_s=c.bwd_s + share * c.fwd_s) for n, c in costs.items()}


def stage_buffers(gm: Any, costs: dict[str, Any], plan: Plan) -> None:
    """Fill each stage's input and workspace bytes (the memory model's terms beyond saved activations)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    stage_of = plan.stage_of()

    def size(names: set[str]) -> float:
        return float(sum(costs[name].output_bytes for name in names if name in costs))
    for st in plan.stages:
        members = set(st.nodes)
        entering = {a.name for name in st.nodes for a in nodes[name].all_input_nodes
                    if a.name not in members and a.op not in ("get_attr", "placeholder")}
        leaving = {name for name in st.nodes for u in nodes[name].users   # a parameter sent on is not a copy
                   if nodes[name].op != "get_attr"
                   and (u.op == "output" or stage_of.get(u.name, st.index) != st.index)}
        final = {name for name in st.nodes if any(u.op == "output" for u in nodes[name].users)}
        st.input_bytes, st.output_bytes = size(entering), size(leaving)
        st.overlap_bytes = size({n for n in entering | leaving if n in costs and costs[n].output_saved_by in members})
        # an operation's output and its gradient, and a weight gradient before it is added into .grad
        # (:func:`_weight_copies`);
        # on the stage that computes the loss, the loss's own forward and the gradient of the model
        # output, made at the start of that stage's backward
        st.workspace_bytes = float(2 * max((costs[n].output_bytes for n in st.nodes if n in costs), default=0)
                                   + max((costs[n].param_bytes * _weight_copies(gm, nodes[n])
                                          for n in st.nodes if n in costs), default=0))
        st.loss_bytes = 2.0 * size(final) if st.index == len(plan.stages) - 1 else 0.0


def module_path(node: Any) -> str:
    """The qualified name of the innermost module whose forward made ``node`` ("" for the model's own code)."""
    # torch.export marks nodes it made outside any module with a placeholder path: the model's own code
    paths = [path for _, path, _ in module_stack(node) if not path.startswith("_empty_nn_module_stack")]
    if paths:
        return paths[-1]
    return str(node.target) if node.op == "call_module" else ""


def stage_modules(gm: Any, plan: Plan) -> None:
    """Each stage's first and last operation's module path: where the cuts are, in the model's words."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for st in plan.stages:
        ops = [nodes[name] for name in st.nodes if name in nodes and nodes[name].op not in ("get_attr", "placeholder")]
        st.modules = [module_path(ops[0]), module_path(ops[-1])] if ops else []


def _weight_copies(gm: Any, node: Any) -> int:
    """Weight-sized buffers one backward of ``node`` allocates: the new gradient, and for a convolution
    the backend's reordered copy."""
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.modules.conv._ConvNd):
        return 2
    return 1


def virtual_links(links: Links, owner: Sequence[int]) -> Links:
    """Links between the stages' copies of the devices, stage ``k`` on device ``owner[k]`` (two stages of
    one device hand over in place: ``X``)."""
    if list(owner) == list(range(len(links.classes))):
        return links
    return links_from_classes([["X" if a == b else links.classes[a][b] for b in owner] for a in owner])


def plan_from_solution(problem: solvers.Problem, solution: solvers.Solution, devices: Sequence[Any],
                        fingerprint: str, model_name: str, chunks: int, checkpoint: str, batch: int,
                        profile: str, profile_device: str, training: bool,
                        profile_extra: dict[str, Any] | None = None, hosts: Sequence[int] | None = None,
                        recompute_share: float = 0.0) -> Plan:
    """The :class:`Plan` of ``solution``; ``hosts[d]`` is the host of ``devices[d]`` (default: all on node 0).
    ``problem``'s backwards include ``recompute_share`` of the forward (:func:`recompute_share`): the predicted
    iteration keeps it, each stage's ``bwd_s`` is its backward alone (the runtime's report adds the
    recomputation of the micro-batches it checkpointed)."""
    ids = problem_device_ids([torch.device(d) for d in devices])
    nodes = problem.node_map()
    pred = solution.predicted
    stages = []
    for k, st in enumerate(solution.stages):
        index = ids.index(st.devices[0])
        dev = str(torch.device(devices[index]))
        members = [nodes[n] for n in st.nodes]
        stages.append(PlanStage(
            index=k, device=dev, nodes=list(st.nodes),
            param_bytes=sum(n.param_bytes for n in members), act_bytes=sum(n.act_bytes for n in members),
            fwd_s=sum(n.fwd_s for n in members),
            bwd_s=sum(n.bwd_s - recompute_share * n.fwd_s for n in members),
            comm_s=pred["comm_s"][k], stage_s=pred["stage_s"][k], peak_bytes=pred["peak_bytes"][k],
            node=hosts[index] if hosts is not None else 0, device_index=index,
        ))
    predicted = {"iteration_s": pred["iteration_s"], "bottleneck_stage": pred["bottleneck"],
                 "recompute_share": recompute_share,
                 "throughput_samples_per_s": batch / pred["iteration_s"] if pred["iteration_s"] > 0 else float("inf")}
    return Plan(
        fingerprint=fingerprint, model=model_name, devices=[str(torch.device(d)) for d in devices],
        chunks=chunks, schedule=problem.schedule, checkpoint=checkpoint, batch_size=batch, stages=stages,
        predicted=predicted, solver=dict(solution.solver), traced_training=training,
        profile={"mode": profile, "device": profile_device, **(profile_extra or {})}, problem=problem.to_dict(), fxpipe_version=__version__,
    )
