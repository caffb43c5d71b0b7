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
            solve_dp(problem, placement=False)
        assert info.value.min_peak_bytes == pytest.approx(min_peak_bytes(problem))
        assert info.value.min_peak_bytes > min(d.memory_bytes for d in problem.devices)
        return
    solution = solve_dp(problem, placement=False)
    got = score(problem, solution)  # re-scored independently of the DP's own bookkeeping
    assert got.feasible
    assert got.iteration_s == pytest.approx(best.iteration_s, rel=1e-9)
    assert solution.predicted["iteration_s"] == pytest.approx(got.iteration_s, rel=1e-12)
    assert solution.solver["space_optimal"] is True   # exact over its space; "optimal" needs the whole space


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


@pytest.mark.parametrize("seed", range(120))
def test_placement_dp_equals_brute_force_over_device_mappings(seed):
    rng = random.Random(f"placement-{seed}")
    problem = random_problem(rng, n=rng.randint(3, 7), devices=rng.randint(2, 4), skips=seed % 2 == 0,
                             schedule=rng.choice(["gpipe", "1f1b"]), tight_memory=seed % 3 == 0)
    best = brute_force_contiguous(problem, placement=True)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_dp(problem, placement=True)
        return
    got = score(problem, solve_dp(problem, placement=True))
    assert got.feasible and got.iteration_s == pytest.approx(best.iteration_s, rel=1e-9)
    blind = brute_force_contiguous(problem, placement=False)
    assert blind is None or got.iteration_s <= blind.iteration_s * (1 + 1e-9)


def test_placement_puts_the_heavy_boundary_on_the_fast_link():
    from pathlib import Path

    from fxpipe.planning.topology import link_class_bandwidth, parse_nvidia_smi_topo
    from solvers import Problem
    from solvers.dp import device_classes
    classes = parse_nvidia_smi_topo((Path(__file__).parent / "data" / "titan-v-8gpu-2socket.txt").read_text())
    bw = [[0 if i == j else link_class_bandwidth(classes[i][j])[0] for j in range(8)] for i in range(8)]
    # Two equal halves joined by a 1 GB tensor: only a PIX pair carries it in 0.08 s.
    problem = Problem.from_dict({
        "format": "fxpipe-problem/1", "micro_batches": 4, "schedule": "gpipe", "stages": 2,
        "nodes": [{"id": "a", "fwd_s": 1.0, "bwd_s": 1.0}, {"id": "b", "fwd_s": 1.0, "bwd_s": 1.0}],
        "edges": [{"src": "a", "dst": "b", "bytes": 1e9}],
        "devices": [{"id": f"gpu{i}", "memory_bytes": 1e10} for i in range(8)],
        "links": {"bandwidth_Bps": bw, "latency_s": [[0.0] * 8 for _ in range(8)]},
    })
    assert device_classes(problem) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    sol = solve_dp(problem)
    pair = {int(s.devices[0][3:]) for s in sol.stages}
    assert classes[min(pair)][max(pair)] == "PIX"
