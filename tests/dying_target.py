"""Test helper for a rank that dies mid-step: ``dying_target:make_model`` and ``dying_target:batches`` are
:mod:`launch_target`'s, except that on the first attempt of a ``torchrun`` group (``TORCHELASTIC_RESTART_COUNT``
0, or unset) the process whose ``RANK`` is ``FXPIPE_TEST_KILL_RANK`` SIGKILLs itself in the middle of the step
of batch ``FXPIPE_TEST_KILL_STEP``: at the second forward call of one of its linear layers in that step, after
its first micro-batch crossed ranks. The process is gone; no exception is raised, no status is sent.

A test-only hook, not an fxpipe option: killing a process tests the launcher, it is not a feature a user needs
(``kill -9 PID`` does it to a real job).
"""

from __future__ import annotations

import os
import signal
from typing import Iterator

import torch
from torch import nn

import launch_target

__all__ = ["make_model", "batches", "armed"]

_step = [-1]   # the index of the batch being trained


def armed() -> bool:
    """Whether this process is the one to kill (on the first attempt only)."""
    return (os.environ.get("FXPIPE_TEST_KILL_RANK") == os.environ.get("RANK", "")
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def make_model() -> nn.Module:
    model = launch_target.make_model()
    if not armed():
        return model
    at, seen = int(os.environ["FXPIPE_TEST_KILL_STEP"]), [0]

    def count(module: nn.Module, args: tuple) -> None:
        if _step[0] == at:
            seen[0] += 1
            if seen[0] == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    for sub in model.modules():
        if isinstance(sub, nn.Linear):
            sub.register_forward_pre_hook(count)
    return model


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for index, batch in enumerate(launch_target.batches()):
        _step[0] = index
        yield batch
