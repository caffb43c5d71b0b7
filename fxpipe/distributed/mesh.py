"""``MeshPipelineRank``: the former name of :class:`fxpipe.distributed.PipelineRank` on a mesh, kept one release.

``MeshPipelineRank(plan, model_fn, loss_fn, mesh=...)`` is ``PipelineRank(plan, model_fn, loss_fn, mesh=...)``,
with a ``DeprecationWarning`` saying so: one rank class runs every layout (:mod:`fxpipe.distributed.rank`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fxpipe.distributed.rank import PipelineRank
from fxpipe.planning.plan import Plan

__all__ = ["MeshPipelineRank"]


class MeshPipelineRank(PipelineRank):
    """Deprecated: use ``PipelineRank(plan, model_fn, loss_fn, mesh=mesh, ...)``, which this is."""

    def __init__(self, plan: Plan | str | Path, model_fn: Callable[[], nn.Module],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, *, mesh: Any, **kwargs: Any) -> None:
        warnings.warn("MeshPipelineRank is PipelineRank(plan, model_fn, loss_fn, mesh=...) now, and goes in the next "
                      "release: construct PipelineRank with mesh=", DeprecationWarning, stacklevel=2)
        super().__init__(plan, model_fn, loss_fn, mesh=mesh, **kwargs)
