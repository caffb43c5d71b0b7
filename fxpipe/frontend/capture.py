"""The front end's one call: a model becomes a traced graph, its fingerprint and whether its mode matters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch.fx as fx
from torch import nn

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
    either way (:func:`fxpipe.frontend.modes.keeping_modes`): a frozen BatchNorm stays in eval mode."""
    gm = trace(model, leaf_modules, concrete_args)
    fingerprint = graph_fingerprint(gm)
    with keeping_modes(model):
        model.train(not model.training)
        other = trace(model, leaf_modules, concrete_args)
    return Captured(gm, fingerprint, graph_fingerprint(other) != fingerprint)
