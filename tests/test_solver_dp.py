"""The contiguous DP is optimal: equal to brute force on random problems."""

import math
import random

import pytest

from problems import random_problem
from solvers import InfeasibleError, brute_force_contiguous, min_peak_bytes, score, solve_dp

CASES = [(seed, schedule, skips, tight)
         for seed in range(40) for schedule in ("gpipe", "1f1b")
         for skips in (False, True) for tight in (False, True)]  # 320 problems


@pytest.mark.parametrize("seed,schedule,skips,tight", CASES)
def test_dp_equals_brute_force(seed, schedule, skips, tight):
    rng = random.Random(f"{seed}-{schedule}-{skips}-{tight}")
    problem = random_problem(rng, n=rng.randint(3, 9), devices=rng.randint(1, 4), skips=skips,
                             schedule=schedule, tight_memory=tight)
    best = brute_force_contiguous(problem)
    if best is None:
        with pytest.raises(InfeasibleError) as info:
            solve_dp(problem)
        assert info.value.min_peak_bytes == pytest.approx(min_peak_bytes(problem))
        assert info.value.min_peak_bytes > min(d.memory_bytes for d in problem.devices)
        return
    solution = solve_dp(problem)
    got = score(problem, solution)  # re-scored independently of the DP's own bookkeeping
    assert got.feasible
    assert got.iteration_s == pytest.approx(best.iteration_s, rel=1e-9)
    assert solution.predicted["iteration_s"] == pytest.approx(got.iteration_s, rel=1e-12)
    assert solution.solver["optimal"] is True


def test_memory_limits_bind_in_the_corpus():
    """The tight-memory cases really exclude partitions (else the memory check is untested)."""
    binding = infeasible = 0
    for seed, schedule, skips, tight in CASES:
        if not tight:
            continue
        rng = random.Random(f"{seed}-{schedule}-{skips}-{tight}")
        problem = random_problem(rng, n=rng.randint(3, 9), devices=rng.randint(1, 4), skips=skips,
                                 schedule=schedule, tight_memory=tight)
        constrained = brute_force_contiguous(problem)
        for d in problem.devices:
            object.__setattr__(d, "memory_bytes", math.inf)
        free = brute_force_contiguous(problem)
        if constrained is None:
            infeasible += 1
        elif constrained.iteration_s > free.iteration_s * (1 + 1e-9):
            binding += 1
    assert binding >= 20 and infeasible >= 5, (binding, infeasible)


def test_skip_connection_is_charged_to_both_ends_only():
    from solvers import Problem
    p = Problem.from_dict({
        "format": "fxpipe-problem/1", "micro_batches": 1, "schedule": "gpipe", "stages": 3,
        "nodes": [{"id": c, "fwd_s": 1.0, "bwd_s": 0.0} for c in "abc"],
        "edges": [{"src": "a", "dst": "b", "bytes": 0}, {"src": "b", "dst": "c", "bytes": 0},
                  {"src": "a", "dst": "c", "bytes": 10}],
        "devices": [{"id": f"d{i}", "memory_bytes": 1} for i in range(3)],
        "links": {"bandwidth_Bps": [[0, 1, 1], [1, 0, 1], [1, 1, 0]], "latency_s": [[0] * 3] * 3},
    })
    sol = solve_dp(p)
    assert [s.nodes for s in sol.stages] == [["a"], ["b"], ["c"]]
    # a -> c: 10 bytes at 1 B/s, forward and backward, on stages 0 and 2 only.
    assert sol.predicted["stage_s"] == pytest.approx([21.0, 1.0, 21.0])
