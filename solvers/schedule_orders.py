"""The order generators of the pipeline schedules (:mod:`solvers.schedules` holds their records): each worker's
operations ``(kind, stage, micro_batch)`` in the order it runs them, the kind spelled as
torch.distributed.pipelining's actions (``"F"`` forward, ``"B"`` whole backward, a split backward's ``"I"``
input-gradient and ``"W"`` weight-gradient passes). A worker is a device.

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
- ``dualpipev`` (DeepSeek-V3's DualPipe folded into a V; torch's ``ScheduleDualPipeV``): ZB-V's placement; once
  the V is full each forward is paired with a whole backward of the worker's other stage (torch's
  ``OVERLAP_F_B``, here one after the other), and the ends split the backward. Needs ``m >= 2p``.

Each takes the shape already checked (:meth:`solvers.schedules.Schedule.check`). Torch-free.
"""

from __future__ import annotations

__all__ = ["Op", "gpipe_orders", "one_f_one_b_order", "zb_h1_order", "zb_v_order", "dualpipev_order",
           "interleaved_order"]

Op = tuple[str, int, int]


def gpipe_orders(stages: int, p: int, m: int) -> list[list[Op]]:
    """Backward from the last micro-batch, as torchgpipe: it needs no recomputation of the last forward."""
    return [[("F", s, i) for i in range(m)] + [("B", s, i) for i in reversed(range(m))] for s in range(p)]


def one_f_one_b_order(s: int, p: int, m: int) -> list[Op]:
    warm = min(p - s - 1, m)
    order: list[Op] = [("F", s, i) for i in range(warm)]
    for f in range(warm, m):
        order += [("F", s, f), ("B", s, f - warm)]
    return order + [("B", s, b) for b in range(m - warm, m)]


def zb_h1_order(s: int, p: int, m: int) -> list[Op]:
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


def zb_v_order(w: int, p: int, m: int) -> list[Op]:
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


def dualpipev_order(w: int, p: int, m: int) -> list[Op]:
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


def interleaved_order(r: int, p: int, v: int, m: int) -> list[Op]:
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
