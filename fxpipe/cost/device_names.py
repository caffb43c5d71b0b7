"""OneFlow-style device names: ``"0:0-7,1:0-7"`` is GPUs 0 to 7 of node 0 and GPUs 0 to 7 of node 1.

Each comma-separated item is ``NODE:FIRST-LAST`` (or ``NODE:INDEX``), a node rank (the ``--node-rank`` /
``GROUP_RANK`` of torchrun) and an inclusive range of its GPU indices. :func:`parse_device_names` turns the
string into ``(node, "cuda:<index>")`` pairs in order; :func:`is_device_names` tells such a string from a torch
device string (``"cuda:0"`` has no digit before its colon).
"""

from __future__ import annotations

import re
from typing import Sequence

__all__ = ["parse_device_names", "is_device_names", "EXAMPLE"]

EXAMPLE = "'0:0-7,1:0-7' (GPUs 0-7 of node 0 and of node 1) or '0:0-3'"
_ITEM = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def is_device_names(devices: str | Sequence[object]) -> bool:
    """Whether ``devices`` (a string, or a list of strings as a CLI splits it at commas) is OneFlow-style."""
    items = devices.split(",") if isinstance(devices, str) else list(devices)
    return bool(items) and all(isinstance(d, str) and re.match(r"\s*\d+\s*:", d) for d in items)


def parse_device_names(spec: str) -> list[tuple[int, str]]:
    """``[(node, "cuda:i"), ...]`` of a OneFlow-style string; ``ValueError`` naming the expected form."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"device names must be a string such as {EXAMPLE}, got {spec!r}")
    out: list[tuple[int, str]] = []
    for item in spec.split(","):
        m = _ITEM.fullmatch(item)
        if m is None:
            raise ValueError(f"device names {spec!r}: {item.strip()!r} is not NODE:FIRST-LAST or NODE:INDEX; "
                             f"expected e.g. {EXAMPLE}")
        node, first = int(m.group(1)), int(m.group(2))
        last = int(m.group(3)) if m.group(3) is not None else first
        if last < first:
            raise ValueError(f"device names {spec!r}: the range {first}-{last} of node {node} is empty; write "
                             f"FIRST-LAST with FIRST <= LAST, e.g. {EXAMPLE}")
        for index in range(first, last + 1):
            if (node, f"cuda:{index}") in out:
                raise ValueError(f"device names {spec!r} name GPU {index} of node {node} twice; name each once, "
                                 f"e.g. {EXAMPLE}")
            out.append((node, f"cuda:{index}"))
    return out
