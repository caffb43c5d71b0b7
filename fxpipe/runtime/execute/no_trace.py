"""Run measurements on a model's own parameters and leave no trace: gradients, buffers and the RNG restored.

Calibration steps and stage timing train for real (forward, backward into
``.grad``, BatchNorm statistics, dropout draws) on the parameters the user will
train. :func:`leaving_no_trace` first moves the caller's ``.grad`` tensors aside,
so backward accumulates into fresh ones (accumulating into the caller's would
change them in place), and afterwards puts them back with the buffers and the
CPU generator's state as they were.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

__all__ = ["leaving_no_trace"]


@contextmanager
def leaving_no_trace(module: nn.Module) -> Iterator[None]:
    grads = {p: p.grad for p in module.parameters()}
    for p in grads:
        p.grad = None
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        for p, g in grads.items():
            p.grad = g
        torch.random.set_rng_state(rng)
