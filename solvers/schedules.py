"""Pipeline schedules: the order of operations each worker runs.

An operation is ``(kind, stage, micro_batch)``, its kind spelled as torch.distributed.pipelining's actions:
``"F"`` is a forward; ``"B"`` a whole backward; schedules that split the backward (zero-bubble) run ``"I"``,
the input-gradient pass, and ``"W"``, the weight-gradient pass, so a split backward is read off the order. A worker is a
device: ``gpipe``, ``1f1b`` and ``zb-h1`` have one stage per worker, while
``interleaved-1f1b`` puts ``v`` stages on each of ``p`` workers (stage ``s`` on
worker ``s % p``, Megatron-LM's layout).

- ``gpipe``: every forward, then every backward from the last micro-batch
  (fill-drain, torchgpipe's order: the last forward's activations are used at
  once, so ``checkpoint="except_last"`` never recomputes it). All ``m``
  micro-batches are in flight at once.
- ``1f1b``: ``p - s - 1`` warm-up forwards on stage ``s``, then one forward and one
  backward in turn, then the remaining backwards: at most ``p - s`` in flight.
- ``interleaved-1f1b`` (Narayanan et al., 2021): the same in units of ``p``
  micro-batches over ``v`` model chunks; the warm-up is ``2(p - r - 1) + (v - 1)p``
  operations on worker ``r``; the bubble shrinks by ``v``. Needs ``m`` a multiple
  of ``p`` (so the chunks' groups line up); other values get an error that says so.
- ``zb-h1`` (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's
  forwards and input-gradient passes ``B``; the weight-gradient pass ``W`` of
  stage ``s`` trails its ``B`` by ``s`` micro-batches and fills the drain's idle
  slots. Only ``B`` is on the critical path back to stage 0, so the bubble is
  ``(p - 1)(F + B - W)`` instead of 1F1B's ``(p - 1)(F + B + W)``; every stage
  keeps at most ``p`` micro-batches' activations (the most 1F1B keeps, on stage 0).
- ``zb-v`` (the same paper's ZB-V; torch.distributed.pipelining's ``ScheduleZBVZeroBubble``): ``2p``
  stages in a V, worker ``w`` holding stages ``w`` and ``2p - 1 - w`` (so the first and the last stage,
  where the loss is, share worker 0), the backward split into ``B`` and ``W``. Worker ``w`` warms up
  with ``2(p - w) - 1`` forwards of its first stage, then ``w`` pairs of forwards, then ``p - w``
  rounds of its second stage's ``F B W``; the steady state alternates the two stages' ``F B W``;
  the cool-down runs the remaining ``B`` and lets the ``W`` fill the wait for them. The order is made
  for ``max(m, 2p - 1)`` micro-batches and the operations of those beyond ``m`` are dropped (as
  torch does), which keeps it a valid dependency order for any ``m``. Each worker holds about the
  activations of 1F1B's stage 0 with half the per-stage cost, and the bubble nearly vanishes when
  ``F``, ``B`` and ``W`` take about the same time.

These lists are what the executors run and what :mod:`solvers.simulate` times.

Each schedule is one frozen :class:`Schedule` record in :data:`REGISTRY`: its placement, order generator,
in-flight rule, memory model, closed form and torch class. Every other module asks the record
(:func:`get_schedule`) and none compares a schedule's name (``tests/test_schedule_registry.py``): a new
schedule is one record and one order generator here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Schedule", "REGISTRY", "SCHEDULES", "MEMORY_MODELS", "ONE_STAGE", "PLACEMENTS", "Op", "KINDS", "BACKWARDS", "get_schedule",
           "worker_orders", "stage_worker", "check_schedule", "inflight", "stages_per_worker"]

Op = tuple[str, int, int]
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


def _gpipe(stages: int, p: int, m: int) -> list[list[Op]]:
    """Backward from the last micro-batch, as torchgpipe: it needs no recomputation of the last forward."""
    return [[("F", s, i) for i in range(m)] + [("B", s, i) for i in reversed(range(m))] for s in range(p)]


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


def _one_f_one_b(s: int, p: int, m: int) -> list[Op]:
    warm = min(p - s - 1, m)
    order: list[Op] = [("F", s, i) for i in range(warm)]
    for f in range(warm, m):
        order += [("F", s, f), ("B", s, f - warm)]
    return order + [("B", s, b) for b in range(m - warm, m)]


def _zb_h1(s: int, p: int, m: int) -> list[Op]:
    warm = min(p - s - 1, m)
    delay = s                  # W trails B by s micro-batches: every stage holds at most p in flight
    order: list[Op] = [("F", s, i) for i in range(warm)]
    w = 0
    for f in range(warm, m):
        b = f - warm
        order += [("F", s, f), ("I", s, b)]
        if b - w >= delay:
            order.append(("W", s, w))
            w += 1
    for b in range(m - warm, m):   # drain: each B, then the oldest pending W fills the wait for the next B
        order.append(("I", s, b))
        if w <= b:
            order.append(("W", s, w))
            w += 1
    return order + [("W", s, i) for i in range(w, m)]


def _zb_v(w: int, p: int, m: int) -> list[Op]:
    n = max(m, 2 * p - 1)   # enough micro-batches to fill the V; the extra ones' operations are dropped
    first, second = w, 2 * p - 1 - w
    count = {(kind, s): 0 for kind in "FIW" for s in (first, second)}
    order: list[Op] = []

    def add(kind: str, s: int, i: int | None = None) -> None:
        i = count[(kind, s)] if i is None else i
        count[(kind, s)] = i + 1
        order.append((kind, s, i))

    for _ in range(2 * (p - w) - 1):   # warm-up: the first stage fills the V's way down
        add("F", first)
    for _ in range(w):
        add("F", second)
        add("F", first)
    for _ in range(p - w):   # the second stage starts its backwards (the loss is at the V's end)
        add("F", second)
        add("I", second)
        add("W", second)
    while count[("F", second)] < count[("F", first)] or count[("F", first)] < n:   # steady state
        if count[("F", first)] < n:
            add("F", first)
        add("I", first)
        add("W", first)
        add("F", second)
        add("I", second)
        add("W", second)
    for _ in range(w):   # cool-down: the remaining input gradients first, the weight passes fill the waits
        add("I", first)
        add("I", second)
    for _ in range(p - w):
        add("I", first)
        add("W", first)
    for s in (second, first):
        while count[("W", s)] < count[("I", s)]:
            add("W", s)
    assert all(count[("F", s)] == count[("I", s)] == count[("W", s)] for s in (first, second))
    return [op for op in order if op[2] < m]


def _dualpipev(w: int, p: int, m: int) -> list[Op]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V; torch's ``ScheduleDualPipeV``, whose order this is):
    worker ``w`` holds stages ``w`` and ``2p - 1 - w``; after the V fills, each step pairs a forward of one stage
    with a whole backward of the other (torch's ``OVERLAP_F_B``, here the forward then the backward), and the
    ends use input-gradient passes whose weight passes fill the waits. Needs ``m >= 2p``."""
    first, second = w, 2 * p - 1 - w
    count: dict[tuple[str, int], int] = {}
    waiting: list[tuple[int, int]] = []   # input passes whose weight pass has not run, oldest first
    order: list[Op] = []

    def add(kind: str, s: int) -> None:
        i = count.get(("B" if kind == "I" else kind, s), 0)   # B and I count the stage's backwards together
        order.append((kind, s, i))
        count[("B" if kind == "I" else kind, s)] = i + 1
        if kind == "I":
            waiting.append((s, i))

    def weight() -> None:
        if waiting:
            s, i = waiting.pop(0)
            order.append(("W", s, i))

    for _ in range(2 * (p - w - 1)):   # 1: the first stage's forwards fill the V's way down
        add("F", first)
    for _ in range(w + 1):             # 2: both stages' forwards
        add("F", first)
        add("F", second)
    for _ in range(p - w - 1):         # 3: the second stage's input passes, zero-bubble
        add("I", second)
        weight()
        add("F", second)
    for k in range(m - 2 * p + w + 1):   # 4: the main step, each forward paired with the other stage's backward
        add("F", first)
        add("B", second)
        add("F", second)
        add("B", first)
    for _ in range(p - w - 1):         # 5
        add("B", second)
        add("F", second)
        add("B", first)
    split = False
    for k in range(w + 1):             # 6: the second half of the backwards split, zero-bubble
        split = split or (k == (w + 1) // 2 and w % 2 == 1)
        add("I" if split else "B", second)
        split = split or (k == (w + 1) // 2 and w % 2 == 0)
        add("I" if split else "B", first)
    for _ in range(p - w - 1):         # 7
        weight()
        add("I" if split else "B", first)
    for _ in range(w + 1):             # 8: the remaining weight passes
        weight()
    return order


def _interleaved(r: int, p: int, v: int, m: int) -> list[Op]:
    total = m * v

    def op(kind: str, k: int) -> Op:
        chunk = (k // p) % v
        if kind == "B":
            chunk = v - 1 - chunk
        return kind, chunk * p + r, (k // (p * v)) * p + k % p

    warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    order = [op("F", k) for k in range(warm)]
    for k in range(warm, total):
        order += [op("F", k), op("B", k - warm)]
    return order + [op("B", k) for k in range(total - warm, total)]


REGISTRY: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "one", _gpipe, lambda stage, stages, m: m, _fill_drain_units, looser="1f1b",
             single_batch=True, torch_class="ScheduleGPipe"),
    Schedule("1f1b", "one", lambda stages, p, m: [_one_f_one_b(s, p, m) for s in range(p)], _pipeline_depth,
             _fill_drain_units, torch_class="Schedule1F1B", asynchronous=True),
    Schedule("interleaved-1f1b", "looped", lambda stages, p, m: [_interleaved(r, p, stages // p, m) for r in range(p)],
             _pipeline_depth, _interleaved_units, plans_as="1f1b", one_stage_form="1f1b",
             torch_class="ScheduleInterleaved1F1B"),
    Schedule("zb-h1", "one", lambda stages, p, m: [_zb_h1(s, p, m) for s in range(p)],
             lambda stage, stages, m: min(m, stages), _zero_bubble_units, split_backward=True, looser="1f1b"),
    Schedule("zb-v", "v", lambda stages, p, m: [_zb_v(w, p, m) for w in range(p)], _held_in_order("zb-v"),
             _zb_v_units, split_backward=True, one_stage_form="zb-h1", monotone_inflight=False),
    Schedule("dualpipev", "v", lambda stages, p, m: [_dualpipev(w, p, m) for w in range(p)],
             _held_in_order("dualpipev"), _zb_v_units, split_backward=True, one_stage_form="zb-h1",
             monotone_inflight=False, torch_class="ScheduleDualPipeV", fills=True),
)}
"""Every schedule, in the order ties between equally fast plans are broken (the simpler first)."""

SCHEDULES: tuple[str, ...] = tuple(REGISTRY)
MEMORY_MODELS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.memory_model == n)
"""The one-stage memory models the cut solver plans under (:attr:`solvers.Problem.schedule`)."""
ONE_STAGE = "1f1b"
"""The schedule a run of one stage names (plain gradient accumulation, one micro-batch in flight)."""
