"""How CPU workers share this machine: processors per worker and the slowdown of running together.

CPU "devices" are threads of one process on the same cores: four workers on
two cores take turns, and even two workers on two cores slow each other
through shared caches and memory bandwidth. :func:`cpu_sharing` measures it
once per process: ``cores`` is the processors this process may use divided by
the intra-op threads of one worker (the unit a profile was timed with), and
``parallel_efficiency`` is the speed of each of two single-threaded workers
running at once, relative to one alone, on a mix of about four parts matrix
product to one part copy beyond the caches (the proportions of a typical
convolutional or transformer stage's time): the fallback for a plan without
its own measurement (:mod:`fxpipe.refine.contention` measures each stage's speed in
steps of the plan, ``stage_efficiency``).
:func:`solvers.simulate.simulate` takes both (``cores``, ``parallel_efficiency``)
and lets the operations that run at once share the processors.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

__all__ = ["CpuSharing", "cpu_sharing", "cores_per_worker", "processors"]

_cached: dict[int, "CpuSharing"] = {}


@dataclass(frozen=True)
class CpuSharing:
    cores: float                 # processors per worker (in units of one worker's intra-op threads)
    parallel_efficiency: float   # each thread's speed when two run at once, relative to alone
    stage_efficiency: tuple[tuple[float, float], ...] | None = None   # per stage: forward, backward
    slots: int | None = None     # operations that run at once (fxpipe.cost.cpu.turns: one per processor)


def _mix(rounds: int) -> float:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    big = torch.empty(2**20)
    out = torch.empty_like(big)
    start = time.perf_counter()
    for _ in range(rounds):
        torch.mm(a, b)
        out.copy_(big)
    return time.perf_counter() - start


def processors() -> int:
    """The processors this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def cores_per_worker() -> float:
    """The processors this process may use, in units of one worker's intra-op threads."""
    return processors() / torch.get_num_threads()


def cpu_sharing(rounds: int = 40) -> CpuSharing:
    """This process's CPU sharing (measured once per intra-op thread count, about half a second)."""
    threads = torch.get_num_threads()
    if threads in _cached:
        return _cached[threads]
    cores = cores_per_worker()
    together: list[float] = [0.0, 0.0]

    def run(index: int) -> None:
        together[index] = _mix(rounds)
    torch.set_num_threads(1)   # the efficiency of workers that each fit on a processor
    try:
        _mix(rounds // 4)      # warm up
        ratios = []
        for _ in range(3):     # the machine may be shared: the median of three measurements
            alone = _mix(rounds)
            workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            ratios.append(alone / max(together))
    finally:
        torch.set_num_threads(threads)
    efficiency = sorted(ratios)[1] if processors() >= 2 else 1.0
    _cached[threads] = CpuSharing(cores, min(1.0, efficiency), slots=processors())
    return _cached[threads]
