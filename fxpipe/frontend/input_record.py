"""What a plan keeps of the example inputs so a process can capture the model again without data.

A rank (:class:`fxpipe.distributed.PipelineRank`, ``fxpipe.launch``, ``plan.to_torch_pipelining``) must trace
the model exactly as the planning process did: the same front end and, for ``torch.export``, inputs of the
same structure, shapes and dtypes (export specialises on them). :func:`record_inputs` writes that down as
JSON (the pytree structure of ``(args, kwargs)`` as ``torch.utils._pytree.treespec_dumps`` gives it, and per
leaf a tensor's shape and dtype, or a plain Python value), with ``CompileOptions.batch_dim``;
:func:`recorded_inputs` builds zero tensors of that description on a given device (``meta`` for a model
built there: tracing reads shapes, never values).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from fxpipe.errors import PlanMismatchError

__all__ = ["record_inputs", "recorded_inputs"]

_PLAIN = (bool, int, float, str, type(None))


def _json_dims(batch_dim: Any) -> Any:
    if isinstance(batch_dim, (int, str)) or batch_dim is None:
        return batch_dim
    if isinstance(batch_dim, dict):
        return {str(k): _json_dims(v) for k, v in batch_dim.items()}
    if isinstance(batch_dim, (list, tuple)):
        return [_json_dims(v) for v in batch_dim]
    return None


def record_inputs(args: tuple, kwargs: dict[str, Any], batch_dim: Any = 0) -> dict[str, Any]:
    """The JSON description of one call's inputs (module doc)."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    described = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append({"shape": list(leaf.shape), "dtype": str(leaf.dtype).removeprefix("torch.")})
        elif isinstance(leaf, _PLAIN):
            described.append({"value": leaf})
        else:
            described.append({"unrecorded": type(leaf).__name__})
    try:
        structure = treespec_dumps(spec)
    except Exception as exc:   # a container pytree cannot serialise (a user's registered class)
        structure = f"unrecorded: {type(exc).__name__}: {exc}"
    return {"structure": structure, "leaves": described, "batch_dim": _json_dims(batch_dim)}


def recorded_inputs(record: dict[str, Any] | None, device: torch.device | str) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of zeros shaped as ``record`` says, on ``device``; a clear error where the plan holds
    no usable record."""
    if not record:
        raise PlanMismatchError(
            "the plan was made with the torch.export front end but records no example inputs to trace the model "
            "again with (a plan saved by an older fxpipe): plan the model again with this version "
            "(fxpipe.compile or fxpipe.plan, then plan.save)")
    structure = record.get("structure", "")
    missing = [leaf["unrecorded"] for leaf in record.get("leaves", []) if "unrecorded" in leaf]
    if structure.startswith("unrecorded") or missing:
        raise PlanMismatchError(
            f"the plan cannot record the model's example inputs ({structure if structure.startswith('unrecorded') else 'inputs of type ' + ', '.join(missing)}), "
            "so a process cannot trace the model again from it: pass the inputs as tensors in tuples, lists and "
            "dicts when planning")
    leaves = []
    for leaf in record["leaves"]:
        if "value" in leaf:
            leaves.append(leaf["value"])
        else:
            leaves.append(torch.zeros(leaf["shape"], dtype=getattr(torch, leaf["dtype"]), device=device))
    args, kwargs = tree_unflatten(leaves, treespec_loads(structure))
    return tuple(args), dict(kwargs)
