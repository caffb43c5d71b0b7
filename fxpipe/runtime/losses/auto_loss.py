"""``reduction="auto"``, the default: each micro-batch's loss weighted exactly, or the step refused.

A step's gradients are those of the full batch's loss only if the micro-batches' losses are combined as
the full batch would combine them (:mod:`fxpipe.runtime.losses.losses`). :class:`AutoLoss` decides per micro-batch:

- ``loss_fn`` returned ``(loss_sum, count)``: the ``"token"`` reduction (the step divides by the whole
  batch's count).
- ``loss_fn`` returned an ``F.cross_entropy``/``F.nll_loss`` mean as it is (:mod:`fxpipe.runtime.losses.mean_calls`:
  padded labels with ``ignore_index``, class weights, label smoothing, shifted logits): the same, with that
  call's sum and count, so a token-level loss is exact with no change to ``loss_fn``.
- anything else: weighted ``n_i / N`` as ``"mean"`` (bit for bit), after :class:`SampleMeanCheck` has
  shown that ``loss_fn`` averages over samples of equal weight; where it does not (a mean over tokens or a mask
  written by hand, a summed loss, a loss that mixes samples) the step raises
  :class:`fxpipe.errors.LossReductionError`, naming the fix, and its gradients are put back as they were.

Every micro-batch of a step must take the same one of the first two ways or the third. ``loss_fn`` runs on
detached copies of the outputs (fresh leaves); their gradients then go into the stages' graphs with one
``torch.autograd.backward``, as one backward through the loss would. A token sum is backpropagated scaled
(and its count with it: their ratio, which the step divides by at its end, is unchanged) by one factor per
step, ``1 / (N c_1 / n_1)``, the whole batch's count estimated from the first micro-batch's (``n_1`` samples,
``c_1`` counted), so the gradients have the full batch mean's magnitude on their way and, where every sample
counts alike, its rounding too; where the factor must be the same on data-parallel replicas, ``1 / N``.

What it costs (``benchmarks/auto_loss.py``): the recognition a ``TorchFunctionMode`` around ``loss_fn``
(microseconds) and the token path's bookkeeping, about what ``"token"`` by hand costs; the check one more
``loss_fn`` forward and backward per micro-batch, on ``n + 1`` samples, and two passes over its gradients.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Hashable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import LossReductionError
from fxpipe.runtime.losses.losses import token_pair
from fxpipe.runtime.losses.mean_calls import MeanCalls
from fxpipe.runtime.losses.sample_mean_check import SampleMeanCheck

__all__ = ["AutoLoss"]

_KINDS = {"token": "a (loss_sum, count) pair or an F.cross_entropy/F.nll_loss mean (weighted by its count)",
          "sample": "a loss it checks as a mean over samples (weighted by the samples)"}


def _detached(value: Any) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``value`` with a fresh leaf for every tensor that requires grad (one per tensor), and (tensor, leaf) pairs."""
    leaves, spec = tree_flatten(value)
    fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            if id(t) not in fresh:
                fresh[id(t)] = (t, t.detach().requires_grad_(True))
            out.append(fresh[id(t)][1])
        else:
            out.append(t)
    return tree_unflatten(out, spec), list(fresh.values())


class AutoLoss:
    """``reduction="auto"`` over one step (or one stream of :class:`fxpipe.AsyncTrainer`). ``output_dim`` and
    ``target_dim`` are the batch dimensions of the outputs and targets; ``check=False`` trusts a loss it does not
    recognise to be a per-sample mean (an update made of one micro-batch needs no weights)."""

    def __init__(self, output_dim: int = 0, target_dim: int = 0, *, check: bool = True, own_mean: bool = False,
                 recognise: bool = True, estimate_scale: bool = True) -> None:
        self.checker = SampleMeanCheck(output_dim, target_dim) if check else None
        self.own_mean = own_mean   # a token sum divided by its own count at once (an update of one micro-batch)
        self.recognise = recognise   # False: a cross-entropy mean is checked as any other loss (no count needed)
        self.estimate_scale = estimate_scale   # False: token sums scaled by the given scale (1 / N) as they are
        self.factors: dict[Hashable, torch.Tensor] = {}   # key -> the token sums' factor, from its first micro-batch
        self.kind: str | None = None
        self.first = -1
        self.loss_fn: Callable[[Any, Any], Any] | None = None   # the last one called (tying dp replicas reruns it)
        # micro-batch -> its loss (the token sum, or the scalar loss) and count (None: not a token loss), unweighted
        self.records: dict[int, tuple[torch.Tensor, Any]] = {}

    def __call__(self, loss_fn: Callable[[Any, Any], Any], output: Any, target: Any, micro_batch: int,
                 weight: float, scale: float, key: Hashable = None
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, Any]:
        """Micro-batch ``micro_batch``'s loss, backpropagated to the copies of ``output``: the (output tensor,
        gradient) pairs to backpropagate into the stages, the micro-batch's part of the step's loss and its
        count (``None`` for a per-sample mean, weighted ``weight``, its share of the samples). ``key`` names the
        unit divided by one count (the step, an update's group: its token factor and its check's reference
        sample are its own); ``scale`` (``1 / N``) is the token factor where it is not estimated."""
        self.loss_fn = loss_fn
        copies, pairs = _detached(output)
        calls = MeanCalls() if self.recognise else None
        with calls if calls is not None else nullcontext():
            result = loss_fn(copies, target)
        if isinstance(result, (tuple, list)):
            kind, (summed, count) = "token", token_pair(
                result, "loss_fn returned a tuple, which reduction='auto' reads as (loss_sum, count): it needs")
        else:
            found = calls.pair(result) if calls is not None else None
            kind = "sample" if found is None else "token"
            summed, count = found if found is not None else (result, None)
        self._same_kind(kind, micro_batch)
        if kind == "token":
            summed = summed.reshape(())
            self.records[micro_batch] = (summed.detach(), count)
            if self.own_mean:
                root, count = summed / count, None
            else:
                factor = self._factor(key, count, weight, scale, summed)
                root, count = summed * factor.to(summed.dtype), count * factor
        else:
            if not isinstance(result, torch.Tensor) or result.numel() != 1:
                shape = tuple(result.shape) if isinstance(result, torch.Tensor) else ""
                raise TypeError(f"loss_fn must return a scalar tensor (or a (loss_sum, count) pair), got "
                                f"{type(result).__name__}{shape}")
            self.records[micro_batch] = (result.detach().reshape(()), None)
            root = result.reshape(()) * weight if weight != 1 else result.reshape(())
        if root.requires_grad:
            root.backward()
        if kind == "sample" and self.checker is not None:
            self.checker.unbatched(copies, micro_batch)
            positions = self.checker.positions(copies)
            leaves = tree_flatten(copies)[0]
            grads = [leaves[p].grad if leaves[p].grad is not None else torch.zeros_like(leaves[p]) for p in positions]
            self.checker.check(loss_fn, copies, target, grads, micro_batch, key, weight=weight)
        return [(t, leaf.grad) for t, leaf in pairs if leaf.grad is not None], root.detach(), count

    def _factor(self, key: Hashable, count: Any, weight: float, scale: float, summed: torch.Tensor) -> torch.Tensor:
        """The token sums' factor of ``key``: from its first micro-batch (``weight / count``: ``1 / (N c_1 / n_1)``),
        on the loss's device without waiting for it; ``scale`` where that counted nothing or is not estimated."""
        if key not in self.factors:
            count = torch.as_tensor(count, device=summed.device, dtype=torch.float64)
            fixed = torch.full((), scale, dtype=torch.float64, device=summed.device)
            self.factors[key] = (torch.where(count > 0, weight / count.clamp(min=1e-30), fixed)
                                if self.estimate_scale else fixed)
        return self.factors[key]

    def _same_kind(self, kind: str, micro_batch: int) -> None:
        """Raises where micro-batches of one step take different ways (a subclass may refuse a way)."""
        if self.kind is None:
            self.kind, self.first = kind, micro_batch
        elif kind != self.kind:
            raise LossReductionError(
                f"loss_fn returned {_KINDS[self.kind]} on micro-batch {self.first} but {_KINDS[kind]} on "
                f"micro-batch {micro_batch}: one step cannot weight its micro-batches both ways; return "
                "(loss_sum, count) from every call and pass reduction='token'", stage=-1, micro_batch=micro_batch,
                node=None)
