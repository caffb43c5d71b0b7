"""The host of CPU workers: they take turns on the processors and slow each other down.

Implements the runtime's :class:`fxpipe.runtime.execute.host.Host` interface (structurally: the runtime comes after
the cost model in the data flow, so this module does not import it). GPU devices among the workers never
wait and do not count as sharing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from fxpipe.cost.cpu.sharing import CpuSharing, cores_per_worker, cpu_sharing, processors
from fxpipe.cost.cpu.turns import CoreTurns

__all__ = ["CpuHost"]


class CpuHost:
    """CPU workers of one process on this machine's processors (see :mod:`fxpipe.cost.cpu`)."""

    def turns(self, devices: Sequence[torch.device], workers: int) -> CoreTurns:
        return CoreTurns.for_devices(devices, workers)

    def sharing(self, plan: Any, devices: Sequence[torch.device]) -> CpuSharing | None:
        """How the plan's CPU workers share the processors: the cores of :func:`cpu_sharing`, and each
        stage's speed beside the others as measured at compile time in steps of the plan's schedule
        (``plan.profile["contention"]``, :mod:`fxpipe.refine.contention`), else the synthetic parallel
        efficiency; 1 for a calibrated plan, whose stage times were measured in the pipeline. ``None``
        unless every device is a CPU."""
        if any(d.type != "cpu" for d in devices):
            return None
        if "calibration" in plan.profile:   # stage times measured in the pipeline, contention included
            return CpuSharing(cores_per_worker(), 1.0, slots=processors())
        measured = plan.profile.get("contention")
        if not measured or measured.get("stage_nodes") != [len(st.nodes) for st in plan.stages]:
            return cpu_sharing()
        return CpuSharing(cores_per_worker(), measured["parallel_efficiency"],
                          tuple((f, b) for f, b in measured["stage_efficiency"]), slots=processors())
