"""The counts' rising bounds (solvers.dp.deepen): complete, and sound wherever the deadline stops them."""

from __future__ import annotations

import math
import random

import pytest

from problems import random_problem
from solvers.brute import brute_force_contiguous
from solvers.dp.deepen import CountDeepening, deepen_counts
from solvers.dp.labels import Timeout, solve_fixed_p
from solvers.dp.space import Space
from solvers.dp.tables import Tables, stage_counts
from solvers.groups import GroupTable


def _counts(problem, search):
    tables, table = Tables(problem), GroupTable(problem)
    space = Space("order", table, order=list(range(len(problem.devices))))
    return [CountDeepening(problem, tables, p, space, search=search) for p in stage_counts(problem)]


@pytest.mark.parametrize("best_first", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_stopped_anywhere_the_least_open_bound_holds_and_to_the_end_the_optimum_is_found(seed, best_first):
    """Stop the searches after every number of calls: the counts not done never claim more than brute force
    over the same space (stage k on device k) allows; let them run and the incumbent is its optimum."""
    rng = random.Random(f"deepen-{seed}")
    problem = random_problem(rng, rng.randint(3, 7), rng.randint(2, 3), rng.random() < 0.5,
                             rng.choice(["gpipe", "1f1b", "zb-h1"]), rng.random() < 0.3)
    best = brute_force_contiguous(problem)
    truth = best.iteration_s if best is not None else math.inf
    calls = [0]

    def search(*args):
        calls[0] += 1
        return solve_fixed_p(*args)

    counts = _counts(problem, search)
    found: list[float] = []
    ub = deepen_counts(counts, math.inf, math.inf, lambda c, label, t: found.append(t), best_first)
    assert ub == pytest.approx(truth, rel=1e-9) if best is not None else ub == math.inf
    assert found == sorted(found, reverse=True)   # each plan told lowers the incumbent
    for stop_after in range(calls[0]):
        budget = [stop_after]

        def stopping(*args):
            if budget[0] == 0:
                raise Timeout
            budget[0] -= 1
            return solve_fixed_p(*args)

        counts = _counts(problem, stopping)
        told: list[float] = []
        try:
            deepen_counts(counts, math.inf, math.inf, lambda c, label, t: told.append(t), best_first)
        except Timeout:
            proved = min([c.lower for c in counts if not c.done], default=math.inf)
            assert proved <= truth * (1 + 1e-9)
            assert all(t >= truth * (1 - 1e-9) for t in told)


def test_best_first_raises_the_least_bound_first():
    """Best-first, every search runs on a count whose proven bound is the least of the open ones."""
    interleaved = 0
    for seed in range(20):
        rng = random.Random(f"deepen-order-{seed}")
        problem = random_problem(rng, 7, 3, True, "1f1b", False)
        seen: list[tuple[int, float, float]] = []
        counts: list[CountDeepening] = []

        def search(problem_, tables, p, bound, space, deadline):
            mine = next(c for c in counts if c.p == p)
            seen.append((p, mine.lower, min(c.lower for c in counts if not c.done)))
            return solve_fixed_p(problem_, tables, p, bound, space, deadline)

        counts.extend(_counts(problem, search))
        deepen_counts(counts, math.inf, math.inf, lambda c, label, t: None, best_first=True)
        assert all(mine == least for _, mine, least in seen)
        searched = [p for p, _, _ in seen]
        # a count searched again after another one was: the counts went in turns, not one by one
        interleaved += any(q in searched[:i - 1] and q != searched[i - 1] for i, q in enumerate(searched) if i)
    assert interleaved
