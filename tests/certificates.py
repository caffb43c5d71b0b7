"""What the solver tests check of every solution's ``solver`` fields: the invariants of shared/problem-format.md."""

from __future__ import annotations

import time

import pytest

from solvers import Problem, score

__all__ = ["check_certificate", "timed"]


def check_certificate(problem: Problem, sol, wall_s: float, best_t: float | None) -> None:
    """The invariants of shared/problem-format.md's solver fields."""
    s = sol.solver
    t = score(problem, sol).iteration_s
    assert sol.predicted["iteration_s"] == pytest.approx(t, rel=1e-12)
    lb, gap = s["lower_bound_s"], s["gap"]
    assert 0.0 <= lb <= t
    assert gap == pytest.approx((t - lb) / t if t > 0 else 0.0, abs=1e-12)   # a plan of free nodes: T = 0
    assert s["optimal"] == (lb == t) and (not s["optimal"] or gap == 0.0)
    assert isinstance(s["exact_over"], str) and s["exact_over"] and isinstance(s["space_optimal"], bool)
    assert 0.0 <= s["time_s"] <= wall_s
    assert s["time_s"] >= sum(p["time_s"] for p in s.get("phases", []))
    if best_t is not None:   # the bound holds over the whole reference space; "optimal" is true
        assert lb <= best_t * (1 + 1e-9)
        assert not s["optimal"] or t == pytest.approx(best_t, rel=1e-7)


def timed(fn, *args, **kwargs):
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - started
