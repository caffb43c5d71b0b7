"""Checks at every call of a pipeline: the inputs are of the kind it was compiled for, and the model is
the one it was compiled from.

Two silent wrong answers they stop. An input of another rank can broadcast through a stage (a
``Linear`` takes ``(2, 8, 8)`` as well as ``(8, 8)``) and return numbers of the right look for the wrong
question; an input of another dtype fails deep inside a stage. And the stage modules hold the model's
parameter objects: a parameter the user replaces after compile (``model.fc.weight = nn.Parameter(...)``)
or reshapes in place (``p.data = ...``) is not the one the pipeline trains, so training would go on
without a word. Sizes other than the batch's may change (another image size, another sequence length):
the plan still computes the right thing, but was balanced for other shapes, so that is a warning.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from fxpipe.errors import FxpipeError

__all__ = ["ModelGuard", "check_inputs", "input_signature"]


def input_signature(gm: torch.fx.GraphModule, example_inputs: tuple) -> list[dict[str, Any]]:
    """What a plan records of the example inputs: per tensor input, its placeholder's name, dtype and shape."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [{"name": name, "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
            for name, value in zip(names, example_inputs) if isinstance(value, torch.Tensor)]


_warned: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()


def check_inputs(signature: list[dict[str, Any]], bound: dict[str, Any], batch_dim: int | dict[str, int] = 0) -> None:
    """Refuse an input of another dtype or rank than ``signature`` (by input name); warn once per shape
    about other sizes outside ``batch_dim`` (one for all, or by input name)."""
    for expected in signature:
        value = bound.get(expected["name"])
        if not isinstance(value, torch.Tensor):
            continue
        name, shape = expected["name"], tuple(expected["shape"])
        got_dtype = str(value.dtype).removeprefix("torch.")
        if got_dtype != expected["dtype"]:
            raise FxpipeError(
                f"input {name!r} is {got_dtype} but the plan was made for {expected['dtype']} inputs; cast it "
                f"(x.to(torch.{expected['dtype']})) or plan again with inputs of this dtype (fxpipe.compile or "
                "fxpipe.plan with them; fxpipe plan --dtype)")
        if value.dim() != len(shape):
            raise FxpipeError(
                f"input {name!r} has {value.dim()} dimensions {tuple(value.shape)} but the pipeline was compiled "
                f"for {len(shape)} {shape} (a stage could broadcast it into a wrong answer); pass inputs shaped "
                "like the example inputs, or compile again with these")
        dim = batch_dim.get(name, 0) if isinstance(batch_dim, dict) else batch_dim
        others = tuple(s for d, s in enumerate(value.shape) if d != dim)
        planned = tuple(s for d, s in enumerate(shape) if d != dim)
        if others != planned and (name, planned, others) not in _warned:
            _warned.add((name, planned, others))
            warnings.warn(f"input {name!r} has shape {tuple(value.shape)} but the plan was costed for {shape}: the "
                          "pipeline computes the same function, but its stages were balanced for the other shape; "
                          "compile again with inputs of this shape for a balanced plan", stacklevel=4)


class ModelGuard:
    """The parameters and buffers of the compiled model, by name, to be found unchanged at every call."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._tensors = [(kind, name, t, tuple(t.shape)) for kind, items in
                         (("parameter", model.named_parameters(remove_duplicate=False)),
                          ("buffer", model.named_buffers(remove_duplicate=False)))
                         for name, t in items]

    @property
    def model(self) -> nn.Module | None:
        """The compiled model, while it exists."""
        return self._model()

    def check(self) -> None:
        """Raise if a parameter or buffer was replaced or reshaped since compile (a deleted model is fine)."""
        model = self._model()
        if model is None:
            return
        for kind, name, held, shape in self._tensors:
            try:
                now = model.get_parameter(name) if kind == "parameter" else model.get_buffer(name)
            except AttributeError:
                now = None
            if now is not held:
                raise FxpipeError(
                    f"{kind} {name!r} of {type(model).__name__} was replaced after fxpipe.compile; the pipeline "
                    f"still holds the old one and would train it. Compile the model again after changing it "
                    f"(or change it in place: with torch.no_grad(): p.copy_(new))")
            if tuple(held.shape) != shape:
                raise FxpipeError(
                    f"{kind} {name!r} of {type(model).__name__} changed shape from {shape} to "
                    f"{tuple(held.shape)} after fxpipe.compile; compile the model again")
