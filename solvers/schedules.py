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

These lists are what the executors run and what :mod:`solvers.simulate` times.
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "SPLIT_BACKWARD", "Op", "worker_orders", "stage_worker", "check_schedule", "inflight"]

Op = tuple[str, int, int]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
SPLIT_BACKWARD = ("zb-h1",)   # schedules whose backward is split into B (inputs) and W (weights)


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
    elif stages != workers:
        raise ValueError(f"{schedule} runs one stage per worker; got {stages} stages on {workers} workers "
                         f"(use interleaved-1f1b for several stages per worker)")


def inflight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations ``stage`` holds at its peak (GPipe: all; ZB-H1: ``p``, its weight
    passes trailing by ``stage``; 1F1B and interleaved, counted over all stages: ``p - s``)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "zb-h1":
        return min(micro_batches, stages)
    return min(micro_batches, stages - stage)


def stage_worker(schedule: str, stage: int, workers: int) -> int:
    """The worker that runs ``stage``."""
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
