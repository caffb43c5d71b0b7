"""The two newer anchors do what their descriptions say, and the DP never ends behind them."""

import itertools
import random

import pytest

from problems import random_problem
from solvers import InfeasibleError, score, solve
from solvers.anchors import anchor_solution
from solvers.cuts import minmax_cuts
from solvers.cuts_scheduled import MEGATRON_FRACTIONS, _scalar_comm_s, _simulated_s, autopartition_cuts, megatron_cuts
from solvers.score import score_assignment
from solvers.solution import assignment_from_cuts


def parts_of(weights, cuts):
    bounds = [0, *cuts, len(weights)]
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(30))
def test_minmax_with_per_part_offsets_is_exact(seed):
    rng = random.Random(seed)
    w = [rng.uniform(0, 10) for _ in range(rng.randint(2, 9))]
    k = rng.randint(1, len(w))
    off = [rng.uniform(0, 5) for _ in range(k)]
    cost = lambda cuts: max(x + o for x, o in zip(parts_of(w, list(cuts)), off))  # noqa: E731
    brute = min(cost(c) for c in itertools.combinations(range(1, len(w)), k - 1))
    assert cost(minmax_cuts(w, k, off)) == pytest.approx(brute)


@pytest.mark.parametrize("seed", range(12))
def test_autopartition_refines_the_min_max_dp_against_the_simulator(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, n=rng.randint(6, 14), devices=rng.randint(2, 4), skips=seed % 2 == 0,
                             schedule=rng.choice(["gpipe", "1f1b"]), tight_memory=False)
    nodes = problem.node_map()
    fwd = [nodes[v].fwd_s for v in problem.order]
    bwd = [nodes[v].bwd_s for v in problem.order]
    p = len(problem.devices)
    comm = _scalar_comm_s(problem)
    start = minmax_cuts([f + b for f, b in zip(fwd, bwd)], p, [comm * ((k > 0) + (k < p - 1)) for k in range(p)])
    cuts = autopartition_cuts(problem, p)
    assert len(cuts) == p - 1 and cuts == sorted(set(cuts)) and 0 < cuts[0] and cuts[-1] < len(fwd)
    t = _simulated_s(fwd, bwd, cuts, comm, problem)
    assert t <= _simulated_s(fwd, bwd, start, comm, problem) * (1 + 1e-12)   # refinement never worsens
    if 2 * (p - 1) * 4 > 60:   # small enough that the simulation budget never binds: a local optimum
        return
    for i in range(len(cuts)):   # and stops at a local optimum of single-node moves
        for step in (-1, 1):
            moved = cuts[:i] + [cuts[i] + step] + cuts[i + 1:]
            if moved == sorted(set(moved)) and 0 < moved[0] and moved[-1] < len(fwd):
                assert _simulated_s(fwd, bwd, moved, comm, problem) >= t * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_megatron_splits_evenly_with_smaller_ends_and_keeps_the_best_pair(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, n=rng.randint(12, 30), devices=4, skips=True, schedule="1f1b",
                             tight_memory=False)
    n, p = len(problem.order), 4
    cuts = megatron_cuts(problem, p)
    sizes = parts_of([1] * n, cuts)
    middle = sizes[1:-1]
    assert max(middle) - min(middle) <= 1   # the middle stages share the rest evenly
    assert sizes[0] <= round(n / p) and sizes[-1] <= round(n / p)   # the ends get no more than even
    t = lambda c: score_assignment(problem, assignment_from_cuts(problem.order, c), list(range(p)))  # noqa: E731
    got = t(cuts).iteration_s
    for ff, fl in itertools.product(MEGATRON_FRACTIONS, repeat=2):   # the best of the pairs tried
        first, last = max(1, round(n / p * ff)), max(1, round(n / p * fl))
        if n - first - last >= p - 2:
            mid = n - first - last
            other = [first, first + (mid + 1) // 2 if mid % 2 else first + mid // 2, n - last]
            sc = t(other)
            if sc.feasible:
                assert got <= sc.iteration_s * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_the_solver_is_never_behind_the_new_anchors(seed):
    rng = random.Random(100 + seed)
    problem = random_problem(rng, n=rng.randint(6, 16), devices=rng.randint(2, 5), skips=seed % 2 == 0,
                             schedule=rng.choice(["gpipe", "1f1b"]), tight_memory=seed % 3 == 0)
    try:
        best = score(problem, solve(problem, "auto")).iteration_s
    except InfeasibleError:   # proven infeasible: then no anchor plan may fit either
        for name in ("pytorch-auto", "megatron"):
            assert not score(problem, anchor_solution(problem, name)).feasible
        return
    for name in ("pytorch-auto", "megatron"):
        sc = score(problem, anchor_solution(problem, name))
        if sc.feasible:
            assert best <= sc.iteration_s * (1 + 1e-9), name


@pytest.mark.parametrize("schedule", ["zb-v"])
def test_autopartition_judges_several_stages_per_worker_by_their_one_stage_form(schedule):
    """A problem of 2p virtual stages (how the planner poses ZB-V plans) is refined too: the
    simulator cannot run the V on one worker per stage, so the anchor scores the one-stage-per-worker form."""
    rng = random.Random(5)
    problem = random_problem(rng, n=12, devices=4, skips=False, schedule=schedule, tight_memory=False)
    cuts = autopartition_cuts(problem, 4)
    assert len(cuts) == 3 and cuts == sorted(set(cuts))
