"""A model factory for ``fxpipe plan examples/my_models.py:build`` (the example in ``fxpipe plan --help``): a file
path and a function name, called without arguments, returning the module (its input: ``--input-shape 128``)."""

from __future__ import annotations

from torch import nn


def build(width: int = 128, depth: int = 8) -> nn.Module:
    """An MLP of ``depth`` blocks over ``width`` features, for the planner to cut between blocks."""
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)),
                         nn.Linear(width, 10))
