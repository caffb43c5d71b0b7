"""What training keeps per parameter besides the parameter, and the dtype a model trains in.

A model trains in the dtype of its floating parameters (:func:`training_dtype`: the one holding the most
bytes). Its optimizer memory is counted as the run keeps it: torch's optimizers keep their moments in the
parameter's dtype, and the gradient is the parameter's. Adam keeps 16 bytes per float32 parameter (4 + 4 + 2 x 4)
and 8 per bfloat16 one (2 + 2 + 2 x 2): a model built in bfloat16 trains without a float32 master copy, its updates
rounded to bfloat16. ``precision="bf16-mixed"`` (:mod:`fxpipe.frontend.precision`) keeps float32 parameters and
computes in bfloat16: 16 bytes, and the 2 of its bfloat16 compute copy (``AnalyticModel.state_factor``).

:func:`optimizer_state_factor` is that memory per parameter byte, less the parameter itself: the
``optimizer_state_factor`` of :class:`solvers.Problem` (a stage holds ``(1 + factor) x`` its parameter bytes).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

__all__ = ["MOMENTS", "OPTIMIZER_STATE", "optimizer_state_factor", "training_dtype"]

MOMENTS = {"none": None, "sgd": 0, "momentum": 1, "adam": 2}
"""The optimizer's moments per parameter; ``"none"`` keeps no gradient either (inference)."""

OPTIMIZER_STATE = {"none": 0.0, "sgd": 1.0, "momentum": 2.0, "adam": 3.0}
"""Bytes kept per parameter byte besides the parameter: gradients, then moments, in the parameter's dtype."""


def training_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype holding most of ``model``'s parameter bytes (float32 for a model without any)."""
    held: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            held[p.dtype] += p.numel() * p.element_size()
    return held.most_common(1)[0][0] if held else torch.float32


def optimizer_state_factor(optimizer: str, dtype: torch.dtype) -> float:
    """Bytes kept per parameter byte besides the parameter (module doc), for parameters of ``dtype``."""
    if optimizer not in MOMENTS:
        raise ValueError(f"optimizer must be one of {', '.join(MOMENTS)}, got {optimizer!r}")
    moments = MOMENTS[optimizer]
    if moments is None:
        return 0.0
    torch.empty((), dtype=dtype)   # a dtype torch knows (TypeError otherwise)
    return float(1 + moments)
