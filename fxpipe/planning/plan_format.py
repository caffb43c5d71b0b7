"""Reading a plan file safely: bounded parsing, the shipped JSON Schema, then the checks a schema cannot say.

A plan may come from anywhere (a colleague, a notebook, an attacker), so loading executes no code (JSON
only, never pickle) and allocates bounded memory: files over :data:`MAX_PLAN_BYTES` are refused before
they are read, nesting deeper than Python's recursion limit, non-finite numbers (``NaN``, ``Infinity``,
``1e999``) and integers of more than 4300 digits are refused while parsing, and every field is checked
against ``plan.schema.json`` (shipped in this package; validated with the ``jsonschema`` library) with its
bounds: at most a million micro-batches, 65536 stages, no unknown keys. The schema's version is the plan's
``format``; :data:`MIGRATIONS` turns an older format into the current one: ``fxpipe-plan/1`` (before the
``mesh`` field; a pipeline over all its devices) reads as ``fxpipe-plan/2`` without a mesh.
"""

from __future__ import annotations

import json
import math
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import jsonschema

from fxpipe.errors import PlanFormatError

__all__ = ["MAX_PLAN_BYTES", "MIGRATIONS", "PLAN_FORMAT", "check_plan_document", "plan_schema", "read_plan_document"]

PLAN_FORMAT = "fxpipe-plan/2"
MAX_PLAN_BYTES = 64 * 2**20
MIGRATIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "fxpipe-plan/1": lambda doc: {**doc, "format": "fxpipe-plan/2"},   # /2 added the optional "mesh"
}
"""``format`` of an older plan -> a function returning the document in the next format."""


@cache
def plan_schema() -> dict[str, Any]:
    """The JSON Schema of the current plan format (``fxpipe/planning/plan.schema.json``)."""
    return json.loads(resources.files("fxpipe.planning").joinpath("plan.schema.json").read_text())


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is not finite")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a plan may hold")


def read_plan_document(path: str | Path) -> Any:
    """The parsed JSON of a plan file, refusing what would cost unbounded memory or time."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise PlanFormatError(f"cannot read plan {path}: {exc}") from exc
    if size > MAX_PLAN_BYTES:
        raise PlanFormatError(f"{path} has {size} bytes; a plan has at most {MAX_PLAN_BYTES} "
                              "(is this the right file?)")
    try:
        return json.loads(path.read_bytes().decode("utf-8"), parse_float=_finite, parse_constant=_no_constant)
    except RecursionError as exc:
        raise PlanFormatError(f"{path} nests JSON too deeply to be a plan") from exc
    except (ValueError, UnicodeDecodeError) as exc:   # JSONDecodeError, non-finite or 4300+ digit numbers
        raise PlanFormatError(f"{path} is not JSON that a plan can hold: {exc}; save the plan again with "
                              "plan.save(path)") from exc


def check_plan_document(doc: Any) -> dict[str, Any]:
    """``doc`` migrated to the current format and checked; raises :class:`PlanFormatError` naming the field."""
    if not isinstance(doc, dict):
        raise PlanFormatError(f"a plan must be a JSON object, got {type(doc).__name__}")
    while doc.get("format") in MIGRATIONS:
        doc = MIGRATIONS[doc["format"]](doc)
    if doc.get("format") != PLAN_FORMAT:
        raise PlanFormatError(
            f"plan format is {str(doc.get('format'))[:80]!r}; this fxpipe reads {PLAN_FORMAT!r}. "
            "Re-create the plan with fxpipe.compile(..., example_inputs=...) and save it again")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(plan_schema()).iter_errors(doc))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(the plan)"
        raise PlanFormatError(f"plan field {where}: {error.message[:300]}; save the plan again with plan.save(), "
                              "or see docs/plan-format.md for what each field holds")
    devices, seen = set(doc["devices"]), set()
    for i, stage in enumerate(doc["stages"]):
        if stage.get("index", i) != i:
            raise PlanFormatError(f"plan field stages/{i}/index is {stage['index']}; stages are listed in order")
        if stage["device"] not in devices:
            raise PlanFormatError(f"plan field stages/{i}/device {stage['device']!r} is not among devices "
                                  f"{sorted(devices)}")
        twice = seen.intersection(stage["nodes"])
        if twice or len(set(stage["nodes"])) != len(stage["nodes"]):
            raise PlanFormatError(f"plan field stages/{i}/nodes: node(s) {sorted(twice)[:5] or 'repeated'} "
                                  "belong to more than one place; every node runs in exactly one stage")
        seen.update(stage["nodes"])
    return doc
