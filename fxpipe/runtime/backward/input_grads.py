"""Inputs that carry the caller's autograd graph into ``pipe.step``: detached at the entry, handed on once.

An input that is not a leaf but requires grad (``pipe.step(encoder(x), ...)``, an embedding computed
outside the pipeline) ties every micro-batch's backward to one graph of the caller's. Each micro-batch's
backward would run through that graph and free it, so the second one fails ("backward through the graph a
second time"), and a split backward (ZB-H1, ZB-V) stops at the micro-batch's slice. As
torch.distributed.pipelining does for its stage inputs, the step runs on a detached leaf copy of each such
input; its ``.grad`` collects every micro-batch's contribution, and one ``torch.autograd.backward`` from
the caller's tensor hands the sum on after the step, as one full-batch backward would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["InputGraphs"]


class InputGraphs:
    """The caller's non-leaf inputs that require grad, and the leaves standing in for them in a step."""

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []   # (caller's tensor, detached leaf)

    def detach(self, value: Any) -> Any:
        """``value`` with each tensor that requires grad and has a ``grad_fn`` replaced by a leaf copy."""
        leaves, spec = tree_flatten(value)
        out = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.grad_fn is not None:
                stand_in = leaf.detach().requires_grad_()
                self._pairs.append((leaf, stand_in))
                leaf = stand_in
            out.append(leaf)
        return tree_unflatten(out, spec)

    def hand_on(self) -> None:
        """One backward from the caller's tensors with the gradients their stand-ins collected."""
        pairs = [(t, s.grad) for t, s in self._pairs if s.grad is not None]
        self._pairs = []
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
