"""The tree of link classes, its canonical states, and the bounds that make the label search fast, stay exact."""

import itertools
import random
from pathlib import Path

import pytest

from problems import random_problem
from solvers import Problem
from solvers.dp.hierarchy import TreeCanon, link_tree
from solvers.dp.search import orbit_canon
from solvers.dp.symmetry import automorphisms
from solvers.dp.tables import Tables, device_classes
from solvers.score import score_assignment
from solvers.solution import assignment_from_cuts
from test_solver_symmetry import assert_orbit_search_is_brute_force_optimal, boxes_problem, is_automorphism

PROBLEMS = Path(__file__).parent.parent / "benchmarks" / "problems"


def boxes_of_pairs(rng: random.Random, boxes: int, n: int) -> Problem:
    """A random chain with skips on ``boxes`` boxes of two pairs: three link classes and a network."""
    d = 4 * boxes
    base = random_problem(rng, n=n, devices=d, skips=True, schedule=rng.choice(["gpipe", "1f1b"]),
                          tight_memory=rng.random() < 0.3).to_dict()
    pix, pxb, net = rng.choice([(10, 5, 2), (4, 2, 3), (3, 3, 1)])
    link = lambda i, j: pix if i // 2 == j // 2 else (pxb if i // 4 == j // 4 else net)  # noqa: E731
    base["links"] = dict(bandwidth_Bps=[[0 if i == j else link(i, j) for j in range(d)] for i in range(d)],
                         latency_s=[[0 if i == j else 0.01 / link(i, j) for j in range(d)] for i in range(d)])
    memory = base["devices"][0]["memory_bytes"]
    base["devices"] = [dict(id=f"d{i}", memory_bytes=memory, speed=1) for i in range(d)]
    return Problem.from_dict(base)


def test_two_titan_boxes_form_a_tree_with_32768_symmetries():
    problem = Problem.load(PROBLEMS / "scale" / "chain3000@titan16x2.json")
    tree = link_tree(problem)
    assert tree is not None and tree.symmetries() == 128 * 128 * 2
    assert automorphisms(problem) is None   # the group itself is past its limit: only the tree serves
    assert isinstance(orbit_canon(problem, device_classes(problem)), TreeCanon)
    boxes = [sorted(c.leaves()) for c in tree.children]
    assert boxes == [list(range(8)), list(range(8, 16))]


def test_links_that_are_no_hierarchy_have_no_tree():
    problem = random_problem(random.Random(3), n=4, devices=4, skips=False, schedule="gpipe", tight_memory=False)
    doc = problem.to_dict()
    # a ring: 0-1 and 2-3 fast, 1-2 and 3-0 middle, the diagonals slow: no value splits the devices
    ring = {frozenset(p): v for p, v in [((0, 1), 5), ((2, 3), 5), ((1, 2), 3), ((0, 3), 3), ((0, 2), 1), ((1, 3), 1)]}
    doc["links"]["bandwidth_Bps"] = [[0 if i == j else ring[frozenset((i, j))] for j in range(4)] for i in range(4)]
    doc["links"]["latency_s"] = [[0] * 4 for _ in range(4)]
    assert link_tree(Problem.from_dict(doc)) is None
    doc["links"]["bandwidth_Bps"][0][1] = 4   # not the same both ways
    assert link_tree(Problem.from_dict(doc)) is None


@pytest.mark.parametrize("seed", range(10))
def test_states_of_one_orbit_get_one_image_through_an_automorphism(seed):
    """On the Titan V box (its 128 automorphisms known), every image of a state under the group has the same
    canonical form, and the permutation returned is an automorphism that maps the state onto it."""
    problem = Problem.load(PROBLEMS / "resnet101@titan8.json")
    canon, group = TreeCanon(link_tree(problem)), automorphisms(problem)
    rng = random.Random(seed)
    used_devices = rng.sample(range(8), rng.randint(1, 8))
    used = sum(1 << d for d in used_devices)
    pending = tuple((u, rng.randrange(3), rng.choice(used_devices)) for u in sorted(rng.sample(range(20), 3)))
    key, perm = canon.canonical(used, pending)
    assert is_automorphism(problem, perm)
    assert key == (sum(1 << perm[d] for d in used_devices), tuple((u, a, perm[d]) for u, a, d in pending))
    for g in group:
        image = (sum(1 << g[d] for d in used_devices), tuple((u, a, g[d]) for u, a, d in pending))
        assert canon.canonical(*image)[0] == key
    # and states of another orbit get another form
    other_devices = rng.sample(range(8), rng.randint(1, 8))
    other = (sum(1 << d for d in other_devices), tuple((u, a, rng.choice(other_devices)) for u, a, _ in pending))
    orbit = {(sum(1 << g[d] for d in used_devices), tuple((u, a, g[d]) for u, a, d in pending)) for g in group}
    assert (canon.canonical(*other)[0] == key) == (other in orbit)


@pytest.mark.parametrize("seed", range(24))
def test_the_search_over_tree_orbits_equals_brute_force(seed):
    """The classes search alone (no incumbent) with the tree's canonical states: its plan, mapped back to
    real devices, scores what it said and is the brute-force optimum over cuts and placements."""
    rng = random.Random(f"tree-{seed}")
    problem = (boxes_of_pairs(rng, 2, n=rng.randint(3, 5)) if seed % 2
               else boxes_problem(rng, 3, n=rng.randint(3, 5)))
    p = rng.randint(1, min(len(problem.devices), len(problem.nodes)))
    fixed = Problem.from_dict({**problem.to_dict(), "stages": p})
    tree = link_tree(fixed)
    assert tree is not None
    assert_orbit_search_is_brute_force_optimal(fixed, p, TreeCanon(tree))


@pytest.mark.parametrize("seed", range(30))
def test_the_suffix_bottleneck_bounds_every_plans_later_stages(seed):
    """``suffix_bottleneck`` prunes labels: it must never exceed the slowest of the stages after a cut, for
    any cuts and any placement (heterogeneous speeds and links, skips)."""
    rng = random.Random(f"bottleneck-{seed}")
    problem = random_problem(rng, n=rng.randint(3, 7), devices=rng.randint(2, 4), skips=True,
                             schedule="1f1b", tight_memory=False)
    tables = Tables(problem)
    n, d = tables.n, len(problem.devices)
    fastest = max(dev.speed for dev in problem.devices)
    bound = tables.suffix_bottleneck(fastest, d - 1)
    checked = 0
    for p in range(2, min(d, n) + 1):
        for cuts in itertools.combinations(range(1, n), p - 1):
            stage_of = assignment_from_cuts(problem.order, cuts)
            for devices in itertools.permutations(range(d), p):
                stage_s = score_assignment(problem, stage_of, list(devices)).stage_s
                for k, cut in enumerate(cuts):
                    assert bound[p - 1 - k][cut] <= max(stage_s[k + 1:]) * (1 + 1e-12)
                    checked += 1
    assert checked > 0
    # and it is no weaker than the average compute it replaces
    for s in range(1, d):
        for j in range(n - s + 1):
            assert bound[s][j] >= tables.suffix_fb[j] / fastest / s * (1 - 1e-12)
