"""A planning solution (``fxpipe-solution/1``, or ``/2`` with replica groups): node -> stage, stage -> devices."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solvers.errors import InvalidProblemError

__all__ = ["Stage", "Solution", "SOLUTION_FORMAT", "SOLUTION_FORMATS", "assignment_from_cuts"]

SOLUTION_FORMAT = "fxpipe-solution/1"
SOLUTION_FORMATS = ("fxpipe-solution/1", "fxpipe-solution/2")


def assignment_from_cuts(order: list[str], cuts: list[int] | tuple[int, ...]) -> dict[str, int]:
    """Node -> stage for contiguous stages of ``order`` that start at the sorted positions ``cuts``."""
    stage_of, k = {}, 0
    bounds = list(cuts) + [len(order)]
    for i, node_id in enumerate(order):
        while i >= bounds[k]:
            k += 1
        stage_of[node_id] = k
    return stage_of


@dataclass
class Stage:
    nodes: list[str]
    devices: list[str]


@dataclass
class Solution:
    """Stages in pipeline order, the predicted reference costs, and how it was found."""

    stages: list[Stage]
    predicted: dict[str, Any] = field(default_factory=dict)
    solver: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SOLUTION_FORMATS[1] if any(len(s.devices) > 1 for s in self.stages) else SOLUTION_FORMAT,
            "stages": [{"nodes": list(s.nodes), "devices": list(s.devices)} for s in self.stages],
            "predicted": self.predicted,
            "solver": self.solver,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "Solution":
        if not isinstance(doc, dict) or doc.get("format") not in SOLUTION_FORMATS:
            raise InvalidProblemError(f"a solution must be a JSON object with format {' or '.join(map(repr, SOLUTION_FORMATS))}")
        stages = doc.get("stages")
        if not isinstance(stages, list) or not stages:
            raise InvalidProblemError("solution: 'stages' must be a non-empty list")
        out = []
        for i, s in enumerate(stages):
            if not isinstance(s, dict) or not isinstance(s.get("nodes"), list) or not isinstance(s.get("devices"), list):
                raise InvalidProblemError(f"solution: stages[{i}] needs lists 'nodes' and 'devices'")
            if doc["format"] == SOLUTION_FORMAT and len(s["devices"]) != 1:
                raise InvalidProblemError(
                    f"solution: stages[{i}] has {len(s['devices'])} devices; format {SOLUTION_FORMAT!r} has one "
                    f"per stage (replica groups are {SOLUTION_FORMATS[1]!r})")
            out.append(Stage([str(n) for n in s["nodes"]], [str(d) for d in s["devices"]]))
        return cls(out, dict(doc.get("predicted", {})), dict(doc.get("solver", {})))

    @classmethod
    def load(cls, path: str | Path) -> "Solution":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))
