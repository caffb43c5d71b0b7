"""``F.cross_entropy`` and ``F.nll_loss`` means seen inside ``loss_fn``, each computed as ``(sum, count)``.

Under ``reduction="auto"`` (:mod:`fxpipe.runtime.losses.auto_loss`) ``loss_fn`` runs inside :class:`MeanCalls`, a
``torch.overrides.TorchFunctionMode``. A call of ``F.cross_entropy`` or ``F.nll_loss`` (``nn.CrossEntropyLoss``
and ``nn.NLLLoss`` call them) with ``reduction="mean"`` is computed as the same call with
``reduction="sum"`` divided by what the mean divides by (:func:`sum_and_count`): the targets that are not
``ignore_index``, or their class weights' sum with ``weight=``; with probability targets the positions.
That is torch's own mean (label smoothing included: its smoothing term is divided by the same count), so
``loss_fn``'s value and gradients do not change. When ``loss_fn`` returns such a call's result itself
(``return F.cross_entropy(logits.flatten(0, 1), labels.flatten())``, shifted logits too), :meth:`MeanCalls.pair`
gives its ``(sum, count)``: the micro-batch's part of a full-batch per-token mean, exact with any split.

Other functions pass through unchanged (``__torch_function__`` runs with the mode popped, so the
replacement call is not seen again).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["MeanCalls", "sum_and_count"]

_MEANS: dict[Callable[..., Any], inspect.Signature] = {
    F.cross_entropy: inspect.signature(F.cross_entropy),
    F.nll_loss: inspect.signature(F.nll_loss),
}


def sum_and_count(func: Callable[..., Any], arguments: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``func``'s (``F.cross_entropy`` or ``F.nll_loss``) summed loss and what its mean divides it by, for a
    call's bound ``arguments`` (defaults applied)."""
    input, target, weight = arguments["input"], arguments["target"], arguments["weight"]
    summed = func(**{**arguments, "reduction": "sum"})
    dtype = torch.promote_types(summed.dtype, torch.float32)   # a count of tokens is not a half-precision number
    if target.is_floating_point():   # class probabilities: the mean is over positions, whatever the weights
        positions = input.numel() // input.size(1) if input.dim() > 1 else 1
        return summed, torch.tensor(float(positions), dtype=dtype, device=summed.device)
    counted = target != arguments["ignore_index"]
    if weight is None:
        return summed, counted.sum().to(dtype)
    classes = torch.where(counted, target, torch.zeros_like(target))   # an ignored target indexes nothing
    return summed, (weight[classes] * counted).sum().to(dtype)


class MeanCalls(TorchFunctionMode):
    """Within it, every ``F.cross_entropy``/``F.nll_loss`` mean is ``sum / count``, remembered by its result."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}   # id(result) -> it, sum, count

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        signature = _MEANS.get(func)
        if signature is None:
            return func(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:   # torch's own error for a bad call
            return func(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        legacy = arguments["size_average"] is not None or arguments["reduce"] is not None
        if legacy or arguments["reduction"] != "mean" or not isinstance(arguments["target"], torch.Tensor):
            return func(*args, **kwargs)
        summed, count = sum_and_count(func, arguments)
        mean = summed / count if summed.dtype == count.dtype else (summed.to(count.dtype) / count).to(summed.dtype)
        self.seen[id(mean)] = (mean, summed, count)
        return mean

    def pair(self, result: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sum, count)`` of the mean call whose result ``result`` is, if it is one."""
        found = self.seen.get(id(result))
        if found is None or found[0] is not result:
            return None
        return found[1], found[2]
