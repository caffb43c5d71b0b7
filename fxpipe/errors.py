"""The exceptions fxpipe raises; each message names what is wrong and how to fix it."""

from __future__ import annotations

__all__ = ["FxpipeError", "TraceError", "PlanMismatchError", "InfeasiblePlanError", "StageError", "PlanFormatError",
           "LossReductionError"]


class FxpipeError(Exception):
    """Base class of fxpipe's errors."""


class TraceError(FxpipeError):
    """torch.fx could not trace the model; names the module and the operation."""

    def __init__(self, message: str, module: str | None = None, operation: str | None = None) -> None:
        super().__init__(message)
        self.module = module
        self.operation = operation


class PlanMismatchError(FxpipeError):
    """A saved plan was made for another model (its graph fingerprint differs)."""


class PlanFormatError(FxpipeError, ValueError):
    """A plan file is not a valid plan document (``fxpipe-plan/4``, or an earlier format it migrates)."""


class InfeasiblePlanError(FxpipeError):
    """No partition fits the devices' memory; ``min_peak_bytes`` is what would fit."""

    def __init__(self, message: str, min_peak_bytes: float | None = None) -> None:
        super().__init__(message)
        self.min_peak_bytes = min_peak_bytes


class StageError(FxpipeError):
    """An exception raised inside a pipeline stage; the original is ``__cause__``."""

    def __init__(self, message: str, stage: int, micro_batch: int, node: str | None) -> None:
        super().__init__(message)
        self.stage = stage
        self.micro_batch = micro_batch
        self.node = node


class LossReductionError(StageError):
    """A training step refused ``loss_fn`` under ``reduction="auto"``: weighting its micro-batches by their share
    of the samples would not give the full batch's gradients (a mean over tokens or a mask, a sum). The message
    names the fix (``reduction="token"`` with ``(loss_sum, count)``, ``"sum"``, or ``"mean"`` to opt out); the
    step's gradients are left as they were before it."""
