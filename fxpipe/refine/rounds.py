"""Refining a plan on measurements of its own compiled stages, round after round until the cuts settle.

The first plan rests on node costs measured one node at a time. :func:`refine` builds it, times its
stages whole (:mod:`fxpipe.refine.stage_profile`) or in training steps (:mod:`fxpipe.refine.calibrate`),
scales the node costs to those times and plans again (:func:`until_cuts_settle`); then it measures the
final stages' memory (:mod:`fxpipe.refine.stage_memory`) and how CPU workers slow each other
(:mod:`fxpipe.refine.contention`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from fxpipe.options import ProfileOptions
from fxpipe.planning.memory_model import choose_checkpoints
from fxpipe.planning.plan import Plan
from fxpipe.planning.planner import Planner
from fxpipe.refine.calibrate import scale_costs, stage_time_factors
from fxpipe.refine.contention import measure_contention
from fxpipe.refine.stage_memory import measure_stage_bytes
from fxpipe.refine.stage_profile import stage_compile_seconds, stage_factors
from fxpipe.runtime.execute.compiled import describe
from fxpipe.runtime.execute.pipeline import Pipeline

__all__ = ["record_compilation", "refine", "until_cuts_settle"]


def refine(planner: Planner, costs: dict[str, Any], plan: Plan, build: Callable[[Plan], Pipeline],
           example_inputs: tuple, options: ProfileOptions, loss_fn: Any = None,
           example_target: Any = None, compiled: dict[str, Any] | None = None) -> Pipeline:
    """The pipeline of ``plan`` refined as ``options`` ask (stage timing, calibration, memory, contention).

    With ``compiled`` stages (``torch.compile`` keyword arguments, :mod:`fxpipe.runtime.execute.compiled`) and measured
    costs, the stages are timed compiled whatever the effort: fusion crosses the nodes' boundaries, so only a
    compiled stage timed whole says what it costs; the time its first run spent compiling goes to
    ``plan.compiled`` (:func:`record_compilation`), apart from the stage times. ``build`` should return the
    stages it built before for the same cuts, so that the final pipeline runs the code compiled while timing."""
    rounds: list[dict[str, Any]] | None = None
    compile_s: dict[tuple, list[float]] = {}   # a measured plan's cuts -> its stages' compile seconds
    if options.measures_stages or (compiled is not None and options.mode == "measure"):
        def timed_alone(measured_on: Plan) -> list[list[float]]:
            seconds: list[float] = []
            factors = stage_factors(build(measured_on), example_inputs, warmup=max(options.warmup, compiled is not None),
                                    repeats=options.repeats, target=example_target, loss_fn=loss_fn,
                                    compile_seconds=seconds)
            compile_s[_cuts(measured_on)] = seconds
            return factors
        with through_the_loss(loss_fn, "timing the last stage"):
            # compiled stages at effort="fast": each round compiles its stages, so two rounds at most (the first
            # plan and the one its measurement chose; unsettled, the faster of the two on its own measurement)
            plan, costs, rounds = until_cuts_settle(planner, costs, plan, timed_alone,
                                                    limit=3 if options.measures_stages else 2)
    if options.calibrate:
        def timed_in_steps(measured_on: Plan) -> list[list[float]]:
            return stage_time_factors(build(measured_on), example_inputs, steps=options.calibration_steps,
                                      target=example_target, loss_fn=loss_fn)
        with through_the_loss(loss_fn, "calibrating"):
            plan, costs, calibration = until_cuts_settle(planner, costs, plan, timed_in_steps)
        plan.profile["calibration"] = {"steps": options.calibration_steps, **calibration[-1], "rounds": calibration,
                                       "loss": "loss_fn" if loss_fn is not None else "sum of outputs"}
    if rounds is None:
        pipe = build(plan)
        if compiled is not None:
            with through_the_loss(loss_fn, "compiling the stages"):
                record_compilation(pipe, stage_compile_seconds(pipe, example_inputs, example_target, loss_fn))
        return pipe
    plan.profile["stage_profile"] = rounds
    pipe = build(plan)
    if compiled is not None:
        record_compilation(pipe, compile_s.get(_cuts(plan)))
    if not options.measures_stages:   # compiled stages timed at effort="fast": no memory or contention steps
        return pipe
    measure_memory(pipe, example_inputs, example_target, loss_fn)
    if not options.calibrate and options.contention_steps:   # a calibrated plan's times were measured in steps
        with through_the_loss(loss_fn, "measuring the stages' contention"):
            contention = measure_contention(pipe, example_inputs, options.contention_steps, example_target, loss_fn)
        if contention is not None:
            plan.profile["contention"] = contention
    return pipe


def until_cuts_settle(planner: Planner, costs: dict[str, Any], plan: Plan,
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


def _cuts(plan: Plan) -> tuple:
    return tuple(sorted(plan.stage_of().items())) + tuple(st.device for st in plan.stages)


def record_compilation(pipe: Pipeline, stage_seconds: list[float] | None) -> None:
    """``plan.compiled``: the options the stages were compiled with and, where measured, the seconds each
    stage's first forward and backward spent compiling (not in any stage or step time)."""
    if pipe.compiled is None:
        pipe.plan.compiled = None
        return
    record: dict[str, Any] = {"options": describe(pipe.compiled)}
    if stage_seconds is not None:
        record.update(compile_s=sum(stage_seconds), stage_compile_s=list(stage_seconds))
    pipe.plan.compiled = record


@contextmanager
def through_the_loss(loss_fn: Any, what: str) -> Iterator[None]:
    """Name ``loss_fn`` and ``example_target`` when ``what`` (which runs them) fails."""
    try:
        yield
    except Exception as exc:
        if loss_fn is None:
            raise
        raise ValueError(f"{what} through loss_fn(output, example_target) failed: {type(exc).__name__}: {exc}; "
                         "check that example_target matches example_inputs and the model's output") from exc


def measure_memory(pipe: Pipeline, example_inputs: tuple, target: Any, loss_fn: Any) -> None:
    """Put each stage's measured memory sizes into the plan; ``checkpoint="auto"`` chooses again on them."""
    with through_the_loss(loss_fn, "measuring the last stage's memory"):
        sizes = measure_stage_bytes(pipe, example_inputs, target, loss_fn)
    for st, measured in zip(pipe.plan.stages, sizes):
        st.measured_bytes = measured
    if pipe.plan.checkpoint == "auto":
        choose_checkpoints(pipe.plan)     # MemoryError when even "always" does not fit
