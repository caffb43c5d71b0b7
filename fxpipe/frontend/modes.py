"""Every submodule's train/eval flag, put back exactly as the user set it.

``model.train(was)`` restores only the top-level flag, and it writes it into every
submodule: a frozen BatchNorm (``bn.eval()`` inside a model in training mode, as
fine-tuning does) would come back in training mode and overwrite its running
statistics at the next step. :func:`keeping_modes` saves each module's own flag
and restores each one, whatever ran in between.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

__all__ = ["training_flags", "restore_training_flags", "keeping_modes"]


def training_flags(module: nn.Module) -> list[tuple[nn.Module, bool]]:
    """``(submodule, its training flag)`` for ``module`` and every submodule (each once)."""
    return [(m, m.training) for m in module.modules()]


def restore_training_flags(flags: list[tuple[nn.Module, bool]]) -> None:
    """Set each module's own flag back (no recursion: every module gets its own)."""
    for m, flag in flags:
        m.training = flag


@contextmanager
def keeping_modes(module: nn.Module) -> Iterator[None]:
    """Run the block, then give ``module`` and each of its submodules the train/eval flag it had before."""
    flags = training_flags(module)
    try:
        yield
    finally:
        restore_training_flags(flags)
