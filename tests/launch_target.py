"""Test helper for ``python -m fxpipe.launch``: a model factory and its batches, importable as
``launch_target:make_model`` and ``launch_target:batches`` (``tests/`` on ``PYTHONPATH``)."""

from __future__ import annotations

import torch
from torch import nn

from models import SkipTied

__all__ = ["make_model", "other_init", "batches", "VOCAB"]

VOCAB = 50


def make_model() -> nn.Module:
    """The model whose weights the tests save (seed 0)."""
    torch.manual_seed(0)
    return SkipTied(vocab=VOCAB, width=32, depth=6)


def other_init() -> nn.Module:
    """The same model from another seed: only loaded weights can make it equal :func:`make_model`'s."""
    torch.manual_seed(7)
    return SkipTied(vocab=VOCAB, width=32, depth=6)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (7, 4), generator=g), torch.randint(0, VOCAB, (7, 4), generator=g))
            for _ in range(6)]
