"""Joint search over micro-batches, schedule and stage count."""

import random

import pytest

from problems import random_problem
from solvers import InvalidProblemError, Problem, score, solve_dp
from solvers.__main__ import main
from solvers.joint import format_trials, joint_search, rescale


def _problem(seed: int) -> Problem:
    """Tight memory for odd seeds, so some combinations are infeasible."""
    rng = random.Random(seed)
    return random_problem(rng, n=8, devices=3, skips=True, schedule="gpipe", tight_memory=seed % 2 == 1)


def test_rescale_is_linear_with_a_fixed_overhead():
    base = Problem.from_dict({
        "format": "fxpipe-problem/1", "micro_batches": 4, "nodes": [
            {"id": "a", "fwd_s": 1.0, "bwd_s": 2.0, "param_bytes": 5.0, "act_bytes": 8.0},
            {"id": "b", "fwd_s": 0.05, "bwd_s": 0.1}],
        "edges": [{"src": "a", "dst": "b", "bytes": 16.0}],
        "devices": [{"id": "d", "memory_bytes": 1e9}], "links": {"bandwidth_Bps": [[0]], "latency_s": [[0]]}})
    assert rescale(base, 4, 0.1).to_dict() == base.to_dict()
    half = rescale(base, 8, 0.1)
    a, b = half.node_map()["a"], half.node_map()["b"]
    assert (a.fwd_s, a.bwd_s, a.param_bytes, a.act_bytes) == pytest.approx((0.1 + 0.45, 0.1 + 0.95, 5.0, 4.0))
    assert (b.fwd_s, b.bwd_s) == pytest.approx((0.05, 0.1))   # all overhead: does not shrink
    assert half.edges[0].bytes == 8.0 and half.micro_batches == 8


@pytest.mark.parametrize("seed", range(12))
def test_joint_search_returns_the_best_trial_and_each_trial_is_the_exact_optimum(seed):
    problem = _problem(seed)
    counts = [1, 2, 4, 6]
    try:
        best, variant, trials = joint_search(problem, counts, ("gpipe", "1f1b"), (None, 2))
    except Exception as exc:  # every combination infeasible: allowed for tight memory, but then say so
        assert seed % 2 == 1 and "fits in memory" in str(exc)
        return
    assert len(trials) == len(counts) * 2 * 2
    assert best.predicted["iteration_s"] == min(t.iteration_s for t in trials)
    assert score(variant, best).iteration_s == pytest.approx(best.predicted["iteration_s"], rel=1e-12)
    for t in trials:
        v = rescale(problem, t.micro_batches)
        v = Problem.from_dict({**v.to_dict(), "schedule": t.schedule, "stages": t.stages})
        try:
            direct = solve_dp(v).predicted["iteration_s"]
        except Exception:
            direct = float("inf")
        assert t.iteration_s == pytest.approx(direct, rel=1e-12)


def test_one_f_one_b_is_chosen_when_gpipe_runs_out_of_memory():
    nodes = [{"id": f"n{i}", "fwd_s": 1.0, "bwd_s": 2.0, "act_bytes": 10.0} for i in range(4)]
    problem = Problem.from_dict({
        "format": "fxpipe-problem/1", "micro_batches": 8, "schedule": "gpipe", "nodes": nodes,
        "edges": [{"src": f"n{i}", "dst": f"n{i + 1}", "bytes": 1.0} for i in range(3)],
        "devices": [{"id": f"d{i}", "memory_bytes": 45.0} for i in range(4)],
        "links": {"bandwidth_Bps": [[0 if i == j else 100.0 for j in range(4)] for i in range(4)]}})
    best, variant, trials = joint_search(problem, [8], ("gpipe", "1f1b"))
    assert variant.schedule == "1f1b"
    gpipe = [t for t in trials if t.schedule == "gpipe"][0]
    assert gpipe.solution is None and "infeasible" in format_trials(trials)


def test_bad_joint_search_arguments_are_named():
    with pytest.raises(InvalidProblemError, match="schedules must be among"):
        joint_search(_problem(0), [2], ("zigzag",))
    with pytest.raises(InvalidProblemError, match="integers >= 1"):
        joint_search(_problem(0), [0])


def test_search_command_prints_the_table(tmp_path, capsys):
    path = tmp_path / "p.json"
    _problem(4).save(path)
    out = tmp_path / "best.json"
    assert main(["search", str(path), "--micro-batches", "2", "4", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "micro-batches  schedule" in text and "best:" in text and out.exists()
