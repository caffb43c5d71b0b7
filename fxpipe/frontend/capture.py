"""The front end's one call: a model becomes a traced graph, its fingerprint and whether its mode matters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch.fx as fx
from torch import nn

from fxpipe.errors import TraceError
from fxpipe.frontend.fingerprint import graph_fingerprint
from fxpipe.frontend.modes import keeping_modes
from fxpipe.frontend.trace import trace

__all__ = ["Captured", "capture"]


@dataclass
class Captured:
    """A model as the rest of the flow sees it."""

    graph: fx.GraphModule
    fingerprint: str          # names the graph: a plan made for another one is refused
    mode_dependent: bool      # tracing in the other train/eval mode gives another graph


def capture(model: nn.Module, leaf_modules: Iterable[Any] = (), concrete_args: Any = None) -> Captured:
    """Trace ``model`` (see :func:`fxpipe.frontend.trace.trace`) and find whether its graph depends on
    ``model.training``, by tracing it once more in the other mode. Every submodule's own flag is restored
    either way (:func:`fxpipe.frontend.modes.keeping_modes`): a frozen BatchNorm stays in eval mode.

    Only the mode the user compiles in must trace: code that runs only in the other mode (a training-only
    branch fx cannot follow) makes the graph mode-dependent, so the pipeline refuses to run in that mode
    (with "compile again in the mode you want") rather than failing this compile."""
    gm = trace(model, leaf_modules, concrete_args)
    fingerprint = graph_fingerprint(gm)
    with keeping_modes(model):
        model.train(not model.training)
        try:
            other = graph_fingerprint(trace(model, leaf_modules, concrete_args))
        except TraceError:
            other = None   # the other mode does not trace: the graph holds for this mode only
    return Captured(gm, fingerprint, other != fingerprint)
