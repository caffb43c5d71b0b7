"""Groups of nodes kept in one stage (solvers.together): on chains the grouped DP is optimal among the plans
that keep every group whole (brute force over every contiguous partition and placement), and on DAGs with
skips its plan keeps the groups whole and is scored on the original problem."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from problems import random_problem
from solvers import InfeasibleError, score_assignment, solve_dp
from solvers.dp.tables import stage_counts
from solvers.solution import assignment_from_cuts
from solvers.together import contract, convex, solve_together


def runs(rng: random.Random, order: list[str]) -> dict[str, list[str]]:
    """Disjoint runs of two to four consecutive nodes of ``order``."""
    groups, i = {}, rng.randrange(2)
    while i < len(order) - 1:
        size = rng.randint(2, 4)
        if rng.random() < 0.7:
            groups[f"g{i}"] = order[i:i + size]
        i += size + rng.randrange(2)
    return groups


def best_keeping(problem, groups) -> float:
    """Brute force: the best iteration time over contiguous partitions that cut no group, any placement."""
    inside = {problem.order.index(m) for ms in groups.values() for m in ms[1:]}    # a cut before m splits
    best = math.inf
    for p in stage_counts(problem):
        for cuts in itertools.combinations([c for c in range(1, len(problem.order)) if c not in inside], p - 1):
            stage_of = assignment_from_cuts(problem.order, cuts)
            for devices in itertools.permutations(range(len(problem.devices)), p):
                sc = score_assignment(problem, stage_of, list(devices))
                if sc.feasible:
                    best = min(best, sc.iteration_s)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_grouped_dp_is_optimal_among_plans_that_keep_groups_whole_on_chains(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, rng.randint(5, 8), 3, skips=False, schedule=rng.choice(["gpipe", "1f1b"]),
                             tight_memory=rng.random() < 0.5)
    groups = runs(rng, problem.order) or {"g": problem.order[1:3]}
    want = best_keeping(problem, groups)
    if not math.isfinite(want):
        with pytest.raises(InfeasibleError):
            solve_together(problem, groups, solve_dp)
        return
    got = solve_together(problem, groups, solve_dp)
    stage_of = {n: k for k, st in enumerate(got.stages) for n in st.nodes}
    assert all(len({stage_of[m] for m in ms}) == 1 for ms in groups.values())
    assert abs(got.predicted["iteration_s"] - want) <= 1e-9 * want
    assert got.solver["covers_reference"] is False and got.predicted["iteration_s"] >= got.solver["lower_bound_s"]


@pytest.mark.parametrize("seed", range(15))
def test_grouped_plan_on_a_dag_keeps_groups_whole_and_is_scored_on_the_original(seed):
    rng = random.Random(100 + seed)
    problem = random_problem(rng, rng.randint(6, 9), 3, skips=True, schedule="1f1b", tight_memory=False)
    groups = runs(rng, problem.order) or {"g": problem.order[1:3]}
    got = solve_together(problem, groups, solve_dp)
    stage_of = {n: k for k, st in enumerate(got.stages) for n in st.nodes}
    assert sorted(stage_of) == sorted(problem.order)
    assert all(len({stage_of[m] for m in ms}) == 1 for ms in groups.values())
    devices = [[d.id for d in problem.devices].index(st.devices[0]) for st in got.stages]
    rescored = score_assignment(problem, stage_of, devices)
    assert got.predicted["iteration_s"] == pytest.approx(rescored.iteration_s, rel=1e-12)
    assert got.predicted["iteration_s"] >= best_keeping(problem, groups) * (1 - 1e-9)


def test_a_group_that_a_path_leaves_and_reenters_is_not_convex():
    rng = random.Random(0)
    problem = random_problem(rng, 5, 2, skips=False, schedule="gpipe", tight_memory=False)
    a, b, c = problem.order[1:4]       # a -> b -> c: {a, c} is not convex
    assert convex(problem, {a, b}) and convex(problem, {a, b, c}) and not convex(problem, {a, c})
    with pytest.raises(Exception, match="cycle"):
        contract(problem, {"ac": [a, c]})
