"""Memory caps on contiguous stages (solvers.dp.peaks): the least largest peak equals brute force, a plan within
a cap meets it, and a problem whose balanced plans do not fit still gets a plan at once."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from problems import random_problem
from solvers import Problem, score, solve_dp
from solvers.dp.bounds import min_peak_bytes
from solvers.dp.peaks import fits, least_peak, plan_within
from solvers.dp.tables import stage_counts


def _peak(problem: Problem, bounds: list[int], p: int) -> float:
    nodes, factor = problem.node_map(), 1.0 + problem.optimizer_state_factor
    return max(sum(nodes[v].param_bytes * factor + nodes[v].act_bytes * problem.inflight(k, p)
                   for v in problem.order[bounds[k]:bounds[k + 1]]) for k in range(p))


@pytest.mark.parametrize("seed", range(120))
def test_the_least_peak_and_the_plans_within_a_cap_agree_with_brute_force(seed):
    rng = random.Random(f"peaks-{seed}")
    problem = random_problem(rng, n=rng.randint(2, 9), devices=rng.randint(1, 4), skips=seed % 2 == 0,
                             schedule=rng.choice(["gpipe", "1f1b", "zb-h1", "zb-v"]), tight_memory=True)
    n, best = len(problem.order), math.inf
    for p in stage_counts(problem):
        for cuts in itertools.combinations(range(1, n), p - 1):
            best = min(best, _peak(problem, [0, *cuts, n], p))
    assert least_peak(problem, problem.order, stage_counts(problem)) == pytest.approx(best, rel=1e-9)
    assert min_peak_bytes(problem) == pytest.approx(best, rel=1e-9)
    for p in stage_counts(problem):
        cap = rng.uniform(0.5, 1.5) * best
        exists = any(_peak(problem, [0, *c, n], p) <= cap for c in itertools.combinations(range(1, n), p - 1))
        assert fits(problem, problem.order, p, cap) == exists
        cuts = plan_within(problem, problem.order, p, cap)
        assert (cuts is not None) == exists
        if cuts is not None:
            assert len(cuts) == p - 1 and _peak(problem, [0, *cuts, n], p) <= cap * (1 + 1e-9)


def _tight_chain(n: int = 600, devices: int = 8) -> Problem:
    # 1F1B with 8 micro-batches: stage 0 holds 8 of them, stage 7 one, so an even split does not fit and a
    # plan must give the first stages few nodes
    nodes = [dict(id=f"n{i}", fwd_s=1.0, bwd_s=2.0, param_bytes=0.0, act_bytes=1.0) for i in range(n)]
    edges = [dict(src=f"n{i}", dst=f"n{i + 1}", bytes=1.0) for i in range(n - 1)]
    return Problem.from_dict(dict(
        format="fxpipe-problem/1", micro_batches=8, schedule="1f1b", optimizer_state_factor=0, nodes=nodes,
        edges=edges, devices=[dict(id=f"d{i}", memory_bytes=250.0 * n / 600) for i in range(devices)],
        links=dict(bandwidth_Bps=[[0 if i == j else 100.0 for j in range(devices)] for i in range(devices)],
                   latency_s=[[0.0] * devices for _ in range(devices)])))


def test_a_plan_that_fits_is_found_at_once_when_no_balanced_plan_does():
    problem = _tight_chain()
    even = [0, *[len(problem.order) * k // 8 for k in range(1, 8)], len(problem.order)]
    assert _peak(problem, even, 8) > problem.devices[0].memory_bytes   # the balanced seed does not fit
    got = solve_dp(problem, time_limit_s=0.01)   # no time to search: the seed within the cap is the plan
    assert score(problem, got).feasible


@pytest.mark.parametrize("method", ["dp", "auto"])
def test_a_chain_no_device_can_hold_is_refused_before_any_search(monkeypatch, method):
    """No split of a chain fits even the largest device: the DP says so before its searches, and auto, whose
    DP covers every plan of a chain, raises that proof instead of giving the ILP its time limit (a 1500-node
    chain took the whole 10 s and more, 10.97 s, to say what was known in 0.76 s)."""
    import solvers.auto
    import solvers.dp.search
    import solvers.exact
    import solvers.ilp
    from solvers import InfeasibleError, solve

    def never(*args, **kwargs):
        raise AssertionError("searched a problem whose least stage peak no device holds")

    monkeypatch.setattr(solvers.dp.search.Search, "exact", never)
    monkeypatch.setattr(solvers.auto, "spine_lower_bound", never)
    monkeypatch.setattr(solvers.ilp, "solve_ilp", never)
    monkeypatch.setattr(solvers.exact, "solve_exact", never)
    rng = random.Random("no-room")
    doc = random_problem(rng, 40, 4, True, "1f1b", False).to_dict()
    for d in doc["devices"]:
        d["memory_bytes"] = 30.0
    for v in doc["nodes"]:
        v["param_bytes"] = 40.0   # more than any device holds, each node alone
    problem = Problem.from_dict(doc)
    with pytest.raises(InfeasibleError, match=r"the smallest possible stage peak is .* the largest device has 30 "
                                              r"bytes") as info:
        solve(problem, method, time_limit_s=10.0)
    assert info.value.proven and info.value.min_peak_bytes == pytest.approx(min_peak_bytes(problem), rel=1e-12)
    assert info.value.min_peak_bytes > 30.0


def test_a_plan_not_found_in_time_is_not_called_proven():
    """The timeout's error says the time ran out and carries ``proven = False``, so auto goes on to its other
    phases instead of stopping at it."""
    from solvers import InfeasibleError
    from solvers.dp.search import infeasible_error
    from solvers.dp.tables import Tables

    problem = random_problem(random.Random("in-time"), 8, 3, True, "1f1b", False)
    err = infeasible_error(problem, Tables(problem), complete=False, time_limit_s=0.5, all_placements=True)
    assert isinstance(err, InfeasibleError) and not err.proven and "within the time limit of 0.5 s" in str(err)
