"""CPU workers beyond the processors take turns, one whole operation at a time, first come first served.

Four CPU workers on two cores left to the OS scheduler are time-sliced: every
operation is stretched by whichever others happen to run beside it, its
duration changes from step to step (the same pipeline measured twice in a row
differed by 9 % per stage at the median, 24 % at p90, on this project's 2-core
machine), and the threads evict each other's caches. :class:`CoreTurns` instead
lets at most one operation of a CPU stage run per processor: a worker whose
operation is ready waits for a turn, runs the operation to its end, and hands
the turn to the worker that has waited longest. Each operation then runs at
its own speed (times the contention of the few running beside it), which
:func:`solvers.simulate.simulate` models with the same rule (``slots``), so the
prediction and the measurement describe the same thing. With no more CPU
workers than processors it does nothing: workers of several intra-op threads
each (two workers of two threads on two cores) still share the processors
through the OS, which for their many small operations is faster than taking
turns (a ResNet-50 1F1B step: 1.65 s shared, 2.0-2.5 s in turns). GPU stages
never wait: their work is queued on streams.

Written by hand because ``threading.Semaphore`` does not wake waiters in the
order they came (a releasing thread may take the turn straight back).
"""

from __future__ import annotations

import collections
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from fxpipe.cost.cpu.sharing import processors

__all__ = ["CoreTurns"]


class CoreTurns:
    """Turns on the processors (``slots``, default: all this process may use) for the operations of ``workers``
    CPU workers (see the module doc)."""

    def __init__(self, workers: int, slots: int | None = None) -> None:
        self.slots = max(1, processors() if slots is None else slots)
        self.active = workers > self.slots
        self._lock = threading.Lock()
        self._queue: collections.deque[threading.Event] = collections.deque()
        self._free = self.slots

    @classmethod
    def for_devices(cls, devices: Sequence[torch.device], workers: int) -> "CoreTurns":
        """Turns for the CPU workers among the first ``workers`` of ``devices`` (one device per worker)."""
        return cls(sum(1 for d in list(devices)[:workers] if d.type == "cpu"))

    @contextmanager
    def turn(self, device: torch.device) -> Iterator[None]:
        """Hold a processor while the block runs (CPU devices, when the workers outnumber the processors)."""
        if not self.active or device.type != "cpu":
            yield
            return
        self._acquire()
        try:
            yield
        finally:
            self._release()

    def _acquire(self) -> None:
        with self._lock:
            if self._free > 0 and not self._queue:
                self._free -= 1
                return
            mine = threading.Event()
            self._queue.append(mine)
        mine.wait()          # the releasing worker handed its core over

    def _release(self) -> None:
        with self._lock:
            if self._queue:
                self._queue.popleft().set()
            else:
                self._free += 1
