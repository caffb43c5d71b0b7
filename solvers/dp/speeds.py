"""A lower bound on the rest of a plan when its devices differ in speed: slow devices must take work too.

The label search's other bounds run all the rest's compute at the fastest speed. That is exact for alike
devices, and far too low when the rest must use slow ones: with 5 devices at full speed and 3 at half,
an 8-stage plan puts about a quarter of the work on the slow three, which takes twice as long there.

Let the rest have work ``W`` (seconds at speed 1) on stages whose devices have speeds ``v_1 >= ... >= v_s``
and let ``M`` be the plan's slowest stage. Every rest stage takes at most ``M``, so stage ``i`` holds at most
``v_i M`` of work, and the rest's compute adds at least ``R(M) = min sum w_i / v_i`` over ``sum w_i = W``,
``0 <= w_i <= v_i M`` to the sum of stage times: fill the fastest devices first. The plan ends at no less
than ``R(M) + (m - 1) M`` past what the label has (plus transfers, bounded apart), minimised over the ``M``
the label still allows. ``R`` is the value of a linear programme in the bound ``M`` of its constraints, so it
is convex, and so is ``g(mu) = R(mu W) / W + (m - 1) mu``; its minimum over ``mu >= mu_0`` lies at
``max(mu_0, mu*)`` with ``mu*`` one of the breakpoints ``1 / (v_1 + ... + v_r)``, found once per speed list.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # only for the annotation: Space imports nothing of this module
    from solvers.dp.space import Space

__all__ = ["SpeedRest", "SpeedRests"]


class SpeedRest:
    """The rest's least sum and maximum for one list of rest speeds and ``m`` micro-batches."""

    def __init__(self, speeds: list[float], micro_batches: int) -> None:
        self.speeds = sorted(speeds, reverse=True)
        self.weight = micro_batches - 1
        capacity = sum(self.speeds)
        self.lowest_mu = 1.0 / capacity if capacity > 0 else math.inf   # below it the work does not fit
        running, breaks = 0.0, []
        for v in self.speeds:
            running += v
            breaks.append(1.0 / running)
        self.best_mu = min(breaks, key=self.g) if breaks else math.inf

    def g(self, mu: float) -> float:
        """``R(mu) + (m - 1) mu`` for a unit of work, each stage at most ``mu`` long (``inf``: it does not fit)."""
        left, rest = 1.0, 0.0
        for v in self.speeds:
            take = v * mu
            if take >= left:
                return rest + left / v + self.weight * mu
            rest += mu
            left -= take
        return rest + self.weight * mu if left <= 1e-12 else math.inf   # rounding at the lowest mu

    def bound(self, work: float, slowest_at_least: float) -> float:
        """Least ``sum of the rest's compute + (m - 1) max stage`` for ``work`` on these speeds, when the plan's
        slowest stage takes at least ``slowest_at_least``."""
        if work <= 0.0 or not self.speeds:
            return self.weight * slowest_at_least
        mu = max(slowest_at_least / work, self.best_mu, self.lowest_mu)
        return work * self.g(mu)


class SpeedRests:
    """The :class:`SpeedRest` of each list of rest speeds one search meets, made once: what a label search asks
    for the rest after stage ``k`` of ``p`` once ``used`` is taken (None where all devices are alike)."""

    def __init__(self, space: "Space", micro_batches: int) -> None:
        self.space, self.micro_batches = space, micro_batches
        self.mixed = space.mixed_speeds
        self.made: dict[tuple[float, ...], SpeedRest] = {}

    def of(self, used: tuple | int, k: int, p: int) -> SpeedRest | None:
        if not self.mixed or k == p - 1:
            return None
        speeds = self.space.rest_speeds(used, k, p)
        rest = self.made.get(speeds)
        if rest is None:
            rest = self.made[speeds] = SpeedRest(list(speeds), self.micro_batches)
        return rest
