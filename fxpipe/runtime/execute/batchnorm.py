"""Deferred BatchNorm: running statistics updated once per mini-batch, from all its micro-batches.

In training mode a BatchNorm normalises each micro-batch with that micro-batch's
own statistics (as any micro-batched run must), but a plain ``nn.BatchNorm``
would also move its running mean and variance once per micro-batch, so ``m``
micro-batches decay them ``m`` times per step with noisier estimates.
:class:`DeferredBatchNorm` (torchgpipe's idea) instead accumulates the sum and
sum of squares of every micro-batch and, when the executor calls
:func:`commit_statistics` after the mini-batch, updates the running statistics
once with the mini-batch's mean and unbiased variance: exactly the update of
one full-batch ``nn.BatchNorm`` step. Only forwards run by the executor count
(inside :func:`tracking`); the recomputation of a checkpointed forward during
backward does not, so checkpointing never counts a micro-batch twice.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm", "commit_statistics", "tracking"]

_state = threading.local()


@contextmanager
def tracking() -> Iterator[None]:
    """Count the micro-batches that pass through deferred BatchNorms in this thread (a forward, not a recompute)."""
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm (1d, 2d or 3d) whose running statistics move once per mini-batch."""

    def __init__(self, source: nn.modules.batchnorm._BatchNorm) -> None:
        nn.Module.__init__(self)
        self.num_features, self.eps, self.momentum = source.num_features, source.eps, source.momentum
        self.affine, self.track_running_stats = source.affine, source.track_running_stats
        # the same tensors: updates reach the user's model, as for every other parameter
        self.weight, self.bias = source.weight, source.bias
        self.register_buffer("running_mean", source.running_mean)
        self.register_buffer("running_var", source.running_var)
        self.register_buffer("num_batches_tracked", source.num_batches_tracked)
        self._source_type = type(source)
        self.training = source.training   # a frozen BatchNorm (eval inside a training model) stays frozen
        self._lock = threading.Lock()
        self._sum: torch.Tensor | None = None
        self._sum_squares: torch.Tensor | None = None
        self._count = 0

    def _check_input_dim(self, input: torch.Tensor) -> None:
        self._source_type._check_input_dim(self, input)   # type: ignore[arg-type]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        if getattr(_state, "on", False):
            dims = [0, *range(2, input.dim())]
            with torch.no_grad():
                x = input.detach().to(torch.float64 if input.dtype == torch.float64 else torch.float32)
                total, squares = x.sum(dims), (x * x).sum(dims)
            with self._lock:
                self._sum = total if self._sum is None else self._sum + total
                self._sum_squares = squares if self._sum_squares is None else self._sum_squares + squares
                self._count += input.numel() // input.shape[1]
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self, discard: bool = False) -> None:
        """Fold the micro-batches seen since the last commit into the running statistics (or drop them)."""
        with self._lock:
            total, squares, count = self._sum, self._sum_squares, self._count
            self._sum = self._sum_squares = None
            self._count = 0
        if discard or total is None or self.running_mean is None or self.running_var is None:
            return
        mean = total / count
        var = squares / count - mean * mean
        unbiased = var * (count / (count - 1)) if count > 1 else var
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, deferred"


def convert_deferred_batch_norm(module: nn.Module) -> int:
    """Replace every BatchNorm submodule of ``module`` (in place) by a :class:`DeferredBatchNorm`; return how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(child, DeferredBatchNorm):
            if isinstance(child, nn.SyncBatchNorm):
                raise ValueError(f"{name} is a SyncBatchNorm; deferred_batch_norm supports BatchNorm1d/2d/3d")
            setattr(module, name, DeferredBatchNorm(child))
            count += 1
        else:
            count += convert_deferred_batch_norm(child)
    return count


def commit_statistics(modules: Iterator[nn.Module], discard: bool = False) -> None:
    """Commit every :class:`DeferredBatchNorm` among ``modules`` after all forwards of a mini-batch;
    ``discard`` drops what a failed mini-batch accumulated, so the next one starts clean."""
    for m in modules:
        if isinstance(m, DeferredBatchNorm):
            m.commit(discard)
