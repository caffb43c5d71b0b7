"""Pipeline schedules: the order of operations each worker runs.

An operation is ``(kind, stage, micro_batch)``. ``"F"`` is a forward; ``"B"`` a
backward; schedules that split the backward (zero-bubble) run ``"B"`` as the
input-gradient pass only and ``"W"`` as the weight-gradient pass. A worker is a
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
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "SPLIT_BACKWARD", "MULTI_STAGE", "Op", "worker_orders", "stage_worker", "check_schedule",
           "inflight", "stages_per_worker"]

Op = tuple[str, int, int]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
SPLIT_BACKWARD = ("zb-h1", "zb-v")   # schedules whose backward is split into B (inputs) and W (weights)
MULTI_STAGE = ("interleaved-1f1b", "zb-v")   # schedules that put several stages on each worker


def stages_per_worker(schedule: str, virtual_stages: int = 2) -> int:
    """How many stages each worker runs: ``virtual_stages`` for interleaved 1F1B, 2 for ZB-V, else 1."""
    return virtual_stages if schedule == "interleaved-1f1b" else 2 if schedule == "zb-v" else 1


def check_schedule(schedule: str, stages: int, workers: int, micro_batches: int) -> None:
    """Raise ``ValueError`` saying what is wrong if the schedule cannot run this shape."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if workers < 1 or stages < 1 or micro_batches < 1:
        raise ValueError(f"stages, workers and micro-batches must be positive, got {stages}, {workers}, "
                         f"{micro_batches}")
    if schedule == "interleaved-1f1b":
        if stages % workers:
            raise ValueError(f"interleaved-1f1b needs a multiple of {workers} stages (v per worker), got {stages}")
        if micro_batches % workers:
            raise ValueError(f"interleaved-1f1b runs micro-batches in groups of the {workers} workers; "
                             f"{micro_batches} is not a multiple of {workers}: use chunks="
                             f"{-(-micro_batches // workers) * workers}")
    elif schedule == "zb-v":
        if stages != 2 * workers:
            raise ValueError(f"zb-v runs two stages per worker in a V (worker w holds stages w and 2p-1-w); "
                             f"got {stages} stages on {workers} workers: use {2 * workers} stages")
    elif stages != workers:
        raise ValueError(f"{schedule} runs one stage per worker; got {stages} stages on {workers} workers "
                         f"(use interleaved-1f1b or zb-v for several stages per worker)")


def inflight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations ``stage`` holds at its peak (GPipe: all; ZB-H1: ``p``, its weight
    passes trailing by ``stage``; 1F1B and interleaved, counted over all stages: ``p - s``)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "zb-h1":
        return min(micro_batches, stages)
    if schedule == "zb-v" and stages % 2 == 0:   # read off the order: forwards run whose weight pass has not
        workers = stages // 2
        order = _zb_v(stage_worker(schedule, stage, workers), workers, micro_batches)
        held = peak = 0
        for kind, s, _ in order:
            if s == stage and kind in ("F", "W"):
                held += 1 if kind == "F" else -1
                peak = max(peak, held)
        return peak
    return min(micro_batches, stages - stage)


def stage_worker(schedule: str, stage: int, workers: int) -> int:
    """The worker that runs ``stage``."""
    if schedule == "zb-v":
        return stage if stage < workers else 2 * workers - 1 - stage
    return stage % workers if schedule == "interleaved-1f1b" else stage


def worker_orders(schedule: str, stages: int, micro_batches: int, workers: int | None = None) -> list[list[Op]]:
    """The operations of every worker, in the order it runs them."""
    workers = stages if workers is None else workers
    check_schedule(schedule, stages, workers, micro_batches)
    m, p = micro_batches, workers
    if schedule == "gpipe":   # backward from the last micro-batch, as torchgpipe: it needs no recomputation
        return [[("F", s, i) for i in range(m)] + [("B", s, i) for i in reversed(range(m))] for s in range(p)]
    if schedule == "1f1b":
        return [_one_f_one_b(s, p, m) for s in range(p)]
    if schedule == "zb-h1":
        return [_zb_h1(s, p, m) for s in range(p)]
    if schedule == "zb-v":
        return [_zb_v(w, p, m) for w in range(p)]
    return [_interleaved(r, p, stages // p, m) for r in range(p)]


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
        order += [("F", s, f), ("B", s, b)]
        if b - w >= delay:
            order.append(("W", s, w))
            w += 1
    for b in range(m - warm, m):   # drain: each B, then the oldest pending W fills the wait for the next B
        order.append(("B", s, b))
        if w <= b:
            order.append(("W", s, w))
            w += 1
    return order + [("W", s, i) for i in range(w, m)]


def _zb_v(w: int, p: int, m: int) -> list[Op]:
    n = max(m, 2 * p - 1)   # enough micro-batches to fill the V; the extra ones' operations are dropped
    first, second = w, 2 * p - 1 - w
    count = {(kind, s): 0 for kind in "FBW" for s in (first, second)}
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
        add("B", second)
        add("W", second)
    while count[("F", second)] < count[("F", first)] or count[("F", first)] < n:   # steady state
        if count[("F", first)] < n:
            add("F", first)
        add("B", first)
        add("W", first)
        add("F", second)
        add("B", second)
        add("W", second)
    for _ in range(w):   # cool-down: the remaining input gradients first, the weight passes fill the waits
        add("B", first)
        add("B", second)
    for _ in range(p - w):
        add("B", first)
        add("W", first)
    for s in (second, first):
        while count[("W", s)] < count[("B", s)]:
            add("W", s)
    assert all(count[("F", s)] == count[("B", s)] == count[("W", s)] for s in (first, second))
    return [op for op in order if op[2] < m]


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
