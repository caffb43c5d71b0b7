"""What the memory model and the pictures read of a plan: :class:`PlanView` and :class:`StageView`.

They are protocols, not the :class:`fxpipe.planning.plan.Plan` class itself, so that ``plan.py`` can call
:mod:`fxpipe.planning.memory_model` and :mod:`fxpipe.planning.pictures` (``plan.memory_table()``,
``plan.plot()``) while those modules import nothing back from it: imports point one way.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

__all__ = ["StageView", "PlanView"]


class StageView(Protocol):
    """One stage's device, nodes, predicted times and memory sizes (:class:`fxpipe.planning.plan.PlanStage`)."""

    index: int
    device: str
    nodes: list[str]
    param_bytes: float
    act_bytes: float
    fwd_s: float
    bwd_s: float
    comm_s: float
    peak_bytes: float
    input_bytes: float
    output_bytes: float
    overlap_bytes: float
    workspace_bytes: float
    loss_bytes: float
    checkpoint: str
    memory_bytes: float
    measured_bytes: dict[str, float] | None
    blocks: list[dict[str, float]]


class PlanView(Protocol):
    """A plan's stages, schedule, micro-batching and graph (:class:`fxpipe.planning.plan.Plan`)."""

    model: str
    devices: list[str]
    chunks: int
    schedule: str
    checkpoint: str
    problem: dict[str, Any] | None

    @property
    def stages(self) -> Sequence[StageView]: ...

    @property
    def workers(self) -> int: ...

    def stage_of(self) -> dict[str, int]: ...
