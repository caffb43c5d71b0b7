"""The placement search keeps one state per orbit of the topology's automorphisms, and stays exact."""

import itertools
import math
import random
from pathlib import Path

import pytest

from problems import random_problem
from solvers import InfeasibleError, Problem, brute_force_contiguous, score, solve_dp
from solvers.dp.labels import plan_of, solve_fixed_p
from solvers.dp.space import Space
from solvers.dp.symmetry import Canon, automorphisms
from solvers.dp.tables import Tables, device_classes
from solvers.groups import GroupTable
from solvers.score import score_assignment
from solvers.solution import assignment_from_cuts


def is_automorphism(problem: Problem, perm) -> bool:
    n = len(problem.devices)
    bw, lat, devs = problem.bandwidth_Bps, problem.latency_s, problem.devices
    return all((devs[i].speed, devs[i].memory_bytes) == (devs[perm[i]].speed, devs[perm[i]].memory_bytes)
               for i in range(n)) and all(
        bw[i][j] == bw[perm[i]][perm[j]] and lat[i][j] == lat[perm[i]][perm[j]] for i in range(n) for j in range(n))


def boxes_problem(rng: random.Random, pairs: int, n: int) -> Problem:
    """A random chain with skips on ``pairs`` pairs of devices: a fast link inside a pair, a slow one
    across (and a middle one between pairs 0 and 1), so the group is larger than the pair swaps."""
    base = random_problem(rng, n=n, devices=2 * pairs, skips=True, schedule=rng.choice(["gpipe", "1f1b"]),
                          tight_memory=rng.random() < 0.3).to_dict()
    d = 2 * pairs
    fast, mid, slow = rng.choice([(10, 5, 1), (4, 2, 2), (3, 3, 1)])
    link = lambda i, j: fast if i // 2 == j // 2 else (mid if {i // 2, j // 2} == {0, 1} else slow)  # noqa: E731
    base["links"] = dict(bandwidth_Bps=[[0 if i == j else link(i, j) for j in range(d)] for i in range(d)],
                         latency_s=[[0 if i == j else 0.01 / link(i, j) for j in range(d)] for i in range(d)])
    speed, memory = rng.choice([1, 2]), base["devices"][0]["memory_bytes"]
    base["devices"] = [dict(id=f"d{i}", memory_bytes=memory, speed=speed) for i in range(d)]
    return Problem.from_dict(base)


def test_the_titan_box_has_128_automorphisms_and_they_are_all():
    # the box's devices and links as fxpipe models them (PIX/PHB/SYS), from the planner corpus
    problem = Problem.load(Path(__file__).parent.parent / "benchmarks" / "problems" / "resnet101@titan8.json")
    group = automorphisms(problem)
    assert group is not None and len(group) == len(set(group)) == 128
    assert all(is_automorphism(problem, g) for g in group)
    members = set(group)   # a group: closed under composition (so nothing is missing from a subgroup)
    assert all(tuple(a[b[i]] for i in range(8)) in members for a in group[:16] for b in group)
    assert automorphisms(problem, limit=100) is None   # past the limit: not used


@pytest.mark.parametrize("pairs", [2, 3])
def test_automorphisms_are_every_permutation_that_keeps_the_problem(pairs):
    problem = boxes_problem(random.Random(pairs), pairs, n=4)
    brute = [p for p in itertools.permutations(range(2 * pairs)) if is_automorphism(problem, p)]
    assert sorted(automorphisms(problem)) == sorted(brute)


@pytest.mark.parametrize("seed", range(40))
def test_the_search_over_orbits_maps_its_plan_back_to_real_devices(seed):
    """The classes search alone (no incumbent), with the group: its plan, mapped back through the
    automorphisms that canonicalised its states, scores what it said and is the brute-force optimum."""
    rng = random.Random(f"orbits-{seed}")
    pairs = 2 if seed % 3 else 3
    problem = boxes_problem(rng, pairs, n=rng.randint(3, 7 if pairs == 2 else 5))
    p = rng.randint(1, min(len(problem.devices), len(problem.nodes)))
    fixed = Problem.from_dict({**problem.to_dict(), "stages": p})
    assert_orbit_search_is_brute_force_optimal(fixed, p, Canon(automorphisms(fixed)))


def assert_orbit_search_is_brute_force_optimal(fixed: Problem, p: int, canon) -> None:
    """The classes search alone (no incumbent) keeping one state per orbit under ``canon``: its plan, mapped
    back to real devices, is injective, feasible, scores what the search said and equals brute force."""
    space = Space("classes", GroupTable(fixed), classes=device_classes(fixed), canon=canon)
    label, t, _ = solve_fixed_p(fixed, Tables(fixed), p, math.inf, space, math.inf)
    best = brute_force_contiguous(fixed, placement=True)
    if best is None:
        assert label is None
        return
    cuts, devices = plan_of(label)
    sc = score_assignment(fixed, assignment_from_cuts(fixed.order, cuts), devices)
    assert sorted(set(devices)) == sorted(devices) and sc.feasible
    assert sc.iteration_s == pytest.approx(t, rel=1e-9)
    assert t == pytest.approx(best.iteration_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_placement_with_the_group_equals_brute_force(seed):
    rng = random.Random(f"symmetry-{seed}")
    pairs = 2 if seed % 3 else 3
    problem = boxes_problem(rng, pairs, n=rng.randint(3, 7 if pairs == 2 else 5))
    group = automorphisms(problem)
    assert group is not None and len(group) > 2 ** sum(len(c) > 1 for c in device_classes(problem))
    best = brute_force_contiguous(problem, placement=True)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_dp(problem, placement=True)
        return
    sol = solve_dp(problem, placement=True)
    got = score(problem, sol)   # the plan, mapped back to real devices, scores what the search said
    assert got.feasible and got.iteration_s == pytest.approx(best.iteration_s, rel=1e-9)
    assert sol.predicted["iteration_s"] == pytest.approx(got.iteration_s, rel=1e-12)
    assert len({d for s in sol.stages for d in s.devices}) == len(sol.stages)
