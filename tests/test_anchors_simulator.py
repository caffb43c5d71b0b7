"""Anchor partitioners do what their originals do; the simulator agrees with the formula where it must."""

import itertools
import random

import pytest

from problems import random_problem
from solvers import score, solve
from solvers.anchors import ANCHORS, anchor_solution, equal_size_cuts, minmax_cuts, spread_cuts, uniform_cuts
from solvers.compare import compare, geometric_means
from solvers.simulate import simulate, simulate_solution


def parts_of(weights, cuts):
    bounds = [0, *cuts, len(weights)]
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]


def test_uniform_counts():
    assert uniform_cuts([1] * 10, 3) == [4, 7]
    assert uniform_cuts([1] * 4, 4) == [1, 2, 3]


@pytest.mark.parametrize("seed", range(30))
def test_minmax_is_exact(seed):
    rng = random.Random(seed)
    w = [rng.uniform(0, 10) for _ in range(rng.randint(2, 9))]
    k = rng.randint(1, len(w))
    brute = min(max(parts_of(w, list(c))) for c in itertools.combinations(range(1, len(w)), k - 1))
    assert max(parts_of(w, minmax_cuts(w, k))) == pytest.approx(brute)


def test_parameters_spread_and_pippy_fill():
    w = [4, 1, 1, 1, 1, 4]
    assert parts_of(w, spread_cuts(w, 3)) == [4, 4, 4]  # spread 0
    assert equal_size_cuts([1, 1, 1, 1, 1, 1], 3) == [2, 4]
    assert equal_size_cuts([0, 0, 0, 6], 2) == [1]  # half is reached only at the last node: fallback cut


@pytest.mark.parametrize("seed", range(40))
def test_fxpipe_never_worse_than_an_anchor(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, n=rng.randint(4, 12), devices=rng.randint(2, 4), skips=seed % 2 == 0,
                             schedule=rng.choice(["gpipe", "1f1b"]), tight_memory=False)
    best = score(problem, solve(problem)).iteration_s
    for name in ANCHORS:
        sol = anchor_solution(problem, name)
        sc = score(problem, sol)
        assert sc.iteration_s >= best * (1 - 1e-9), name
        assert sol.predicted["iteration_s"] == pytest.approx(sc.iteration_s)


def test_compare_table_and_means():
    rng = random.Random(3)
    problems = [random_problem(rng, 8, 3, True, "1f1b", False) for _ in range(3)]
    rows = compare(problems)
    assert {r.method for r in rows} == {"fxpipe", *ANCHORS}
    means = geometric_means(rows)
    assert means["fxpipe"] == pytest.approx(1.0) and all(v >= 1 - 1e-9 for v in means.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (2, 3), (4, 8), (5, 2)])
def test_simulation_equals_formula_for_equal_stages(schedule, p, m):
    f, b = 1.5, 2.5
    sim = simulate([f] * p, [b] * p, m, schedule)
    assert sim.iteration_s == pytest.approx(p * (f + b) + (m - 1) * (f + b))
    assert sim.busy_s == pytest.approx([m * (f + b)] * p)
    assert all(idle == pytest.approx(sim.iteration_s - m * (f + b)) for idle in sim.idle_s)
    assert len([e for e in sim.timeline if e.kind in "FB"]) == 2 * p * m


def test_simulating_a_solution_counts_transfers():
    rng = random.Random(0)
    problem = random_problem(rng, 8, 3, True, "gpipe", False, mixed_links=False)
    sol = solve(problem)
    sim = simulate_solution(problem, sol)
    sends = [e for e in sim.timeline if e.kind.startswith("send")]
    assert (len(sends) > 0) == (len(sol.stages) > 1)
    assert sim.iteration_s >= max(sim.busy_s)
