"""Schedules are records: no file outside the registry compares a schedule's name or keeps a table of names.

Every property of a schedule (placement, split backward, memory model, looser model, closed form, torch class) is
a field of its :class:`solvers.schedules.Schedule`, so a new schedule is one record and one order generator. This
test reads the product's code, ``fxpipe/`` and ``solvers/`` (not tests, benchmarks or docs), and fails on a comparison
with a schedule's name (``schedule == "zb-v"``, ``s in ("gpipe", "1f1b")``) or a literal collection of names (a
tuple, list, set or dict holding one), outside ``solvers/schedules.py``. Passing a name as an argument or a
default (``schedule="1f1b"``) is not a property lookup and is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from solvers.schedules import REGISTRY, SCHEDULES, get_schedule, worker_orders

ROOT = Path(__file__).resolve().parents[1]
REGISTRY_FILE = ROOT / "solvers" / "schedules.py"


def _names_in(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in REGISTRY]


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [n for side in sides for n in _names_in(side) if not isinstance(side, ast.Call)]
            if named:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares with {named}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            named = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in REGISTRY]
            if named:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} lists {named}")
        elif isinstance(node, ast.Dict):
            named = [e.value for e in [*node.keys, *node.values] if isinstance(e, ast.Constant) and e.value in REGISTRY]
            if named:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} maps {named}")
    return found


def test_no_schedule_name_is_compared_outside_the_registry():
    files = [p for folder in ("fxpipe", "solvers") for p in sorted((ROOT / folder).rglob("*.py"))
             if p != REGISTRY_FILE]
    offences = [o for p in files for o in _offences(p)]
    assert not offences, "ask the schedule's record (solvers.schedules.get_schedule) instead:\n" + "\n".join(offences)


def test_the_check_finds_a_comparison(tmp_path):
    """The check is not vacuous: each kind of offence in a scratch file is found."""
    scratch = ROOT / "solvers" / "_scratch_schedule_check.py"
    scratch.write_text('def f(s):\n    a = s == "zb-v"\n    b = s in ("gpipe", "1f1b")\n    c = {"zb-h1": 1}\n'
                       '    return g(schedule="1f1b")\n')
    try:
        found = _offences(scratch)
    finally:
        scratch.unlink()
    assert {o.split(" ", 1)[1] for o in found} == {"compares with ['zb-v']", "compares with ['gpipe', '1f1b']",
                                                    "lists ['gpipe', '1f1b']", "maps ['zb-h1']"}


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_record_is_consistent_with_its_orders(name):
    """What each record says of itself is what its orders do: the placement puts each stage's operations on its
    worker, a split backward runs input-gradient and weight passes and a whole one whole backwards, the one-stage form has one stage a worker, and
    the looser model holds at most as many micro-batches (its plans' feasible set contains this one's)."""
    record = get_schedule(name)
    p, m = 2, 4
    stages = p * record.stages_per_worker(2)
    orders = worker_orders(name, stages, m, p)
    for w, order in enumerate(orders):
        assert {s for _, s, _ in order} == {s for s in range(stages) if record.worker_of(s, p) == w}
    kinds = {kind for order in orders for kind, _, _ in order}
    assert ({"I", "W"} <= kinds) == record.split_backward and kinds <= {"F", "B", "I", "W"}   # split: I and W
    assert not get_schedule(record.one_stage).multi_stage
    assert get_schedule(record.memory_model).memory_model == record.memory_model   # a model of its own
    assert record.workers(stages, p) == p
    if record.looser is not None:
        looser = get_schedule(record.looser)
        assert all(looser.inflight(s, p, m) <= record.inflight(s, p, m) for s in range(p))


def test_an_unknown_schedule_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown schedule 'dualpipe'; expected one of gpipe, 1f1b"):
        get_schedule("dualpipe")
