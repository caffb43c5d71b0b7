"""Each input leaf's batch dimension for the torch.export front end, from ``CompileOptions.batch_dim``.

torch.export flattens ``(args, kwargs)`` into one placeholder per leaf, so a batch dimension given by
forward argument (``batch_dim={"memory": 1}``, or one per argument in order) is resolved here to every leaf
of that argument: keyword arguments by their keyword, positional ones by the forward's parameter names.
An argument that is a nested dict/tuple/list may take one number for all its tensors or the same structure
of numbers (``batch_dim={"batch": {"tokens": 0, "memory": 1}}``). The per-leaf list goes to
``gm.meta["fxpipe_leaf_batch_dims"]`` (the graph's placeholders in order), which the batch layout reads.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["LEAF_DIMS", "leaf_batch_dims"]

LEAF_DIMS = "fxpipe_leaf_batch_dims"


def _arguments(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, value) of every input given: positional ones named by the forward's parameters."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    named = [(params[i] if i < len(params) else f"args[{i}]", a) for i, a in enumerate(args)]
    return named + list(kwargs.items())


def _dims_of(name: str, value: Any, dims: Any) -> list[int]:
    """The batch dimension of each leaf of one argument."""
    leaves, spec = tree_flatten(value)
    if isinstance(dims, int) and not isinstance(dims, bool):
        return [dims] * len(leaves)
    given, given_spec = tree_flatten(dims)
    if given_spec != spec or not all(isinstance(d, int) and not isinstance(d, bool) for d in given):
        raise ValueError(f"batch_dim for input {name!r} must be one number or numbers in the structure of the "
                         f"input ({spec}), got {dims!r}")
    return list(given)


def leaf_batch_dims(model: nn.Module, args: tuple, kwargs: dict[str, Any], batch_dim: Any) -> list[int]:
    """The batch dimension of every leaf of ``(args, kwargs)``, in ``tree_flatten`` order (module doc)."""
    arguments = _arguments(model, args, kwargs)
    names = [n for n, _ in arguments]
    if isinstance(batch_dim, int):
        per = {n: batch_dim for n in names}
    elif isinstance(batch_dim, Mapping):
        unknown = sorted(set(batch_dim) - set(names))
        if unknown:
            raise ValueError(f"batch_dim names {unknown}, which are not inputs given to the model: its inputs "
                             f"are {names} (positional ones by the forward's parameter names); name one of "
                             "those, or pass the input in example_inputs/example_kwargs")
        per = {n: batch_dim.get(n, 0) for n in names}
    else:
        dims = list(batch_dim)
        if len(dims) > len(names):
            raise ValueError(f"batch_dim gives {len(dims)} dimensions for the {len(names)} inputs {names}; give "
                             "one per input, in order (positional, then keyword)")
        per = {n: dims[i] if i < len(dims) else 0 for i, n in enumerate(names)}
    out: list[int] = []
    for name, value in arguments:
        out += _dims_of(name, value, per[name])
    return out
