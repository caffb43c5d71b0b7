"""A model costed for :func:`fxpipe.plan` (:class:`AnalyticModel`, :func:`cost_model`) and the planner of its
pipeline (:func:`planner_for`): the two halves :mod:`fxpipe.analytic` and :mod:`fxpipe.analytic_mesh` plan from
(a benchmark costs a model once and plans it for several device counts)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from fxpipe.errors import TraceError
from fxpipe.checks import batch_layout, most_micro_batches, unwrap_compiled, worker_devices
from fxpipe.cost.expert_costs import ExpertRegion, cost_experts
from fxpipe.cost.devices import ACHIEVABLE, PRESETS, Devices, DeviceSpec
from fxpipe.cost.optimizer_state import optimizer_state_factor, training_dtype
from fxpipe.cost.profile import NodeCost, profile_graph
from fxpipe.distributed.parallel.tp_plans import tp_refusal
from fxpipe.frontend.capture import Captured, capture, first_line
from fxpipe.frontend.precision import COMPUTE_DTYPE, is_mixed, resolve_precision
from fxpipe.options import CompileOptions
from fxpipe.planning.plan import Plan
from fxpipe.planning.planner import Planner
from fxpipe.planning import throughput
from fxpipe.planning.topology import links_from_classes
from fxpipe.runtime.checks.guards import input_signature
from fxpipe.runtime.execute.microbatch import BatchLayout, batch_size_of, scatter
from fxpipe.runtime.execute.structure import FlatInputs, flat_inputs

__all__ = ["AnalyticModel", "cost_model", "planner_for", "with_model_flops"]


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
    #: what the plan runs (:mod:`fxpipe.frontend.precision`): the graph was rewritten for it before costing
    precision: str = "fp32"
    #: the mixture-of-experts layers' regions, charged as their active experts (:mod:`fxpipe.cost.expert_costs`)
    experts: tuple[ExpertRegion, ...] = ()

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the step computes in: bfloat16 under ``"bf16-mixed"``, else the parameters'."""
        return COMPUTE_DTYPE if is_mixed(self.precision) else self.dtype

    def state_factor(self, optimizer: str) -> float:
        """Bytes kept per parameter byte besides the parameter (:func:`optimizer_state_factor`), with the bfloat16
        compute copy under ``"bf16-mixed"`` (:func:`fxpipe.frontend.precision.compute_copy` keeps one a parameter)."""
        factor = optimizer_state_factor(optimizer, self.dtype)
        if not is_mixed(self.precision) or factor == 0:
            return factor
        return factor + COMPUTE_DTYPE.itemsize / self.dtype.itemsize   # the copy per parameter byte

    def rate(self, spec: DeviceSpec) -> float:
        """``spec``'s achievable FLOP/s in :attr:`compute_dtype` (float32's where it has no figure for it)."""
        return spec.flops.get(str(self.compute_dtype).removeprefix("torch."), spec.flops["float32"])


def cost_model(model: nn.Module, example_inputs: tuple, spec: DeviceSpec, micro_batches: int | None = None, *,
               workers: int = 8, example_kwargs: dict[str, Any] | None = None,
               options: CompileOptions | None = None) -> AnalyticModel:
    """Capture ``model`` as compile does and cost every node for ``spec`` on micro-batches of the batch cut in
    ``micro_batches`` (default: what compile profiles at, 4 per worker of ``workers`` and at most one sample
    each)."""
    model = unwrap_compiled(model)
    options = options or CompileOptions()
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    precision, captured = _captured(model, options, spec, example_inputs, example_kwargs)   # 1. trace
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
    compute = COMPUTE_DTYPE if is_mixed(precision) else training_dtype(model)
    costs, experts = cost_experts(model, captured.graph, costs, spec, compute)   # the active experts only
    return AnalyticModel(captured, costs, batch, most, profiled, layout, training_dtype(model), model.training,
                         type(model).__name__, spec, functools.lru_cache(functools.partial(tp_refusal, model)),
                         input_signature(captured.graph, tuple(inputs)), precision, experts)


def mixed_is_faster(spec: DeviceSpec) -> bool:
    """Whether ``spec`` computes bfloat16 faster than float32 (tensor cores since Ampere; not a V100, not a CPU):
    :func:`fxpipe.plan` then plans a float32 model in ``"bf16-mixed"`` unless asked otherwise."""
    return spec.flops.get("bfloat16", 0.0) > spec.flops["float32"]


def _captured(model: nn.Module, options: CompileOptions, spec: DeviceSpec, example_inputs: tuple,
              example_kwargs: dict[str, Any] | None) -> tuple[str, Any]:
    """The precision planned (asked, else ``"bf16-mixed"`` for a float32 model on devices faster at it, else the
    model's own) and the model captured at it, as nothing runs it. A default ``"bf16-mixed"`` the capture cannot
    take (a graph only torch.fx traces, leaf modules holding parameters) gives way to the model's own dtype, with a
    warning naming the cause and the fix, which the plan's ``frontend`` records (its summary's ``precision:`` line)."""
    dtype = training_dtype(model)
    precision = resolve_precision(options.precision, dtype, mixed_is_faster(spec))

    def at(precision: str) -> tuple[str, Any]:
        return precision, capture(model, options.leaf_modules, options.concrete_args, options.frontend,
                                  example_inputs, example_kwargs, options.batch_dim, other_mode=False,
                                  precision=precision)
    if options.precision is not None or not is_mixed(precision):
        return at(precision)
    try:
        return at(precision)
    except (ValueError, TraceError) as failure:   # the default only: the model's own dtype instead, said so
        own = resolve_precision(None, dtype)
        note = (f"{own}, not the default bf16-mixed, whose capture failed ({first_line(failure)}); pass "
                f"CompileOptions(precision=...) (fxpipe plan --precision) to choose")
        chosen, captured = at(own)   # a model that fails at its own precision too says so, without the warning
        warnings.warn(f"fxpipe.plan: planned at precision {note}", stacklevel=2)
        captured.frontend = {**captured.frontend, "precision_fallback": note}   # Plan.summary says it
        return chosen, captured


def with_model_flops(result: Plan, costed: AnalyticModel) -> Plan:
    """``result`` with a step's model FLOPs and, planned for a preset, its devices' dense peak
    (:mod:`fxpipe.planning.throughput`): the costs are one micro-batch's of ``costed.profiled``."""
    preset = costed.spec.name in {spec.name for spec, _ in PRESETS.values()}
    rate = costed.rate(costed.spec)
    throughput.record(result, sum(c.flops for c in costed.costs.values()) * costed.profiled,
                      rate / ACHIEVABLE["flops"] if preset else None)
    return result


PLAN_TIME_LIMIT_S = 2.0   # fxpipe.plan's solver limit per solve (CompileOptions.time_limit_s=None)


def planner_for(costed: AnalyticModel, devices: Devices, *, schedule: str = "1f1b", stages: int | None = None,
                virtual_stages: int = 1, optimizer: str = "adam", checkpoint: str = "auto",
                options: CompileOptions | None = None) -> Planner:
    """The :class:`Planner` of ``costed`` on ``devices`` (its first ``len(devices)`` workers, or fewer for a
    fixed ``stages`` of several stages per worker), at ``costed.profiled`` micro-batches."""
    options = options or CompileOptions()
    factor = costed.state_factor(optimizer)
    all_ids = [torch.device(i) for i in devices.ids]
    workers = worker_devices(all_ids, schedule, virtual_stages, stages, costed.profiled)
    n = len(workers)
    specs = devices.specs[:n]
    memory = list(options.memory_bytes) if options.memory_bytes is not None else [s.memory_bytes for s in specs]
    if len(memory) < n:
        raise ValueError(f"options.memory_bytes has {len(memory)} entries for {n} devices")
    dtype = str(costed.dtype).removeprefix("torch.")
    rate = costed.rate
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
                   time_limit_s=PLAN_TIME_LIMIT_S if options.time_limit_s is None else options.time_limit_s,
                   precision=costed.precision)
