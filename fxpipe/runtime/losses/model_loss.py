"""Training on the loss the model computes itself: ``pipe.step(ids, labels=labels)`` with no ``loss_fn``.

The graph's loss leaf holds each micro-batch's summed loss and :class:`fxpipe.frontend.model_loss.ModelLoss`
counts what the model's mean divides by (:mod:`fxpipe.frontend.model_loss`). Here those pairs become the
step's ``reduction="token"`` loss (:mod:`fxpipe.runtime.losses.losses`), the model's output gets the whole batch's
``sum / count`` as its loss, and a ``loss_fn`` the user passes on such a graph sees each micro-batch's own
mean in the output's loss, as the model would have returned it for that micro-batch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fxpipe.errors import FxpipeError
from fxpipe.frontend.model_loss import UNCOMBINED, ModelLoss
from fxpipe.runtime.execute.microbatch import gather

__all__ = ["own_loss", "with_micro_batch_mean", "gather_outputs", "no_model_loss_error"]


def _replace(output: Any, leaf: int, value: Any) -> Any:
    leaves = list(output) if isinstance(output, (tuple, list)) else [output]
    leaves[leaf] = value
    return tuple(leaves)


def own_loss(model_loss: ModelLoss) -> Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor]]:
    """The ``reduction="token"`` loss of a micro-batch: its summed loss leaf and its count (the target)."""
    def loss_fn(output: Any, count: Any) -> tuple[torch.Tensor, torch.Tensor]:
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        return leaves[model_loss.leaf], count
    return loss_fn


def with_micro_batch_mean(loss_fn: Callable[[Any, Any], Any], model_loss: ModelLoss) -> Callable[[Any, Any], Any]:
    """``loss_fn`` of the user, called with the output's loss leaf as the model's mean over the micro-batch
    (the step passes ``(target, count)`` as its target)."""
    def wrapped(output: Any, target_and_count: tuple[Any, Any]) -> Any:
        target, count = target_and_count
        total = output[model_loss.leaf]
        return loss_fn(_replace(output, model_loss.leaf, total / count.to(total.device)), target)
    return wrapped


def gather_outputs(outputs: list[Any], dim: int, model_loss: ModelLoss | None, counts: list[torch.Tensor]) -> Any:
    """The micro-batches' outputs joined along ``dim``; the model's loss leaf as the whole batch's mean."""
    if model_loss is None:
        return gather(outputs, dim)
    sums = [o[model_loss.leaf] for o in outputs]
    device = sums[0].device
    total = torch.stack([s.to(device) for s in sums]).sum()
    count = torch.stack([c.to(device) for c in counts]).sum()
    rest = gather([_replace(o, model_loss.leaf, 0) for o in outputs], dim)
    return _replace(rest, model_loss.leaf, total / count)


def no_model_loss_error(meta: dict[str, Any]) -> FxpipeError:
    """Why ``pipe.step`` without a ``loss_fn`` cannot train this graph, and what to do."""
    why = meta.get(UNCOMBINED)
    if why is not None:
        return FxpipeError(
            f"pipe.step was given no loss_fn, so it trains on the loss the model returns, but that loss cannot be "
            f"combined exactly across micro-batches: {why}. Fix: pass loss_fn(output, target) computing the loss "
            "from the model's outputs, with reduction='token' and loss_fn returning (loss_sum, count) for a loss "
            "averaged over tokens (e.g. (F.cross_entropy(logits, labels, ignore_index=-100, reduction='sum'), "
            "(labels != -100).sum()))")
    return FxpipeError(
        "pipe.step was given no loss_fn and the model returns no loss of its own: pass loss_fn(output, target), "
        "or compile the model with the inputs that make it compute its loss (example_kwargs={'labels': labels} "
        "for a Hugging Face model) and call pipe.step(inputs, labels=labels)")
