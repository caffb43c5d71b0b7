"""The model's own output containers, given back as the user's code built them.

torch.fx stores a traced ``return {"logits": y}`` or ``return [a, b]`` as ``immutable_dict`` and
``immutable_list`` (graph arguments must not change); a pipeline that handed those back would give the
user a dict that refuses ``out["extra"] = ...``. Tuples, named tuples and other containers pass through
as they are.
"""

from __future__ import annotations

from typing import Any

from torch.fx.immutable_collections import immutable_dict, immutable_list

__all__ = ["user_structure"]


def user_structure(value: Any) -> Any:
    """``value`` with every fx immutable container turned into a plain ``dict`` or ``list``, recursively."""
    if isinstance(value, immutable_dict):
        return {k: user_structure(v) for k, v in value.items()}
    if isinstance(value, immutable_list):
        return [user_structure(v) for v in value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):   # a named tuple keeps its type
        return type(value)(*(user_structure(v) for v in value))
    if type(value) is tuple:
        return tuple(user_structure(v) for v in value)
    if isinstance(value, dict):
        return type(value)({k: user_structure(v) for k, v in value.items()})
    if type(value) is list:
        return [user_structure(v) for v in value]
    return value
