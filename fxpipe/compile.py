"""``fxpipe.compile``: trace, profile, plan, split and wrap a model as a :class:`Pipeline`."""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from fxpipe.batchnorm import convert_deferred_batch_norm
from fxpipe.calibrate import scale_costs, stage_time_factors
from fxpipe.contention import CONTENTION_STEPS, measure_contention
from fxpipe.stage_profile import stage_factors
from fxpipe.stage_memory import measure_stage_bytes
from fxpipe.memory_model import choose_checkpoints
from fxpipe.codegen import move_stage, split_graph
from fxpipe.errors import PlanMismatchError
from fxpipe.fingerprint import graph_fingerprint
from fxpipe.lowering import device_memory_bytes
from fxpipe.microbatch import batch_size_of, scatter
from fxpipe.pipeline import CHECKPOINT_MODES, Pipeline
from fxpipe.plan import Plan
from fxpipe.planner import Planner
from fxpipe.profile import PROFILE_MODES, profile_graph
from fxpipe.profile_cache import ProfileCache, profile_key
from fxpipe.trace import trace
from solvers.schedules import SCHEDULES, check_schedule

__all__ = ["compile", "parse_devices"]

log = logging.getLogger("fxpipe")


def parse_devices(devices: Sequence[str | torch.device]) -> list[torch.device]:
    """Validate device strings; ``["cpu", "cpu"]`` means two CPU workers."""
    if isinstance(devices, (str, torch.device)) or not devices:
        raise ValueError(f"devices must be a non-empty list such as ['cpu', 'cpu'] or ['cuda:0', 'cuda:1'], got {devices!r}")
    out = []
    for d in devices:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{d!r} is not a torch device string ('cpu', 'cuda:0', ...): {exc}") from exc
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = dev.index if dev.index is not None else 0
            if index >= count:
                raise ValueError(f"device {str(d)!r} does not exist: this machine has {count} CUDA device(s)")
            dev = torch.device("cuda", index)
        elif dev.type != "cpu":
            raise ValueError(f"device {str(d)!r}: fxpipe runs stages on 'cpu' and 'cuda' devices")
        out.append(dev)
    return out


def _mode_dependent(model: nn.Module, leaf_modules: Iterable[Any], concrete_args: Any, fingerprint: str) -> bool:
    """Whether tracing in the other train/eval mode gives another graph."""
    was = model.training
    try:
        model.train(not was)
        other = trace(model, leaf_modules, concrete_args)
    finally:
        model.train(was)
    return graph_fingerprint(other) != fingerprint


def _progress(enabled: bool):
    if not enabled:
        return None
    start = time.perf_counter()

    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        if done == total or (tty and done % max(1, total // 20) == 0):
            width = 30
            bar = "#" * (width * done // total)
            sys.stderr.write(f"\rprofiling [{bar:<{width}}] {done}/{total} nodes "
                             f"{time.perf_counter() - start:5.1f}s")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
    return report


def compile(
    model: nn.Module,
    devices: Sequence[str | torch.device],
    example_inputs: tuple | None = None,
    *,
    chunks: int | None = None,
    plan: Plan | None = None,
    checkpoint: str = "except_last",
    schedule: str = "gpipe",
    stages: int | None = None,
    virtual_stages: int | None = None,
    deferred_batch_norm: bool = False,
    calibrate: bool = False,
    calibration_steps: int = 2,
    profile: str = "measure",
    stage_profile: bool = True,
    contention_steps: int = CONTENTION_STEPS,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: Any = None,
    warmup: int = 1,
    repeats: int = 3,
    leaf_modules: Iterable[type | str] = (),
    concrete_args: dict[str, Any] | None = None,
    optimizer_state_factor: float = 0.0,
    memory_bytes: Sequence[float] | None = None,
    progress: bool = False,
    profile_cache: bool | str = True,
) -> Pipeline:
    """Compile ``model`` into a pipeline over ``devices``.

    Args:
        model: any ``nn.Module`` that torch.fx can trace (see ``leaf_modules``).
            Its parameters are used in place (moved to the stage devices, like torchgpipe).
        devices: torch device strings, one per pipeline stage at most; ``["cpu", "cpu"]``
            is two CPU workers.
        example_inputs: a tuple of inputs of one full batch; needed unless ``plan`` is given.
        chunks: micro-batches per batch (default: ``plan.chunks`` or ``min(batch, 4 x devices)``).
        plan: a plan from :func:`fxpipe.load_plan`; skips profiling and solving.
        checkpoint: ``"always"``, ``"except_last"`` (default, as torchgpipe), ``"never"``, or
            ``"auto"``: the plan chooses per device the cheapest mode whose predicted peak
            memory (:mod:`fxpipe.memory_model`) fits, and if no plan fits without
            checkpointing, plans with every stage recomputing (backward time + forward,
            one micro-batch's activations at a time) and chooses again.
        schedule: ``"gpipe"`` (default), ``"1f1b"``, ``"interleaved-1f1b"`` or ``"zb-h1"``
            (:mod:`solvers.schedules`): the order :meth:`Pipeline.step` runs and the memory
            model the planner uses (GPipe: all micro-batches in flight; 1F1B: ``p - s`` on
            stage ``s``; ZB-H1: ``p``; interleaved: as 1F1B over its ``v·p`` stages, each
            device's memory shared by its ``v`` stages).
        deferred_batch_norm: in training, update BatchNorm running statistics once per
            mini-batch from all its micro-batches (:mod:`fxpipe.batchnorm`, as torchgpipe)
            instead of once per micro-batch; the user's buffers are updated in place.
        calibrate: close the loop: run ``calibration_steps`` training steps of the plan on
            ``example_inputs`` (loss: ``loss_fn`` on ``example_target`` when given, else the sum
            of the outputs; gradients and BatchNorm statistics are restored afterwards), scale
            every node's forward/backward time by its stage's measured/predicted ratio and solve
            again, until the cuts stop moving (at most 3 rounds; :mod:`fxpipe.calibrate`); the
            factors are in ``plan.profile["calibration"]``.
        stages: a fixed number of stages; default lets the solver choose up to ``len(devices)``.
            With ``interleaved-1f1b``: ``v`` times the number of devices used.
        virtual_stages: ``v``, the stages per device of ``interleaved-1f1b`` (default 2); the
            plan then has ``v·p`` stages, stage ``s`` on device ``s % p`` (Megatron-LM's layout),
            cut by the solver for balance with the placement fixed.
        profile: ``"measure"`` (time every node) or ``"estimate"`` (FLOP count, fast).
        stage_profile: with ``profile="measure"``, also time every stage of the plan as a whole
            (a fused group, alone, forward and backward into ``.grad``), scale its nodes' costs
            to that and solve again until the cuts stop moving (at most 3 rounds;
            :mod:`fxpipe.stage_profile`); the factors are in ``plan.profile["stage_profile"]``.
            Then measure every stage's memory (one micro-batch's forward and backward, with and
            without checkpointing and split backward, :mod:`fxpipe.stage_memory`) for the memory
            model (``plan.stages[k].measured_bytes``; ``checkpoint="auto"`` chooses again on it),
            and, for CPU workers that share the processors, how much slower each stage runs
            beside the others in ``contention_steps`` steps of the plan's schedule after a
            warm-up (:mod:`fxpipe.contention`, ``plan.profile["contention"]``), which
            ``pipe.report()`` predicts with.
        contention_steps: timed steps of that measurement (default 3; each costs one training
            step of the full batch); 0 skips it and the report falls back on a synthetic figure.
        loss_fn, example_target: the training loss and a full batch's target (both or neither):
            the last stage's memory is measured, and ``calibrate`` times it, through the real
            loss; without them the loss's buffers are estimated (a softmax cross-entropy's).
        leaf_modules, concrete_args: tracing options (see :func:`fxpipe.trace.trace`).
        optimizer_state_factor: optimizer state per parameter byte (Adam: 2) for the memory limit.
        memory_bytes: per-device memory override for the memory limit.
        progress: print a profiling progress bar on stderr.
        profile_cache: reuse node costs profiled before for the same graph, device, micro-batch
            shapes, mode and thread count (``True``: ``$FXPIPE_CACHE_DIR`` or
            ``~/.cache/fxpipe/profiles``; a path; ``False``: always profile).
    """
    devs = parse_devices(devices)
    if checkpoint not in CHECKPOINT_MODES and checkpoint != "auto":
        raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)} or 'auto', got {checkpoint!r}")
    if checkpoint == "auto" and plan is not None:
        raise ValueError("checkpoint='auto' is a planning choice; a loaded plan= keeps the modes it was made with "
                         "(pass its checkpoint or compile without plan=)")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not supported by the embedded executor; use one of {SCHEDULES}")
    if virtual_stages is not None and schedule != "interleaved-1f1b":
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved-1f1b' (got {schedule!r})")
    v = (virtual_stages or 2) if schedule == "interleaved-1f1b" else 1
    if v < 1:
        raise ValueError(f"virtual_stages must be at least 1, got {v}")
    if profile not in PROFILE_MODES:
        raise ValueError(f"profile must be one of {', '.join(PROFILE_MODES)}, got {profile!r}")
    if (loss_fn is None) != (example_target is None):
        raise ValueError("pass loss_fn and example_target together (the loss and a full batch's target, used to "
                         "measure the last stage's memory), or neither")
    if isinstance(contention_steps, bool) or not isinstance(contention_steps, int) or contention_steps < 0:
        raise ValueError(f"contention_steps must be a whole number of steps, 0 or more, got {contention_steps!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
    gm = trace(model, leaf_modules, concrete_args)
    fingerprint = graph_fingerprint(gm)
    mode_dependent = _mode_dependent(model, leaf_modules, concrete_args, fingerprint)
    if deferred_batch_norm and convert_deferred_batch_norm(gm) == 0:
        log.info("deferred_batch_norm=True but %s has no BatchNorm layer", type(model).__name__)

    if plan is not None and calibrate:
        raise ValueError("calibrate=True re-plans from a profile; it cannot refine a loaded plan= "
                         "(compile with example_inputs instead)")
    if plan is not None:
        if plan.fingerprint != fingerprint:
            raise PlanMismatchError(
                f"the plan was made for another model ({plan.model}, fingerprint {plan.fingerprint[:12]}) "
                f"but this {type(model).__name__} traces to fingerprint {fingerprint[:12]}; "
                "compile without plan= to make a new one"
            )
        if [str(d) for d in devs] != [str(torch.device(d)) for d in plan.devices]:
            raise PlanMismatchError(f"the plan was made for devices {plan.devices}, got {[str(d) for d in devs]}")
        if chunks is not None and chunks != plan.chunks:
            raise PlanMismatchError(f"the plan was made for chunks={plan.chunks}, got chunks={chunks}")
        if plan.traced_training != model.training and mode_dependent:
            raise PlanMismatchError("the plan was made in the other train/eval mode of this mode-dependent model")
        the_plan = plan
    else:
        if example_inputs is None:
            raise ValueError("example_inputs is required to profile the model (or pass plan=fxpipe.load_plan(...))")
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        batch = batch_size_of(list(example_inputs))
        chunks = chunks if chunks is not None else min(batch, 4 * len(devs))
        if v > 1:
            workers = stages // v if stages is not None else len(devs)
            if stages is not None and (stages % v or workers > len(devs)):
                raise ValueError(f"interleaved-1f1b with virtual_stages={v} needs stages = {v} x the devices used "
                                 f"(at most {v * len(devs)}), got stages={stages}")
            check_schedule(schedule, v * workers, workers, chunks)
            all_devices, devs = devs, devs[:workers]
        first = [x.to(devs[0]) if isinstance(x, torch.Tensor) else x for x in scatter(list(example_inputs), chunks)[0]]
        gm.to(devs[0])
        cache = None if profile_cache is False else ProfileCache(None if profile_cache is True else profile_cache)
        key = profile_key(fingerprint, devs[0], tuple(first), profile, warmup, repeats)
        try:
            costs = cache.load(key, gm) if cache is not None else None
            cached = costs is not None
            if costs is None:
                costs = profile_graph(gm, tuple(first), devs[0], mode=profile, warmup=warmup, repeats=repeats,
                                      progress=_progress(progress))
        except Exception as exc:
            raise ValueError(
                f"running the model on example_inputs failed while profiling: {type(exc).__name__}: {exc}; "
                "check that example_inputs match the model's forward()"
            ) from exc
        if cache is not None and not cached:
            cache.store(key, costs)
        mem = list(memory_bytes) if memory_bytes is not None else device_memory_bytes(devs)
        if len(mem) < len(devs) or (len(mem) > len(devs) and v == 1):
            raise ValueError(f"memory_bytes has {len(mem)} entries for {len(devs)} devices")
        planner = Planner(gm=gm, fingerprint=fingerprint, model_name=type(model).__name__, devices=devs,
                          all_devices=all_devices if v > 1 else devs, memory_bytes=mem, chunks=chunks,
                          stages=stages, virtual_stages=v, schedule=schedule, checkpoint=checkpoint,
                          optimizer_state_factor=optimizer_state_factor, batch=batch, profile=profile,
                          training=model.training, profile_extra={"threads": torch.get_num_threads(),
                                                                  "from_cache": cached})
        the_plan = planner.plan(costs)
        rounds: list[dict[str, Any]] | None = None
        if profile == "measure" and stage_profile:
            def timed_alone(measured_on: Plan) -> list[list[float]]:
                return stage_factors(_pipeline(gm, measured_on, checkpoint, mode_dependent), example_inputs,
                                     warmup=warmup, repeats=repeats, target=example_target, loss_fn=loss_fn)
            with _through_the_loss(loss_fn, "timing the last stage"):
                the_plan, costs, rounds = _until_cuts_settle(planner, costs, the_plan, timed_alone)
        if calibrate:
            def timed_in_steps(measured_on: Plan) -> list[list[float]]:
                return stage_time_factors(_pipeline(gm, measured_on, checkpoint, mode_dependent), example_inputs,
                                          steps=calibration_steps, target=example_target, loss_fn=loss_fn)
            with _through_the_loss(loss_fn, "calibrating"):
                the_plan, costs, calibration = _until_cuts_settle(planner, costs, the_plan, timed_in_steps)
            the_plan.profile["calibration"] = {"steps": calibration_steps, **calibration[-1], "rounds": calibration,
                                               "loss": "loss_fn" if loss_fn is not None else "sum of outputs"}
        if rounds is not None:
            the_plan.profile["stage_profile"] = rounds
            pipe = _pipeline(gm, the_plan, checkpoint, mode_dependent)
            _measure_memory(pipe, example_inputs, example_target, loss_fn)
            if not calibrate and contention_steps:   # a calibrated plan's times were measured in steps already
                with _through_the_loss(loss_fn, "measuring the stages' contention"):
                    contention = measure_contention(pipe, example_inputs, contention_steps, example_target, loss_fn)
                if contention is not None:
                    the_plan.profile["contention"] = contention
            return pipe
    return _pipeline(gm, the_plan, checkpoint, mode_dependent)


def _until_cuts_settle(planner: Planner, costs: dict[str, Any], plan: Plan,
                       measure: Callable[[Plan], list[list[float]]],
                       limit: int = 3) -> tuple[Plan, dict[str, Any], list[dict[str, Any]]]:
    """Measure the plan's stages (``[forward, backward]`` measured/planned per stage), scale the node costs to
    them and plan again, until the cuts stop moving (at most ``limit`` rounds), so the final plan's stage times
    are measured ones. Cuts that still move after ``limit`` rounds (two plans about as good, each looking
    better on the other's measurement) end on the measured plan that is fastest on its own measured times,
    never on one that was not measured. Returns the plan, its costs and a record per round (``round`` says in
    which order they were measured); the chosen plan's record is the last."""
    measured: list[tuple[Plan, dict[str, Any], dict[str, Any]]] = []
    for _ in range(limit):
        factors = measure(plan)
        measured_on = plan
        costs = scale_costs(costs, measured_on, factors)
        record = {"round": len(measured), "stage_nodes": [len(st.nodes) for st in measured_on.stages],
                  "factors": factors}
        plan = planner.plan(costs)
        if plan.stage_of() == measured_on.stage_of():
            return plan, costs, [r for _, _, r in measured] + [record]
        measured.append((measured_on, costs, record))
    # unsettled: each measured plan on its own measurement, its stage times the measured ones
    candidates = [planner.costed(costs, measured_on) for measured_on, costs, _ in measured]
    best = min(range(len(measured)), key=lambda r: candidates[r].predicted["iteration_s"])
    _, costs, record = measured[best]
    record["chosen_of_unsettled"] = True
    return candidates[best], costs, [r for k, (_, _, r) in enumerate(measured) if k != best] + [record]


@contextmanager
def _through_the_loss(loss_fn: Any, what: str) -> Iterator[None]:
    """Name ``loss_fn`` and ``example_target`` when ``what`` (which runs them) fails."""
    try:
        yield
    except Exception as exc:
        if loss_fn is None:
            raise
        raise ValueError(f"{what} through loss_fn(output, example_target) failed: {type(exc).__name__}: {exc}; "
                         "check that example_target matches example_inputs and the model's output") from exc


def _measure_memory(pipe: Pipeline, example_inputs: tuple, target: Any, loss_fn: Any) -> None:
    """Put each stage's measured memory sizes into the plan; ``checkpoint="auto"`` chooses again on them."""
    with _through_the_loss(loss_fn, "measuring the last stage's memory"):
        sizes = measure_stage_bytes(pipe, example_inputs, target, loss_fn)
    for st, measured in zip(pipe.plan.stages, sizes):
        st.measured_bytes = measured
    if pipe.plan.checkpoint == "auto":
        choose_checkpoints(pipe.plan)     # MemoryError when even "always" does not fit


def _pipeline(gm: Any, plan: Plan, checkpoint: str, mode_dependent: bool) -> Pipeline:
    specs = split_graph(gm, plan.stage_of(), len(plan.stages))
    stage_devices = [torch.device(s.device) for s in plan.stages]
    for spec, dev in zip(specs, stage_devices):
        move_stage(spec, dev)
    return Pipeline(gm, specs, stage_devices, plan, checkpoint=checkpoint, mode_dependent=mode_dependent)
