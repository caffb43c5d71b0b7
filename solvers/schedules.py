"""Pipeline schedules as records: the order of operations each worker runs, and all the rest asks of it.

An operation is ``(kind, stage, micro_batch)``, its kind spelled as torch.distributed.pipelining's actions:
``"F"`` is a forward; ``"B"`` a whole backward; schedules that split the backward (zero-bubble) run ``"I"``,
the input-gradient pass, and ``"W"``, the weight-gradient pass, so a split backward is read off the order.
A worker is a device: ``gpipe``, ``1f1b`` and ``zb-h1`` have one stage per worker, ``interleaved-1f1b`` puts
``v`` stages on each of ``p`` workers (stage ``s`` on worker ``s % p``, Megatron-LM's layout), and ``zb-v`` and
``dualpipev`` two in a V (worker ``w`` holding stages ``w`` and ``2p - 1 - w``). :mod:`solvers.schedule_orders`
makes each one's orders and says what they are; these lists are what the executors run and what
:mod:`solvers.simulate` times.

Each schedule is one frozen :class:`Schedule` record in :data:`REGISTRY`: its placement, order generator,
in-flight rule, memory model, closed form and torch class. Every other module asks the record
(:func:`get_schedule`) and none compares a schedule's name (``tests/test_schedule_registry.py``): a new
schedule is one record here and one order generator there (``docs/extending.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from solvers import schedule_orders as orders
from solvers.schedule_orders import Op

__all__ = ["Schedule", "REGISTRY", "SCHEDULES", "MEMORY_MODELS", "ONE_STAGE", "PLACEMENTS", "Op", "KINDS", "BACKWARDS",
           "get_schedule", "splits_backward", "worker_orders", "stage_worker", "check_schedule", "inflight",
           "stages_per_worker"]

KINDS = ("F", "B", "I", "W")   # forward, whole backward, input-gradient pass, weight-gradient pass
BACKWARDS = ("B", "I")         # the kinds that send gradients back to the stages that fed this one

PLACEMENTS = ("one", "looped", "v")   # stage s on worker s; on worker s % p; worker w holds w and 2p-1-w

Orders = Callable[[int, int, int], "list[list[Op]]"]   # (stages, workers, micro-batches) -> each worker's order
InFlight = Callable[[int, int, int], int]              # (stage, stages, micro-batches) -> micro-batches held
StepUnits = Callable[[int, int, int, float], float]    # (workers, micro-batches, virtual stages, rho) -> step


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule: everything the planner, the solvers, the simulator and the runtimes ask of it.

    ``placement`` (:data:`PLACEMENTS`) puts stages on workers; ``orders`` makes every worker's operations (the
    shape already checked); ``split_backward``: its orders run ``"I"`` (input gradients) and ``"W"`` (weight
    gradients) in place of a whole backward ``"B"``; ``inflight`` the micro-batches a stage holds at its peak;
    ``plans_as`` the one-stage memory model the
    cut solver plans it under (:attr:`solvers.Problem.schedule`, :data:`MEMORY_MODELS`); ``one_stage_form`` the
    one-stage-per-worker schedule the anchor partitioners judge it by; ``looser`` a schedule whose memory model
    holds at most as much (its feasible set contains this one's), whose plan is solved first and reused where it
    fits
    (:func:`solvers.schedule_search.reuse`); ``single_batch``: it is the one schedule that runs a pipeline of
    one micro-batch (every schedule runs it as the stages in turn, so the others are not searched there);
    ``step_units`` the mesh search's closed form of a step in units of the slowest stage's per-micro-batch time
    (:func:`solvers.mesh_search.evaluate_cuts`); ``fill_drain``: one stage per worker and a whole backward, so a
    micro-batch's forwards and backwards chain through every stage (:func:`solvers.schedule_search.lower_bound`);
    ``monotone_inflight``: dropping a stage never raises another's in-flight count (:mod:`solvers.spine`);
    ``torch_class`` the class of ``torch.distributed.pipelining.schedules`` that runs it (``None``: fxpipe's
    order runs there as an action CSV); ``asynchronous``: PipeDream's weight-stashing training
    (:class:`fxpipe.AsyncTrainer`, :mod:`solvers.asynchronous`) runs its order; ``fills``: it needs at least as
    many micro-batches as stages (its steady state starts once the V is full)."""

    name: str
    placement: str
    orders: Orders
    inflight: InFlight
    step_units: StepUnits
    split_backward: bool = False
    plans_as: Optional[str] = None
    one_stage_form: Optional[str] = None
    looser: Optional[str] = None
    single_batch: bool = False
    monotone_inflight: bool = True
    torch_class: Optional[str] = None
    asynchronous: bool = False
    fills: bool = False

    @property
    def memory_model(self) -> str:
        """The one-stage memory model the cut solver plans this schedule under."""
        return self.plans_as or self.name

    @property
    def one_stage(self) -> str:
        """The one-stage-per-worker schedule that judges this one's cuts."""
        return self.one_stage_form or self.name

    @property
    def multi_stage(self) -> bool:
        """Several stages on each worker (looped or V)."""
        return self.placement != "one"

    @property
    def fill_drain(self) -> bool:
        """One stage per worker and a whole backward (see the class docstring)."""
        return self.placement == "one" and not self.split_backward

    def stages_per_worker(self, virtual_stages: int = 2) -> int:
        """How many stages each worker runs: ``virtual_stages`` when looped, 2 in a V, else 1."""
        return {"one": 1, "looped": virtual_stages, "v": 2}[self.placement]

    def workers(self, stages: int, planned_workers: Optional[int] = None) -> int:
        """The workers ``stages`` stages run on: a plan's own count (``planned_workers``) for several stages a
        worker, else one a stage; for a V without a plan, half the stages."""
        if not self.multi_stage:
            return stages
        return planned_workers if planned_workers is not None else stages // self.stages_per_worker()

    def worker_of(self, stage: int, workers: int) -> int:
        """The worker that runs ``stage``."""
        if self.placement == "v":
            return stage if stage < workers else 2 * workers - 1 - stage
        return stage % workers if self.placement == "looped" else stage

    def check(self, stages: int, workers: int, micro_batches: int) -> None:
        """Raise ``ValueError`` saying what is wrong if this schedule cannot run the shape."""
        if workers < 1 or stages < 1 or micro_batches < 1:
            raise ValueError(f"stages, workers and micro-batches must be positive, got {stages}, {workers}, "
                             f"{micro_batches}")
        if self.placement == "looped":
            if stages % workers:
                raise ValueError(f"{self.name} needs a multiple of {workers} stages (v per worker), got {stages}")
            if micro_batches % workers:
                raise ValueError(f"{self.name} runs micro-batches in groups of the {workers} workers; "
                                 f"{micro_batches} is not a multiple of {workers}: use chunks="
                                 f"{-(-micro_batches // workers) * workers}")
        elif self.placement == "v":
            if stages != 2 * workers:
                raise ValueError(f"{self.name} runs two stages per worker in a V (worker w holds stages w and "
                                 f"2p-1-w); got {stages} stages on {workers} workers: use {2 * workers} stages")
            if self.fills and micro_batches < stages:
                raise ValueError(f"{self.name} needs at least as many micro-batches as stages to fill its V; got "
                                 f"{micro_batches} micro-batches for {stages} stages: use chunks={stages} or more")
        elif stages != workers:
            several = " or ".join(s.name for s in REGISTRY.values() if s.multi_stage)
            raise ValueError(f"{self.name} runs one stage per worker; got {stages} stages on {workers} workers "
                             f"(use {several} for several stages per worker)")


def get_schedule(schedule: "str | Schedule") -> Schedule:
    """The record of ``schedule`` (a name of :data:`SCHEDULES`, or a record); an unknown name raises
    ``ValueError`` listing the known ones."""
    if isinstance(schedule, Schedule):
        return schedule
    found = REGISTRY.get(schedule)   # type: ignore[arg-type]
    if found is None:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(REGISTRY)}")
    return found


def splits_backward(schedule: str) -> bool:
    """Whether ``schedule`` splits its backward: ``False`` for ``"auto"``, which has not chosen one yet (any other
    unknown name raises, as :func:`get_schedule` does)."""
    return schedule != "auto" and get_schedule(schedule).split_backward


def stages_per_worker(schedule: str, virtual_stages: int = 2) -> int:
    """How many stages each worker runs: ``virtual_stages`` for interleaved 1F1B, 2 for ZB-V, else 1."""
    return get_schedule(schedule).stages_per_worker(virtual_stages)


def check_schedule(schedule: str, stages: int, workers: int, micro_batches: int) -> None:
    """Raise ``ValueError`` saying what is wrong if the schedule cannot run this shape."""
    get_schedule(schedule).check(stages, workers, micro_batches)


def inflight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations ``stage`` holds at its peak (GPipe: all; ZB-H1: ``p``, its weight
    passes trailing by ``stage``; 1F1B and interleaved, counted over all stages: ``p - s``; ZB-V: read off its
    order)."""
    return get_schedule(schedule).inflight(stage, stages, micro_batches)


def stage_worker(schedule: str, stage: int, workers: int) -> int:
    """The worker that runs ``stage``."""
    return get_schedule(schedule).worker_of(stage, workers)


def worker_orders(schedule: str, stages: int, micro_batches: int, workers: int | None = None) -> list[list[Op]]:
    """The operations of every worker, in the order it runs them."""
    record = get_schedule(schedule)
    workers = stages if workers is None else workers
    record.check(stages, workers, micro_batches)
    return record.orders(stages, workers, micro_batches)


def _pipeline_depth(stage: int, stages: int, m: int) -> int:
    return min(m, stages - stage)


def _held_in_order(name: str) -> InFlight:
    """A V schedule's in-flight rule, read off its order: the most forwards a stage has run whose whole backward
    ``B`` or weight pass ``W`` has not (``p - s`` for an odd stage count, which a V cannot have and the cut solver
    may ask of a dropped stage; for too few micro-batches to fill the V, what its order would hold)."""
    def held_at_peak(stage: int, stages: int, m: int) -> int:
        if stages % 2:
            return _pipeline_depth(stage, stages, m)
        record, workers = REGISTRY[name], stages // 2
        filled = max(m, stages) if record.fills else m
        held = peak = 0
        for kind, s, i in record.orders(stages, workers, filled)[record.worker_of(stage, workers)]:
            if s == stage and i < m and kind in ("F", "B", "W"):
                held += 1 if kind == "F" else -1
                peak = max(peak, held)
        return peak
    return held_at_peak


def _fill_drain_units(p: int, m: int, v: int, rho: float) -> float:
    return m + p - 1


def _interleaved_units(p: int, m: int, v: int, rho: float) -> float:
    return v * m + p - 1


def _zero_bubble_units(p: int, m: int, v: int, rho: float) -> float:
    return m + (p - 1) * rho


def _zb_v_units(p: int, m: int, v: int, rho: float) -> float:
    return 2 * m + (p - 1) * rho


REGISTRY: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "one", orders.gpipe_orders, lambda stage, stages, m: m, _fill_drain_units, looser="1f1b",
             single_batch=True, torch_class="ScheduleGPipe"),
    Schedule("1f1b", "one", lambda stages, p, m: [orders.one_f_one_b_order(s, p, m) for s in range(p)], _pipeline_depth,
             _fill_drain_units, torch_class="Schedule1F1B", asynchronous=True),
    Schedule("interleaved-1f1b", "looped",
             lambda stages, p, m: [orders.interleaved_order(r, p, stages // p, m) for r in range(p)],
             _pipeline_depth, _interleaved_units, plans_as="1f1b", one_stage_form="1f1b",
             torch_class="ScheduleInterleaved1F1B"),
    Schedule("zb-h1", "one", lambda stages, p, m: [orders.zb_h1_order(s, p, m) for s in range(p)],
             lambda stage, stages, m: min(m, stages), _zero_bubble_units, split_backward=True, looser="1f1b"),
    Schedule("zb-v", "v", lambda stages, p, m: [orders.zb_v_order(w, p, m) for w in range(p)], _held_in_order("zb-v"),
             _zb_v_units, split_backward=True, one_stage_form="zb-h1", monotone_inflight=False),
    Schedule("dualpipev", "v", lambda stages, p, m: [orders.dualpipev_order(w, p, m) for w in range(p)],
             _held_in_order("dualpipev"), _zb_v_units, split_backward=True, one_stage_form="zb-h1",
             monotone_inflight=False, torch_class="ScheduleDualPipeV", fills=True),
)}
"""Every schedule, in the order ties between equally fast plans are broken (the simpler first)."""

SCHEDULES: tuple[str, ...] = tuple(REGISTRY)
MEMORY_MODELS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.memory_model == n)
"""The one-stage memory models the cut solver plans under (:attr:`solvers.Problem.schedule`)."""
ONE_STAGE = "1f1b"
"""The schedule a run of one stage names (plain gradient accumulation, one micro-batch in flight)."""
