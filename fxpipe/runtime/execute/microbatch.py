"""Splitting a batch into micro-batches and gathering the outputs back, along a batch dimension that need
not be 0.

A batch of ``B`` samples in ``chunks`` is always ``chunks`` micro-batches whose sizes differ by at most one
(``torch.tensor_split``, as torch.distributed.pipelining splits), so the schedule the plan was made for is
the schedule that runs, uneven batches included (``torch.chunk``, torchgpipe's split, can give fewer: 6
in 4 is 3 of 2, which an interleaved schedule cannot run).

Inputs, targets and outputs are pytrees (tuples, lists, dicts of tensors, nested): every tensor leaf that
has the batch dimension is split along it and every other leaf (a 0-dim
tensor, a number, a string, ``None``) is shared by all micro-batches. ``dims`` gives the batch dimension of
each top-level value (one int for all): a sequence-first ``nn.LSTM`` input ``(T, B, F)`` has batch
dimension 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

__all__ = ["BatchLayout", "scatter", "gather", "batch_size_of", "leaf_batch_sizes"]


@dataclass(frozen=True)
class BatchLayout:
    """Where the samples are: each input's batch dimension by forward-argument name (missing: 0), the
    dimension the outputs are gathered along and the one the target is split along (``plan.batch_dims``)."""

    inputs: dict[str, int] = field(default_factory=dict)
    output: int = 0
    target: int = 0

    @classmethod
    def of(cls, doc: dict[str, Any] | None) -> "BatchLayout":
        doc = doc or {}
        return cls(dict(doc.get("inputs", {})), int(doc.get("output", 0)), int(doc.get("target", 0)))

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": dict(self.inputs), "output": self.output, "target": self.target}

    def input_dims(self, arguments: Sequence[str]) -> list[int]:
        return [self.inputs.get(a, 0) for a in arguments]


def _per_value(values: list[Any], dims: int | Sequence[int]) -> list[int]:
    out = [dims] * len(values) if isinstance(dims, int) else list(dims)
    if len(out) != len(values):
        raise ValueError(f"{len(out)} batch dimensions for {len(values)} values")
    return out


def _batched(leaf: Any, dim: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > dim


def leaf_batch_sizes(value: Any, dim: int) -> dict[str, int]:
    """The size along ``dim`` of every tensor leaf of ``value`` that has that dimension, by its path."""
    return {keystr(path): leaf.size(dim) for path, leaf in tree_flatten_with_path(value)[0] if _batched(leaf, dim)}


def batch_size_of(values: list[Any], dims: int | Sequence[int] = 0) -> int:
    """The common size of the batch dimension of every tensor leaf of ``values``; raises if they disagree."""
    sizes = {f"[{index}]{path}": size for index, (value, dim) in enumerate(zip(values, _per_value(values, dims)))
             for path, size in leaf_batch_sizes(value, dim).items()}
    if not sizes:
        kinds = ", ".join(type(v).__name__ for v in values) or "nothing"
        raise ValueError(f"the pipeline needs at least one tensor (inside tuples, lists or dicts too) with a batch "
                         f"dimension to split into micro-batches; got {kinds} (batch dimension "
                         f"{_per_value(values, dims)}): pass the batch as tensors, or set "
                         "CompileOptions(batch_dim=...) to the dimension that holds the samples")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"tensors disagree on the batch size (batch dimension {_per_value(values, dims)}): "
                         f"{sizes}; every tensor with a batch dimension must hold the same samples, or give each "
                         "input its own dimension with CompileOptions(batch_dim={name: dim})")
    return next(iter(sizes.values()))


def scatter(values: list[Any], chunks: int, dims: int | Sequence[int] = 0) -> list[list[Any]]:
    """Split every batched tensor leaf of ``values`` along its batch dimension into ``chunks`` micro-batches
    (``torch.tensor_split``: sizes differ by at most one, the larger first); other leaves are shared. A batch
    smaller than ``chunks`` is an error.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    per = _per_value(values, dims)
    batch = batch_size_of(values, per)
    if batch == 0:
        raise ValueError(f"the batch is empty (0 samples along batch dimension {per}): pass at least one sample "
                         f"(at least {chunks}, one per micro-batch)")
    if batch < chunks:
        raise ValueError(
            f"a batch of {batch} samples cannot be split into {chunks} micro-batches; "
            f"use a batch of at least {chunks} samples or chunks <= {batch}"
        )
    count = chunks
    split = []
    for value, dim in zip(values, per):
        leaves, spec = tree_flatten(value)
        pieces = [leaf.tensor_split(chunks, dim) if _batched(leaf, dim) else None for leaf in leaves]
        split.append([tree_unflatten([p[i] if p is not None else leaf for leaf, p in zip(leaves, pieces)], spec)
                      for i in range(count)])
    return [[column[i] for column in split] for i in range(count)]


def gather(outputs: list[Any], dim: int = 0) -> Any:
    """Concatenate micro-batch outputs along ``dim``, leaf by leaf, keeping their structure."""
    flat = [tree_flatten(o) for o in outputs]
    leaves0, spec = flat[0]
    merged = []
    for i, leaf in enumerate(leaves0):
        column = [f[0][i] for f in flat]
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() <= dim:
                raise ValueError(
                    f"output leaf {i} is a {leaf.dim()}-dim tensor without the batch dimension {dim} (e.g. a loss "
                    "computed inside the model); the pipeline cannot merge it across micro-batches: return "
                    "per-sample values and reduce them after the pipeline (or set CompileOptions(output_batch_dim=...))"
                )
            merged.append(torch.cat(column, dim) if len(column) > 1 else column[0])
        else:
            merged.append(leaf)
    return tree_unflatten(merged, spec)
