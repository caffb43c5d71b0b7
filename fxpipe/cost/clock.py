"""A clock that marks points in a run of queued device work and reads the time between marks afterwards.

Timing a graph as it runs in a step (:mod:`fxpipe.cost.graph_timing`) must not synchronise after every
node: on a GPU the kernels of a step queue back to back, and a synchronisation per node would count each
node's launch and wait latency again (the per-node profile predicted 2.5-5x the real stage time on an H200).
So the timing code drops *marks* as it goes, waits once at the end, and then reads the seconds between
marks. One protocol, two clocks:

* :class:`CudaEventClock`: a mark is a ``torch.cuda.Event(enable_timing=True)`` recorded on the current
  stream, so it is timestamped when the GPU reaches it; ``wait`` synchronises on the last mark.
* :class:`PerfCounterClock`: a mark is a ``time.perf_counter()`` reading; CPU operators run when called,
  so there is nothing to wait for.

The same run/mark/apportion code thus runs, and is tested, on CPU. It is hand-written because torch has no
device-neutral timing event that also works on CPU: ``torch.Event(device="cpu")`` raises "cpu backend
doesn't support events", and ``torch.cpu.Event`` is a stub whose ``record`` does nothing and which has no
``elapsed_time`` (torch 2.15).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["Clock", "CudaEventClock", "PerfCounterClock", "clock_for"]


class Clock(Protocol):
    """Marks points in queued work (``mark``), waits for all of it (``wait``), reads the seconds between two
    marks (``seconds``; only after ``wait``)."""

    def mark(self) -> Any: ...

    def wait(self) -> None: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class PerfCounterClock:
    """Marks are ``time.perf_counter()`` readings: for devices whose operators have finished when they return."""

    def mark(self) -> float:
        """The time now."""
        return time.perf_counter()

    def wait(self) -> None:
        """Nothing is queued."""

    def seconds(self, start: float, end: float) -> float:
        """Seconds from ``start`` to ``end``."""
        return end - start


class CudaEventClock:
    """Marks are CUDA timing events recorded on ``device``'s current stream. No CUDA call is made before the
    first mark, so the clock can be chosen where there is no GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last: Any = None

    def mark(self) -> Any:
        """An event recorded on the current stream, behind the work queued so far."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._last = event
        return event

    def wait(self) -> None:
        """Block until the GPU has reached the last mark (and so every earlier one)."""
        if self._last is not None:
            self._last.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds of GPU time from ``start`` to ``end`` (events report milliseconds)."""
        return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device) -> Clock:
    """The clock that times queued work on ``device``: CUDA events on a CUDA device, ``perf_counter`` otherwise."""
    return CudaEventClock(device) if device.type == "cuda" else PerfCounterClock()
