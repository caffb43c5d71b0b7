"""Reading a plan file safely: bounded parsing, the shipped JSON Schema, then the checks a schema cannot say.

A plan may come from anywhere (a colleague, a notebook, an attacker), so loading executes no code (JSON
only, never pickle) and allocates bounded memory: files over :data:`MAX_PLAN_BYTES` are refused before
they are read, nesting deeper than Python's recursion limit, non-finite numbers (``NaN``, ``Infinity``,
``1e999``) and integers of more than 4300 digits are refused while parsing, and every field is checked
against ``plan.schema.json`` (shipped in this package; validated with the ``jsonschema`` library) with its
bounds: at most a million micro-batches, 65536 stages, no unknown keys. The schema's version is the plan's
``format``; :data:`MIGRATIONS` turns an older format into the current one: ``fxpipe-plan/1`` (before the
``mesh`` field; a pipeline over all its devices) reads as ``fxpipe-plan/2`` without a mesh; ``fxpipe-plan/2``
(the degrees in ``mesh``) reads as ``fxpipe-plan/3``, whose ``layout`` is the one record of the degrees, the
data-parallel mode, the order, sequence parallelism, the schedule and each stage's recomputation
(:class:`solvers.layout.Layout`), ``mesh`` keeping where its dimensions run; ``fxpipe-plan/3`` reads as
``fxpipe-plan/4``, whose layout also says the precision (the model's own dtype's for an older plan: it ran
the model as it was built, :func:`_precision_of_v3`).
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
from fxpipe.frontend.precision import PRECISION_OF_DTYPE

__all__ = ["MAX_PLAN_BYTES", "MIGRATIONS", "PLAN_FORMAT", "check_plan_document", "plan_schema", "read_plan_document"]

PLAN_FORMAT = "fxpipe-plan/4"
MAX_PLAN_BYTES = 64 * 2**20
_DEGREES = ("pp", "dp", "tp", "dp_mode", "order", "sequence_parallel")


def _layout_of_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """An ``fxpipe-plan/2`` document as ``/3``: the degrees move from ``mesh`` to ``layout`` (a mesh's
    ``dp_mode`` names where ``dp`` goes: replicas for ``replicate``, else shards, the mode unsaid where the mesh
    did not say it, as ``/2`` read it; a pipeline alone is ``pp`` of its workers); the recomputation is left for
    the plan to read off its stages."""
    stages, v = doc.get("stages") or [], doc.get("virtual_stages", 1) or 1
    mesh = doc.get("mesh")
    layout: dict[str, Any] = {"pp": max(1, len(stages) // v), "schedule": doc.get("schedule"), "virtual_stages": v}
    if isinstance(mesh, dict):
        dp, mode = mesh.get("dp", 1), mesh.get("dp_mode")
        replicas = mode == "replicate"
        layout.update(pp=mesh.get("pp", layout["pp"]), tp=mesh.get("tp", 1), order=mesh.get("order", "pp-dp-tp"),
                      dp_mode=mode, dp_shard=1 if replicas else dp, dp_replicate=dp if replicas else 1)
        if mesh.get("tp", 1) > 1 and mesh.get("sequence_parallel") is not None:
            layout["sequence_parallel"] = bool(mesh["sequence_parallel"])
        mesh = {k: val for k, val in mesh.items() if k not in _DEGREES}
    return {**doc, "format": "fxpipe-plan/3", "mesh": mesh, "layout": layout}


def _precision_of_v3(doc: dict[str, Any]) -> dict[str, Any]:
    """An ``fxpipe-plan/3`` document as ``/4``: the layout says the precision, the one its model trained in as
    built (``profile["dtype"]`` where the plan recorded it: ``fxpipe.plan``'s; else unsaid, the model's own)."""
    layout = dict(doc.get("layout") or {})
    dtype = (doc.get("profile") or {}).get("dtype") if isinstance(doc.get("profile"), dict) else None
    layout.setdefault("precision", PRECISION_OF_DTYPE.get(dtype) if isinstance(dtype, str) else None)
    return {**doc, "format": "fxpipe-plan/4", "layout": layout}


MIGRATIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "fxpipe-plan/1": lambda doc: {**doc, "format": "fxpipe-plan/2"},   # /2 added the optional "mesh"
    "fxpipe-plan/2": _layout_of_v2,                                     # /3: the degrees in "layout"
    "fxpipe-plan/3": _precision_of_v3,                                  # /4: the precision in "layout"
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
