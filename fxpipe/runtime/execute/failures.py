"""What the caller is told when a stage or the loss fails: a :class:`fxpipe.StageError` naming where.

The stage, the micro-batch, the pass and, when the exception came from a stage's generated code, the fx
node; a failure inside the user's ``loss_fn`` is named as the loss of that micro-batch, not as a
backward that autograd cannot place. The original exception is always chained (``__cause__``).
"""

from __future__ import annotations

import linecache
import re
import traceback
from typing import Any

import torch

from fxpipe.errors import LossReductionError, StageError

__all__ = ["failing_node", "forward_error", "step_error"]

_ASSIGN = re.compile(r"^\s*(\w+)\s*=")


def failing_node(exc: BaseException) -> str | None:
    """Name of the fx node whose generated line raised ``exc``, if it came from stage code."""
    name = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith("<eval_with_key>"):
            m = _ASSIGN.match(linecache.getline(frame.filename, frame.lineno))
            if m:
                name = m.group(1)
    return name


def forward_error(stage: int, micro_batch: int, device: torch.device, exc: BaseException) -> StageError:
    """A stage that failed in ``pipe(x)``."""
    node = failing_node(exc)
    return StageError(f"stage {stage} (device {device}) failed on micro-batch {micro_batch} at node {node!r}: "
                      f"{type(exc).__name__}: {exc}", stage=stage, micro_batch=micro_batch, node=node)


def step_error(failure: Any, devices: list[torch.device]) -> StageError:
    """A :class:`fxpipe.runtime.execute.step.StepFailure` of ``pipe.step``, as the caller's error."""
    k, i, exc = failure.stage, failure.micro_batch, failure.exc
    if failure.kind == "loss" and isinstance(exc, LossReductionError):   # refused, not failed: its own words
        return LossReductionError(str(exc), stage=k, micro_batch=i, node=None)
    if failure.kind == "loss":
        return StageError(
            f"loss_fn failed on micro-batch {i} (computed on the last stage, {k}, device {devices[k]}, from that "
            f"micro-batch's output and target): {type(exc).__name__}: {exc}; the stages ran; fix loss_fn or the "
            "target (the original exception is chained)", stage=k, micro_batch=i, node=None)
    if k < 0:   # the whole step, not one stage's operation: another rank failed or is gone, a wait timed out
        return StageError(f"{type(exc).__name__}: {exc}", stage=k, micro_batch=i, node=None)
    node = failing_node(exc)
    where = f"at node {node!r}" if node is not None else (
        "(autograd does not say which node; torch.autograd.set_detect_anomaly(True) shows the "
        "forward operation)" if failure.kind == "backward" else "")
    return StageError(f"stage {k} (device {devices[k]}) failed in {failure.kind} of micro-batch {i} {where}: "
                      f"{type(exc).__name__}: {exc}", stage=k, micro_batch=i, node=node)
