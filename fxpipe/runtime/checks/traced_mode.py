"""A graph traced in one train/eval mode, run in another: refused, or warned about once.

A model whose Python code reads ``self.training`` (or, under torch.export, any dropout) is traced for
the mode it was in at compile time; the graph cannot follow a switch. :class:`TracedMode` refuses to run
the pipeline in the other mode (``pipe.eval()``), which would compute another function, and warns once
per switch of the user's own model (``model.eval()``), which the graph cannot see.
"""

from __future__ import annotations

import warnings
from typing import Callable

from torch import nn

from fxpipe.errors import FxpipeError

__all__ = ["TracedMode"]


class TracedMode:
    """The mode a graph was traced in, and whether that graph depends on it."""

    def __init__(self, training: bool, dependent: bool | Callable[[], bool]) -> None:
        self.training = training
        # or how to find it out (fxpipe.frontend.capture.Captured.depends_on_mode), asked the first time a mode
        # differs from the traced one
        self._dependent = dependent
        self._warned: bool | None = None   # the model's mode last warned about

    @property
    def dependent(self) -> bool:
        """Whether the graph depends on the mode (found out now, where it was not yet)."""
        if callable(self._dependent):
            self._dependent = bool(self._dependent())
        return self._dependent

    def check(self, running_training: bool, model: nn.Module | None) -> None:
        """Refuse a pipeline switched to the other mode; warn once when the user's ``model`` was."""
        if running_training == self.training and (model is None or model.training == self.training):
            self._warned = None
            return
        if not self.dependent:
            return
        mode = "train" if self.training else "eval"
        if running_training != self.training:
            raise FxpipeError(
                f"this model's traced graph depends on train/eval mode (Python code reads self.training) "
                f"and it was compiled in {mode} mode; compile it again in the mode you want to run "
                f"(model.{'train' if running_training else 'eval'}() before fxpipe.compile)"
            )
        # The model's own mode cannot reach a graph that fixed it (torch.export bakes dropout's flag in):
        # say so once per switch rather than compute the other mode's model in silence.
        if model is not None and model.training != self.training and self._warned != model.training:
            now = "train" if model.training else "eval"
            warnings.warn(f"{type(model).__name__} is in {now} mode, but this pipeline runs its graph traced in {mode} "
                          f"mode, which depends on the mode (dropout, or code that reads self.training, fixed when "
                          f"traced): it computes the {mode}-mode model. To run the {now}-mode model, compile it in "
                          f"that mode (model.{now}() before fxpipe.compile)", UserWarning, stacklevel=4)
        self._warned = None if model is None or model.training == self.training else model.training
