"""``fxpipe.compile``: the data flow in one function — trace, cost, plan, codegen and run, refine.

Each step is a call into its own package (see ``docs/architecture.md``); this module only wires them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fxpipe.errors import FxpipeError
from fxpipe.compression_spec import BoundaryCodec, check_compression
from fxpipe.checks import (auto_schedules, batch_layout, check_arguments, check_batch, check_call, check_plan, check_plan_layout,
                           memory_limits, most_micro_batches, parse_devices, stage_compilation, warn_batch_norm,
                           warn_buffer_updates, worker_devices)
from fxpipe.cost.cpu import CpuHost
from fxpipe.cost.node_costs import node_costs
from fxpipe.cost.optimizer_state import training_dtype
from fxpipe.cost.profile import MEASURED_NOISE
from fxpipe.frontend.capture import capture
from fxpipe.frontend.precision import resolve_precision
from fxpipe.frontend.failures import judged_by_the_model
from fxpipe.frontend.module_hooks import check_module_hooks
from fxpipe.options import CompileOptions, ProfileOptions
from fxpipe.planning.auto import plan_auto, search_rows
from fxpipe.planning.memory_model import planned_mode, recompute_s
from fxpipe.planning.plan import Plan
from fxpipe.planning.planner import Planner
from fxpipe.planning.report import predicted_times
from fxpipe.refine.rounds import record_compilation, refine
from fxpipe.refine.stage_profile import stage_compile_seconds
from fxpipe.runtime.execute.assemble import build_pipeline
from fxpipe.runtime.checks.batch_check import check_micro_batching
from fxpipe.runtime.execute.batchnorm import convert_deferred_batch_norm
from fxpipe.runtime.execute.compiled import refuse_split_backward
from fxpipe.runtime.boundaries.compression import BoundaryCompression, codec_seconds_per_byte
from fxpipe.runtime.checks.guards import ModelGuard, input_signature
from fxpipe.runtime.execute.host import UNSHARED
from fxpipe.runtime.losses.losses import scalar_of
from fxpipe.runtime.execute.microbatch import scatter
from fxpipe.runtime.execute.pipeline import Pipeline
from fxpipe.runtime.execute.structure import FlatInputs, flat_inputs, model_output
from solvers.schedule_search import chunk_choices

__all__ = ["compile", "parse_devices"]

log = logging.getLogger("fxpipe")


def compile(
    model: nn.Module,
    devices: Sequence[str | torch.device],
    example_inputs: tuple | None = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    chunks: int | str | None = "auto",
    schedule: str = "auto",
    checkpoint: str = "auto",
    stages: int | None = None,
    virtual_stages: int | None = None,
    plan: Plan | None = None,
    profile: str | ProfileOptions = "measure",
    options: CompileOptions | None = None,
) -> Pipeline:
    """Compile ``model`` into a pipeline over ``devices``.

    Args:
        model: an ``nn.Module`` (its parameters are used in place, moved to the stage devices, like
            torchgpipe), ``torch.compile(module, ...)`` (the module is partitioned and every stage module
            compiled with those options, :mod:`fxpipe.runtime.execute.compiled`; ``CompileOptions(compile_stages=...)``
            says it for a plain module), or a ``torch.fx.GraphModule`` / ``torch.export.ExportedProgram`` the
            user traced, partitioned as given.
        devices: torch device strings, one per pipeline stage at most; ``["cpu", "cpu"]`` is two CPU workers.
        example_inputs: a tuple of inputs of one full batch; needed unless ``plan`` is given. Inputs may be
            nested tuples, lists and dicts of tensors.
        example_kwargs: the model's keyword inputs of that batch (``{"attention_mask": mask}``); the
            pipeline is then called as the model, ``pipe(ids, attention_mask=mask)``.
        chunks: micro-batches per batch, or ``"auto"`` (default; ``None`` is the same): the planner tries
            powers of two up to ``min(batch, 4 x devices)`` (``batch / 2`` where a BatchNorm trains) and
            keeps the fastest that fits (with ``plan=``:
            the plan's). Any batch is split into ``chunks`` micro-batches (``torch.tensor_split``).
        schedule: ``"auto"`` (default: the planner makes a plan for every schedule and micro-batch count,
            :mod:`fxpipe.planning.auto`, and keeps the one whose simulated iteration is fastest within
            memory; ``plan.summary()`` shows the table), or ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``,
            ``"zb-h1"``, ``"zb-v"`` (:mod:`solvers.schedules`): the order :meth:`Pipeline.step` runs and the
            memory model the planner uses (GPipe: all micro-batches in flight; 1F1B: ``p - s`` on stage
            ``s``; ZB-H1: ``p``; interleaved: as 1F1B over its ``v·p`` stages, each device's memory shared by
            its ``v`` stages; ZB-V: two stages per device in a V, read off its order).
        checkpoint: ``"auto"`` (default): the plan chooses per stage the mode that recomputes least whose
            predicted peak memory (:mod:`fxpipe.planning.memory_model`) fits (``"never"`` where the memory holds
            every activation), and if no plan fits without recomputing, plans with every stage recomputing and
            chooses again; with ``plan=``, the plan's own modes. Or one mode for every stage: ``"never"``,
            ``"except_last"`` (torchgpipe's default), ``"always"`` (whole stages), ``"blocks"``, ``"blocks:K"``,
            ``"selective"`` (per repeated block, :mod:`fxpipe.runtime.backward.block_recompute`).
        plan: a plan from :func:`fxpipe.load_plan`; skips profiling and solving.
        stages: a fixed number of stages; default lets the solver choose up to ``len(devices)``. With
            ``interleaved-1f1b``: ``v`` times the number of devices used.
        virtual_stages: ``v``, the stages per device of ``interleaved-1f1b`` (default 2); the plan then has
            ``v·p`` stages, stage ``s`` on device ``s % p`` (Megatron-LM's layout).
        profile: how costs are measured: ``"measure"`` (default: every node timed once, ``effort="fast"``),
            ``"thorough"`` (also every stage timed whole until the cuts settle, its memory and the CPU
            workers' contention measured: several training steps more), ``"estimate"`` (FLOP counts), or
            :class:`fxpipe.ProfileOptions` for the measurement's knobs (effort, repeats, stage timing,
            contention steps, calibration, the profile cache, progress, and the loss and target a thorough
            measurement runs through).
        options: :class:`fxpipe.CompileOptions`, settings most users never touch: the front end (``"auto"``,
            ``"fx"``, ``"export"``) and ``leaf_modules`` kept whole, ``concrete_args``, ``deferred_batch_norm``,
            ``batch_dim``, the memory limit's ``optimizer_state_factor`` and ``memory_bytes``, boundary
            ``compression``, ``compile_stages`` and the solver's ``time_limit_s``.

    With ``chunks > 1`` the example batch is run once whole and once as micro-batches, in eval mode
    (:mod:`fxpipe.runtime.checks.batch_check`): a model whose outputs change when its batch is split (a
    sequence-first layout split along time, a batch-level operation) is refused. A train-mode BatchNorm
    with ``chunks > 1`` gets a warning: micro-batch statistics are not a full batch's.
    """
    model, compiled_as, example_inputs, devs, auto_chunks = check_call(model, example_inputs, devices, chunks)
    profiling, options = ProfileOptions.of(profile), options or CompileOptions()
    v = check_arguments(checkpoint, schedule, virtual_stages, plan, profiling)
    compiled = stage_compilation(options, compiled_as)   # torch.compile's arguments for every stage, or None
    refuse_split_backward(schedule, compiled)
    if plan is not None:
        refuse_split_backward(plan.schedule, compiled)
        checkpoint = planned_mode(plan) if checkpoint == "auto" else checkpoint   # a plan has chosen already
    given = (example_inputs, example_kwargs)   # as the caller passed them, for the model run as written
    precision = _precision(options, plan, model)
    captured, model, example_inputs = _capture(model, plan, example_inputs, example_kwargs, options,   # 1. trace
                                               precision)
    host = CpuHost() if any(d.type == "cpu" for d in devs) else UNSHARED

    built: dict[tuple, list] = {}   # compiled stages by cuts and devices: the refinement's rounds compile once

    def build(chosen: Plan) -> Pipeline:                                                # 4. codegen, run
        # (and modes: a stage rewritten to recompute per block is not the stage of another mode)
        cuts = (tuple(sorted(chosen.stage_of().items())) + tuple(st.device for st in chosen.stages)
                + tuple(st.checkpoint for st in chosen.stages))
        pipe = build_pipeline(captured.graph, chosen, checkpoint, captured.dependence, host, compiled=compiled,
                              specs=built.get(cuts))
        if compiled is not None:
            built[cuts] = pipe.specs
        pipe.guard = ModelGuard(model)   # after the moves: .to(device) replaces buffer tensors
        pipe.compression = BoundaryCompression.of_stages(options.compression, pipe.specs, pipe._output.args[0])
        return pipe
    layout = batch_layout(options, captured.graph)
    if plan is not None:
        check_plan(plan, captured, model, devs, None if auto_chunks else chunks)
        check_plan_layout(plan, layout, options)
        warn_batch_norm(model, plan.chunks, options.deferred_batch_norm)
        warn_buffer_updates(captured.graph, plan.chunks, model)
        pipe = build(plan)
        record_compilation(pipe, None if compiled is None or example_inputs is None else
                           stage_compile_seconds(pipe, example_inputs))
        return predict_shared_step(pipe)
    if example_inputs is None:
        raise ValueError("example_inputs is required to profile the model (or pass plan=fxpipe.load_plan(...))")
    batch, dims = check_batch(example_inputs, layout, captured.graph, chunks, auto_chunks)
    costed = _cost(model, captured, example_inputs, given, layout, dims, batch,                        # 2. cost
                   devs, schedule, v, stages, None if auto_chunks else chunks, options, profiling, compiled)
    costs, workers, profiled, check_graph = costed.costs, costed.workers, costed.profiled, costed.check_graph
    planner = Planner(gm=captured.graph, fingerprint=captured.fingerprint, model_name=type(model).__name__,
                      devices=workers, all_devices=devs, memory_bytes=memory_limits(workers, v, options.memory_bytes),
                      chunks=profiled, stages=stages, virtual_stages=v,
                      schedule="gpipe" if schedule == "auto" else schedule, checkpoint=checkpoint,
                      optimizer_state_factor=options.optimizer_state_factor, batch=batch, profile=profiling.mode,
                      training=model.training, batch_dims=layout.to_dict(), frontend=captured.frontend,
                      keep_blocks_whole=options.keep_blocks_whole, time_limit_s=options.time_limit_s,
                      precision=precision,
                      profile_extra={"threads": torch.get_num_threads(), "from_cache": costed.cached,
                                     "inputs": input_signature(captured.graph, example_inputs)},
                      compression=options.compression, codec_s_per_byte=codec_cost(options.compression, workers[0]))
    search = None
    if schedule == "auto" or auto_chunks:                                               # 3. plan
        search = plan_auto(planner, costs, profiled,
                           chunk_choices(costed.most, len(workers)) if auto_chunks else [chunks],
                           auto_schedules(compiled, checkpoint) if schedule == "auto" else (schedule,),
                           virtual_stages=v if v > 1 else 2,
                           tolerance=MEASURED_NOISE if profiling.mode == "measure" else 0.0)
        planner, costs, first_plan = search.planner, search.costs, search.plan
        if check_graph is not None and first_plan.chunks not in (1, profiled):
            check_micro_batching(check_graph, example_inputs, layout, first_plan.chunks)
    else:
        first_plan = planner.plan(costs)
    warn_batch_norm(model, first_plan.chunks, options.deferred_batch_norm)
    warn_buffer_updates(captured.graph, first_plan.chunks, model)
    spec, types = captured.graph.meta.get("fxpipe_out_spec"), captured.graph.meta.get("fxpipe_out_dict_types")
    loss_fn = profiling.loss_fn
    measured_loss = ((lambda out, target: scalar_of(loss_fn(model_output(out, spec, types), target)))
                     if loss_fn is not None else None)
    pipe = refine(planner, costs, first_plan, build, example_inputs, profiling,         # 5. refine
                  loss_fn=measured_loss, example_target=profiling.example_target, compiled=compiled)
    if search is not None:   # what was tried, for plan.summary() and the saved plan
        pipe.plan.solver["search"] = search_rows(search.trials, search.best)
        if profiling.mode == "measure":   # measured costs: plans this close count as equally fast
            pipe.plan.solver["search_tolerance"] = MEASURED_NOISE
    return predict_shared_step(pipe)


@dataclass
class _Costed:
    costs: dict[str, Any]          # every node's, at the profiled micro-batch size
    cached: bool                   # read from the profile cache
    workers: list[torch.device]    # one per stage (several stages per device when interleaved)
    profiled: int                  # the micro-batch count the costs were measured at
    most: int                      # the most micro-batches chunks="auto" may make of the batch
    check_graph: Any               # the eval-mode graph the micro-batching check runs, or None


def _cost(model: nn.Module, captured: Any, example_inputs: Any, given: tuple, layout: Any, dims: list[int],
          batch: int, devs: list[torch.device], schedule: str, v: int, stages: int | None, chunks: int | None,
          options: CompileOptions, profiling: ProfileOptions, compiled: dict[str, Any] | None) -> _Costed:
    """Step 2: the micro-batching check, then every node's costs on the first micro-batch (the cache's or the
    profiler's). ``chunks`` ``None`` is "auto": costs are measured at ``min(most, 4 x devices)`` micro-batches
    and the search scales them to the other counts it tries."""
    most = most_micro_batches(model, batch)
    profiled = min(most, 4 * len(devs)) if chunks is None else chunks
    workers = worker_devices(devs, "gpipe" if schedule == "auto" else schedule, v, stages, chunks)
    check_graph = None
    with judged_by_the_model(model, *given):   # a failure blamed on the trace may be the inputs'
        if options.check_micro_batching:
            check_graph = _check_batching(model, captured, example_inputs, given, layout, profiled)
        first = tuple(tree_map(lambda x: x.to(workers[0]) if isinstance(x, torch.Tensor) else x, part)
                      for part in scatter(list(example_inputs), profiled, dims)[0])
        captured.graph.to(workers[0])
        if check_graph is not None and check_graph is not captured.graph:   # for the check after the search
            check_graph.to(workers[0])
        costs, cached = node_costs(captured.graph, captured.fingerprint, first, workers[0], profiling, compiled)
    return _Costed(costs, cached, workers, profiled, most, check_graph)


def _check_batching(model: nn.Module, captured: Any, example_inputs: Any, given: tuple, layout: Any,
                    chunks: int) -> Any:
    """The micro-batching check (:func:`check_micro_batching`) and the graph it ran on, or None: the graph itself
    while whether it depends on the train/eval mode is not known (torch.export's second trace, deferred), else,
    or where the graph itself fails it (a train-mode BatchNorm's batch statistics), the eval-mode graph
    (``captured.eval_graph``: the other mode traced now on the example inputs)."""
    if captured.mode_dependent is None:
        try:
            check_micro_batching(captured.graph, example_inputs, layout, chunks)
            return captured.graph
        except FxpipeError:
            if not captured.depends_on_mode(given):
                raise
    graph = captured.eval_graph
    if graph is None:
        log.info("micro-batching is not checked: %s depends on train/eval mode and does not trace in eval mode",
                 type(model).__name__)
        return None
    check_micro_batching(graph, example_inputs, layout, chunks)
    return graph


def _capture(model: Any, plan: Plan | None, example_inputs: tuple | None, example_kwargs: dict[str, Any] | None,
             options: CompileOptions, precision: str | None) -> tuple[Any, nn.Module, Any]:
    """Step 1: the model's graph (traced as a loaded plan's model was, so the fingerprints compare), the module
    the pipeline runs (an ExportedProgram's graph module), and the example inputs as the flat graph's leaves
    (profiling, checks and refinement run the graph on them)."""
    frontend = options.frontend
    if plan is not None and frontend == "auto" and plan.frontend.get("name") in ("fx", "export"):
        frontend = plan.frontend["name"]
    if frontend == "export" and example_inputs is None:
        raise ValueError("the torch.export front end traces the model on example inputs: pass example_inputs "
                         "(and example_kwargs) with plan=, as for the compile that made the plan")
    captured = capture(model, options.leaf_modules, options.concrete_args, frontend, example_inputs, example_kwargs,
                       options.batch_dim, precision=precision)
    if example_inputs is not None and captured.graph.meta.get("fxpipe_in_spec") is not None:
        example_inputs = FlatInputs(flat_inputs(example_inputs, example_kwargs or {},
                                                captured.graph.meta["fxpipe_in_spec"])[0])
    model = model if isinstance(model, nn.Module) else captured.graph
    check_module_hooks(captured.graph, model)
    if options.deferred_batch_norm and convert_deferred_batch_norm(captured.graph) == 0:
        log.info("deferred_batch_norm=True but %s has no BatchNorm layer", type(model).__name__)
    return captured, model, example_inputs


def _precision(options: CompileOptions, plan: Plan | None, model: Any) -> str | None:
    """The precision the pipeline runs (:mod:`fxpipe.frontend.precision`): a loaded plan's, else
    ``options.precision`` checked against the model's dtype, else the model's own (a measured plan runs the
    model as built; ``"bf16-mixed"`` is asked for)."""
    if plan is not None:
        planned = plan.layout.precision
        if options.precision is not None and planned is not None and options.precision != planned:
            raise ValueError(f"options.precision={options.precision!r} but the plan was made for {planned!r}: "
                             "leave precision out with plan= (the plan says it), or plan again")
        return planned
    if not isinstance(model, nn.Module):   # a GraphModule or ExportedProgram as given: its own dtypes
        return options.precision
    return resolve_precision(options.precision, training_dtype(model))


def predict_shared_step(pipe: Pipeline) -> Pipeline:
    """On CPU workers that share the processors, also predict the step as :meth:`Pipeline.report` does, each
    stage slowed beside the others (``plan.predicted["iteration_shared_s"]``, shown by ``plan.summary()``).
    ``plan.predicted["iteration_s"]`` stays the solver's figure, every stage on a processor of its own: the
    plans it ranks are compared on it, and on two CPU workers it was half the measured step."""
    sharing = pipe.cpu_sharing()
    if sharing is None:
        return pipe
    plan, m = pipe.plan, pipe.plan.chunks
    # a checkpointed micro-batch's backward recomputes its forward (a block mode: its blocks), as the report counts it
    again = [recompute_s(st, pipe.stage_checkpoint(st.index), m) for st in plan.stages]
    fwd = [st.fwd_s for st in plan.stages]
    plan.predicted["iteration_shared_s"], _ = predicted_times(fwd, [st.bwd_s for st in plan.stages], m, pipe.schedule,
                                                              plan.workers, sharing, again)
    return pipe


def codec_cost(compression: Any, device: torch.device) -> float:
    """The measured time per raw byte of one codec for every boundary, the mean of its two directions (0 for
    none, or codecs by stage)."""
    spec = check_compression(compression)
    if not isinstance(spec, BoundaryCodec):
        return 0.0
    return sum(codec_seconds_per_byte(c, device) for c in (spec.forward, spec.backward) if c is not None) / 2
