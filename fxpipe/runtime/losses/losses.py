"""How the micro-batches' losses make one step's loss and gradients: ``reduction="mean"``, ``"sum"``, ``"token"``
(and ``"auto"``, the default, which picks ``"token"`` or ``"mean"`` or refuses: :mod:`fxpipe.runtime.losses.auto_loss`).

``"mean"`` weights micro-batch ``i``'s loss by ``n_i / N`` (its share of the samples): exact for a loss that
averages over samples of equal weight (``mse_loss``, ``cross_entropy`` on one label per sample), since the
full-batch mean is then the weighted mean of the micro-batch means. It is not exact for a loss averaged
over elements that are not spread evenly over the samples: ``cross_entropy(ignore_index=-100)`` on padded
sequences averages over the non-ignored tokens, and micro-batches hold different numbers of them.

``"token"`` is the exact way for those (Megatron-LM's per-token loss): ``loss_fn`` returns
``(loss_sum, count)``, the loss summed over the micro-batch and how many elements it summed. Each
micro-batch's ``loss_sum`` is backpropagated unscaled; only when every micro-batch has been counted is
the global count known, and the step's gradient contribution is then divided by it
(:class:`StepGradients`), as Megatron-LM divides the gradients by the number of tokens when it finalises
them. Gradients that were in ``.grad`` before the step (accumulation over steps) are kept apart and not
scaled. The step's loss is the total sum over the total count: the full-batch per-element mean.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

__all__ = ["REDUCTIONS", "TOKEN_EXAMPLE", "LossFailure", "Replicas", "StepGradients", "token_pair", "weigh",
           "scalar_of", "total_count"]

REDUCTIONS = ("auto", "mean", "sum", "token")

TOKEN_EXAMPLE = ("loss_fn = lambda logits, labels: (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), "
                 "ignore_index=-100, reduction='sum'), (labels != -100).sum())")


class LossFailure(Exception):
    """``loss_fn`` raised, or returned something a step cannot use; the original is ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


def _scalar(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ""
        raise TypeError(f"{what} a scalar tensor, got {type(value).__name__}{shape}")
    return value.reshape(())


def token_pair(result: Any, what: str = "reduction='token' needs") -> tuple[torch.Tensor, Any]:
    """``loss_fn``'s ``(loss_sum, count)``, checked: a scalar tensor and a number or scalar tensor (detached)."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = type(result).__name__ + (f" of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else "")
        raise TypeError(f"{what} loss_fn to return (loss_sum, count), the loss summed over the micro-batch and how "
                        f"many elements it summed; got {got}. For example:\n    {TOKEN_EXAMPLE}\n"
                        "(or leave reduction unset: reduction='auto' weights an F.cross_entropy/F.nll_loss mean "
                        "returned as it is by its count, and checks that any other scalar loss is a mean over "
                        "samples)")
    loss_sum = _scalar(result[0], "loss_fn's loss_sum must be")
    count = result[1]
    if isinstance(count, torch.Tensor):
        count = _scalar(count, "loss_fn's count must be").detach()
    elif isinstance(count, bool) or not isinstance(count, (int, float)):
        raise TypeError(f"loss_fn's count must be a number or a scalar tensor, got {type(count).__name__}")
    return loss_sum, count


def weigh(result: Any, reduction: str, size: int, total: float,
          summed: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``loss_fn``'s result for one micro-batch of ``size`` of ``total`` samples: the tensor to backpropagate,
    its part of the returned loss (summed over micro-batches) and its count (``"token"``; else None).
    ``"sum"`` weights it ``summed``."""
    pair = isinstance(result, (tuple, list))
    if reduction == "token":
        loss_sum, count = token_pair(result)
        return loss_sum, loss_sum.detach(), count
    if pair:
        raise TypeError(f"loss_fn returned a pair (loss_sum, count), which reduction={reduction!r} cannot use: "
                        "pass pipe.step(..., reduction='token') to divide the summed loss by the whole batch's count")
    loss = _scalar(result, "loss_fn must return")
    weight = size / total if reduction == "mean" else summed
    if weight == 1:   # the whole batch in one micro-batch: the loss as it is, as the plain model's
        return loss, loss.detach(), None
    return loss * weight, loss.detach() * weight, None


def scalar_of(result: Any) -> torch.Tensor:
    """A loss to backpropagate when only its shape of gradients matters (memory, timing): the sum of a pair."""
    return result[0] if isinstance(result, (tuple, list)) else result


class StepGradients:
    """The step's gradients kept apart from what ``.grad`` held before it, to be scaled alone."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.saved = {t: t.grad for t in dict.fromkeys(tensors) if t.requires_grad}
        for t in self.saved:
            t.grad = None

    def restore(self) -> None:
        """A failed step: drop its partial gradients, put back the earlier ones."""
        for t, before in self.saved.items():
            t.grad = before

    def finish(self, count: Any) -> None:
        """Divide the step's gradients by the global ``count`` (``None``: they are weighted already) and add back
        the earlier ones."""
        total = 1.0 if count is None else float(count)
        if not total > 0:
            self.restore()
            raise ValueError(f"loss_fn counted {total:g} elements over the whole batch (every target ignored?): "
                             "the per-element mean is undefined; skip this batch or count at least one element")
        got = [t for t in self.saved if t.grad is not None]
        for t in self.saved:
            if t.grad is None:
                t.grad = self.saved[t]
        with torch.no_grad():   # one multi-tensor operator per kind of gradient, not one per tensor
            for group in _kinds(got):
                if count is not None:
                    torch._foreach_mul_([t.grad for t in group], 1.0 / total)
                earlier = [t for t in group if self.saved[t] is not None]
                if earlier:   # accumulate into the caller's tensors, as autograd does
                    torch._foreach_add_([self.saved[t] for t in earlier], [t.grad for t in earlier])
                    for t in earlier:
                        t.grad = self.saved[t]


def _kinds(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by their gradients' kind: plain tensors together, DTensors (tensor-parallel or FSDP
    stages) by mesh and placements, which a ``_foreach`` operator cannot mix."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        g = t.grad
        key = (type(g), id(getattr(g, "device_mesh", None)), tuple(map(str, getattr(g, "placements", ()))))
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def total_count(counts: list[Any], device: torch.device) -> Any:
    """The step's count, summed over its micro-batches (``None`` where they have none: not a token loss)."""
    if counts[0] is None:
        return None
    return functools.reduce(operator.add, [c.to(device) if isinstance(c, torch.Tensor) else c for c in counts])


@dataclass
class Replicas:
    """``dp`` copies of a pipeline, each training its share of the batch, whose gradients are then averaged over
    them (``DistributedDataParallel``; :mod:`fxpipe.distributed.mesh`). A micro-batch of ``n_i`` samples counts
    ``dp * n_i / samples`` under ``"mean"`` (``samples``: the whole batch's, over every replica), ``dp`` under
    ``"sum"``; a token count is ``sum_counts(count)``, summed over the replicas (every replica calls it, also
    with ``None``) and divided by ``dp``. ``tie(auto, failed)``, a collective of the last stages' replicas,
    returns an exception where ``"auto"``'s check finds that their reference samples weigh differently."""

    count: int
    samples: int
    sum_counts: Callable[[Any], Any]
    tie: Callable[[Any, bool], BaseException | None] | None = None
