"""Splitting a batch into micro-batches and gathering the outputs back (as torchgpipe does)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["scatter", "gather", "batch_size_of"]


def batch_size_of(values: list[Any]) -> int:
    """The common size of dimension 0 of every tensor input; raises if they disagree."""
    sizes = {v.size(0) for v in values if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not sizes:
        raise ValueError("the pipeline needs at least one tensor input with a batch dimension (dim 0)")
    if len(sizes) > 1:
        raise ValueError(f"tensor inputs disagree on the batch size (dim 0): {sorted(sizes)}")
    return sizes.pop()


def scatter(values: list[Any], chunks: int) -> list[list[Any]]:
    """Split every batched tensor along dim 0 with ``torch.chunk``; other values are shared.

    Like ``torch.chunk``, an uneven batch gives smaller last micro-batches and
    possibly fewer than ``chunks`` of them. A batch smaller than ``chunks`` is an error.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    batch = batch_size_of(values)
    if batch < chunks:
        raise ValueError(
            f"a batch of {batch} samples cannot be split into {chunks} micro-batches; "
            f"use a batch of at least {chunks} samples or chunks <= {batch}"
        )
    pieces = [v.chunk(chunks) if isinstance(v, torch.Tensor) and v.dim() > 0 else None for v in values]
    count = min(len(p) for p in pieces if p is not None)
    return [[p[i] if p is not None else v for v, p in zip(values, pieces)] for i in range(count)]


def gather(outputs: list[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0, leaf by leaf, keeping their structure."""
    flat = [tree_flatten(o) for o in outputs]
    leaves0, spec = flat[0]
    merged = []
    for i, leaf in enumerate(leaves0):
        column = [f[0][i] for f in flat]
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    f"output leaf {i} is a 0-dim tensor (e.g. a loss computed inside the model); "
                    "the pipeline cannot merge it across micro-batches: return per-sample values "
                    "and reduce them after the pipeline"
                )
            merged.append(torch.cat(column) if len(column) > 1 else column[0])
        else:
            merged.append(leaf)
    return tree_unflatten(merged, spec)
