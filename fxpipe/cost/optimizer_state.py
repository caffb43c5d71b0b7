"""What training keeps per parameter besides the parameter, and the dtype a model trains in.

A model trains in the dtype of its floating parameters (:func:`training_dtype`: the one holding the most
bytes). Its optimizer memory is counted as mixed-precision training keeps it (the ZeRO paper's accounting,
which Megatron-LM's distributed optimizer also uses): the gradient in the parameter's dtype, a float32 master
copy of every parameter narrower than float32, and the optimizer's moments in float32 (or in the parameter's
dtype when that is wider). Adam then keeps 16 bytes per parameter whether the model is float32 (4 + 4 + 2 x 4)
or bfloat16 (2 + 2 + 4 + 2 x 4); a model trained in float32 under ``torch.autocast`` keeps the same.

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
"""Bytes kept per parameter byte besides the parameter for a float32 model: gradients, then moments."""


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
    size = torch.empty((), dtype=dtype).element_size()
    master = 4 if size < 4 else 0                      # the float32 copy a narrower parameter is updated in
    return (size + master + moments * max(size, 4)) / size
