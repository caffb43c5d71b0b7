"""What the runtime asks of the machine beyond its devices: may an operation run now, and how workers share it.

The schedule interpreter (:mod:`fxpipe.runtime.execute.step`) and the forward of
:class:`~fxpipe.runtime.execute.pipeline.Pipeline` run every operation inside
``turns.turn(device)``, where ``turns = host.turns(devices, workers)`` for one call or step, and
:meth:`Pipeline.report` simulates the step with ``host.sharing(plan, devices)``. On GPUs nothing waits (work
is queued on streams) and devices do not slow each other: :data:`UNSHARED`. CPU workers that share a few
processors plug in :class:`fxpipe.cost.cpu.CpuHost`, which lets them take turns and says how much slower
each runs beside the others. The runtime only knows these two methods.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, Sequence

import torch

__all__ = ["Host", "Turns", "UNSHARED", "Unshared"]


class Turns(Protocol):
    """Admission of one operation at a time per free processor (or of every operation, at once)."""

    def turn(self, device: torch.device) -> AbstractContextManager[None]:
        """Hold a turn on ``device`` while the block runs."""
        ...


class Host(Protocol):
    """The machine the workers run on, as the runtime sees it."""

    def turns(self, devices: Sequence[torch.device], workers: int) -> Turns:
        """Turns for the first ``workers`` of ``devices`` (one device per worker), for one call or step."""
        ...

    def sharing(self, plan: Any, devices: Sequence[torch.device]) -> Any:
        """How the workers share the machine, for :func:`solvers.simulate.simulate`
        (``None``: each device runs on its own)."""
        ...


class _Always:
    def turn(self, device: torch.device) -> AbstractContextManager[None]:
        return nullcontext()


class Unshared:
    """Devices that run independently (GPUs): every operation runs at once, and nothing is shared."""

    def turns(self, devices: Sequence[torch.device], workers: int) -> Turns:
        return _Always()

    def sharing(self, plan: Any, devices: Sequence[torch.device]) -> Any:
        return None


UNSHARED = Unshared()
