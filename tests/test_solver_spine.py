"""The heaviest chain's bound (solvers/spine.py): never above the optimum of the reference space (brute force),
and on a chain with side branches of little work (a transformer's shape checks) within their work of it."""

from __future__ import annotations

import random

import pytest

from problems import KINDS, SHAPES, reference_problem, shaped_problem
from solvers import Problem, solve
from solvers.brute import brute_force_reference
from solvers.certificate import compute_lower_bound
from solvers.spine import heaviest_path, spine_lower_bound


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("kind", KINDS + SHAPES)
def test_the_bound_never_exceeds_the_optimum(kind, schedule):
    for seed in range(12):
        rng = random.Random(f"{kind}-{schedule}-{seed}")
        if kind in KINDS:
            problem = reference_problem(rng, kind, rng.randint(3, 6), rng.randint(1, 3), schedule,
                                        tight_memory=rng.random() < 0.5)
        else:
            doc = shaped_problem(rng, kind).to_dict()
            doc["schedule"] = schedule
            problem = Problem.from_dict(doc)
        best = brute_force_reference(problem)
        if best is None:
            continue
        assert spine_lower_bound(problem, 20.0) <= best.iteration_s * (1 + 1e-9), (kind, schedule, seed)


def _chain_with_shape_checks(blocks: int, check_s: float, devices: int = 8) -> Problem:
    """A residual chain of ``blocks`` blocks, each with a side branch of two tiny nodes that end the branch (an
    assert on the input's shape), on ``devices`` devices in boxes of four (fast links inside, slow between)."""
    nodes, edges, prev = [{"id": "in", "fwd_s": 0.0, "bwd_s": 0.0}], [], "in"
    for b in range(blocks):
        ids = [f"b{b}.{part}" for part in ("norm", "mix", "add")]
        nodes += [{"id": ids[0], "fwd_s": 0.1, "bwd_s": 0.2, "act_bytes": 1.0},
                  {"id": ids[1], "fwd_s": 1.0 + 0.1 * (b % 3), "bwd_s": 2.0, "act_bytes": 4.0},
                  {"id": ids[2], "fwd_s": 0.05, "bwd_s": 0.05}]
        edges += [(prev, ids[0], 8.0), (ids[0], ids[1], 8.0), (ids[1], ids[2], 8.0), (prev, ids[2], 8.0)]
        nodes += [{"id": f"b{b}.size", "fwd_s": check_s, "bwd_s": 0.0},
                  {"id": f"b{b}.assert", "fwd_s": check_s, "bwd_s": 0.0}]
        edges += [(prev, f"b{b}.size", 0.0), (f"b{b}.size", f"b{b}.assert", 0.0)]
        prev = ids[2]
    bandwidth = [[0 if i == j else (100.0 if i // 4 == j // 4 else 10.0) for j in range(devices)]
                 for i in range(devices)]
    return Problem.from_dict({
        "format": "fxpipe-problem/1", "micro_batches": 8, "schedule": "1f1b", "stages": None,
        "nodes": nodes, "edges": [{"src": s, "dst": d, "bytes": b} for s, d, b in edges],
        "devices": [{"id": f"g{i}", "memory_bytes": 1e9} for i in range(devices)],
        "links": {"bandwidth_Bps": bandwidth,
                  "latency_s": [[0.0 if i == j else 0.01 for j in range(devices)] for i in range(devices)]}})


def test_shape_checks_beside_a_chain_leave_a_gap_of_their_work_not_of_the_whole_space(monkeypatch):
    """A chain whose side branches end in shape checks (torchvision's ViT) is not contiguous in any one order,
    so the DP's bound holds only over its contiguous stages and the convex phase's closes slowly on 8 devices:
    the certified gap was 14.7 %. The chain without the checks bounds the whole space within their work."""
    problem = _chain_with_shape_checks(blocks=16, check_s=1e-3)
    assert len(heaviest_path(problem)) == 1 + 3 * 16
    bound = spine_lower_bound(problem, 20.0)
    assert bound > compute_lower_bound(problem)
    found = solve(problem, method="auto", time_limit_s=5)
    assert found.solver["lower_bound_s"] >= bound
    assert found.solver["gap"] < 1e-3, found.solver["phases"]
    assert [p["phase"] for p in found.solver["phases"]][:2] == ["dp", "spine"]
    monkeypatch.setattr("solvers.auto.spine_lower_bound", lambda problem, time_limit_s: 0.0)
    without = solve(problem, method="auto", time_limit_s=5)
    assert without.predicted["iteration_s"] == found.predicted["iteration_s"]
    assert without.solver["gap"] > 0.05
