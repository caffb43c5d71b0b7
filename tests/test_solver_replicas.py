"""Replicated stages (format version 2), the hierarchical device order, time limits."""

import json
import math
import random
from pathlib import Path

import pytest

from problems import random_problem
from solvers import InfeasibleError, InvalidProblemError, Problem, Solution, min_peak_bytes, score, solve_dp
from solvers.brute import brute_force_replicated
from solvers.groups import hierarchical_order


def _two_stage_problem(**extra) -> Problem:
    doc = {
        "format": "fxpipe-problem/2", "max_replicas": 3, "micro_batches": 4, "schedule": "gpipe",
        "optimizer_state_factor": 1.0,
        "nodes": [{"id": "a", "fwd_s": 3.0, "bwd_s": 3.0, "param_bytes": 60.0, "act_bytes": 30.0},
                  {"id": "b", "fwd_s": 1.0, "bwd_s": 1.0, "param_bytes": 10.0, "act_bytes": 8.0}],
        "edges": [{"src": "a", "dst": "b", "bytes": 12.0}],
        "devices": [{"id": f"g{i}", "memory_bytes": 1e9, "speed": 1.0} for i in range(4)],
        "links": {"bandwidth_Bps": [[0, 10, 5, 5], [10, 0, 5, 5], [5, 5, 0, 20], [5, 5, 20, 0]],
                  "latency_s": [[0, 0.1, 0.2, 0.2], [0.1, 0, 0.2, 0.2], [0.2, 0.2, 0, 0.05], [0.2, 0.2, 0.05, 0]]},
    }
    doc.update(extra)
    return Problem.from_dict(doc)


def test_replicated_stage_is_scored_by_the_documented_formulas():
    problem = _two_stage_problem()
    sol = Solution.from_dict({"format": "fxpipe-solution/2", "stages": [
        {"nodes": ["a"], "devices": ["g0", "g1", "g2"]}, {"nodes": ["b"], "devices": ["g3"]}]})
    sc = score(problem, sol)
    # stage 0: r = 3, compute 6 / 3 = 2; ring all-reduce of 60 bytes over the slowest in-group
    # link (bandwidth 5, worst latency 0.2): 2 * 2/3 * 60 / 5 + 2 * 2 * 0.2 = 16.8, spread over m = 4.
    # Boundary a -> b: min(3, 1) = 1 piece over the slowest link to g3 (bandwidth 5, latency 0.2):
    # 12 / 5 + 0.2 = 2.6 one way, 5.2 forward and backward, charged to both stages.
    assert sc.allreduce_s == pytest.approx([16.8, 0.0])
    assert sc.stage_s == pytest.approx([2.0 + 5.2 + 16.8 / 4, 2.0 + 5.2])
    assert sc.iteration_s == pytest.approx(sum(sc.stage_s) + 3 * max(sc.stage_s))
    # per device: parameters twice (factor 1) + a third of 4 in-flight micro-batches of activations
    assert sc.peak_bytes == pytest.approx([60 * 2 + 30 * 4 / 3, 10 * 2 + 8 * 4])
    doc = sol.to_dict()
    assert doc["format"] == "fxpipe-solution/2"
    assert Solution.from_dict(json.loads(json.dumps(doc))).stages[0].devices == ["g0", "g1", "g2"]


def test_version_rules_for_replicas():
    with pytest.raises(InvalidProblemError, match="needs format 'fxpipe-problem/2'"):
        _two_stage_problem(format="fxpipe-problem/1")
    with pytest.raises(InvalidProblemError, match="max_replicas must be an integer in 1..4"):
        _two_stage_problem(max_replicas=5)
    one = _two_stage_problem(max_replicas=1)
    assert one.to_dict()["format"] == "fxpipe-problem/1"
    assert _two_stage_problem().to_dict()["format"] == "fxpipe-problem/2"
    assert Problem.from_dict(_two_stage_problem().to_dict()).max_replicas == 3
    too_many = Solution.from_dict({"format": "fxpipe-solution/2", "stages": [
        {"nodes": ["a", "b"], "devices": ["g0", "g1"]}]})
    with pytest.raises(InvalidProblemError, match="allows max_replicas=1"):
        score(one, too_many)
    with pytest.raises(InvalidProblemError, match="one per stage"):
        Solution.from_dict({"format": "fxpipe-solution/1", "stages": [{"nodes": ["a", "b"], "devices": ["g0", "g1"]}]})


def test_hierarchical_order_keeps_fast_clusters_contiguous():
    from fxpipe.planning.topology import link_class_bandwidth, parse_nvidia_smi_topo
    classes = parse_nvidia_smi_topo((Path(__file__).parent / "data" / "titan-v-8gpu-2socket.txt").read_text())
    perm = [5, 0, 7, 2, 4, 1, 6, 3]   # scramble the GPU numbering
    n = 8
    bw = [[0 if i == j else link_class_bandwidth(classes[perm[i]][perm[j]])[0] for j in range(n)] for i in range(n)]
    problem = Problem.from_dict({"format": "fxpipe-problem/1", "nodes": [{"id": "a", "fwd_s": 1, "bwd_s": 1}],
                                 "edges": [], "devices": [{"id": f"d{i}", "memory_bytes": 1} for i in range(n)],
                                 "links": {"bandwidth_Bps": bw}})
    gpu = [perm[d] for d in hierarchical_order(problem)]
    assert [gpu[i] // 2 for i in range(0, 8, 2)] == [gpu[i + 1] // 2 for i in range(0, 8, 2)]  # PIX pairs
    assert {g // 4 for g in gpu[:4]} in ({0}, {1})                                               # sockets


CASES = [(seed, schedule) for seed in range(30) for schedule in ("gpipe", "1f1b")]


@pytest.mark.parametrize("seed,schedule", CASES)
def test_dp_with_replicas_equals_brute_force(seed, schedule):
    rng = random.Random(f"replicas-{seed}-{schedule}")
    base = random_problem(rng, n=rng.randint(2, 6), devices=rng.randint(2, 4), skips=rng.random() < 0.5,
                          schedule=schedule, tight_memory=rng.random() < 0.5)
    doc = base.to_dict()
    doc.update(format="fxpipe-problem/2", max_replicas=rng.randint(2, len(doc["devices"])))
    problem = Problem.from_dict(doc)
    best = brute_force_replicated(problem)
    if best is None:
        with pytest.raises(InfeasibleError) as info:
            solve_dp(problem)
        assert info.value.min_peak_bytes == pytest.approx(min_peak_bytes(problem))
        return
    solution = solve_dp(problem)
    got = score(problem, solution)
    assert got.feasible and solution.solver["space_optimal"] is True
    assert got.iteration_s == pytest.approx(best.iteration_s, rel=1e-9)


def test_replicas_win_when_a_stage_is_compute_bound_and_light():
    """OneFlow's 7:1 shape: a heavy, parameter-light front replicated, a parameter-heavy head alone."""
    nodes = [{"id": f"c{i}", "fwd_s": 1.0, "bwd_s": 2.0, "param_bytes": 1e3, "act_bytes": 1e6} for i in range(7)]
    nodes.append({"id": "fc", "fwd_s": 0.4, "bwd_s": 0.8, "param_bytes": 4e10, "act_bytes": 1e3})
    n = 8
    problem = Problem.from_dict({
        "format": "fxpipe-problem/2", "max_replicas": 8, "micro_batches": 8, "schedule": "1f1b",
        "nodes": nodes, "edges": [{"src": a["id"], "dst": b["id"], "bytes": 1e5} for a, b in zip(nodes, nodes[1:])],
        "devices": [{"id": f"g{i}", "memory_bytes": 64e9} for i in range(n)],
        "links": {"bandwidth_Bps": [[0 if i == j else 1e10 for j in range(n)] for i in range(n)]}})
    sol = solve_dp(problem)
    sizes = [len(s.devices) for s in sol.stages]
    plain = solve_dp(Problem.from_dict({**problem.to_dict(), "format": "fxpipe-problem/1", "max_replicas": 1}))
    assert max(sizes) > 1 and sol.predicted["iteration_s"] < 0.6 * plain.predicted["iteration_s"], sizes
    assert sol.stages[-1].nodes == ["fc"] and sizes[-1] == 1   # 40 GB of parameters: not worth an all-reduce


def test_time_limit_reports_a_proven_lower_bound():
    rng = random.Random(7)
    problem = random_problem(rng, n=40, devices=4, skips=True, schedule="gpipe", tight_memory=False)
    full = solve_dp(problem)
    cut = solve_dp(problem, time_limit_s=0.0)
    assert cut.solver["timed_out"] is True and cut.solver["optimal"] is False
    assert cut.solver["lower_bound_s"] <= full.predicted["iteration_s"] * (1 + 1e-9)
    assert cut.predicted["iteration_s"] >= full.predicted["iteration_s"] * (1 - 1e-9)
    assert math.isclose(cut.solver["gap"], 1 - cut.solver["lower_bound_s"] / cut.predicted["iteration_s"])


@pytest.mark.parametrize("seed", range(10))
def test_placement_relaxation_is_a_lower_bound_per_stage_count(seed):
    from solvers.brute import brute_force_contiguous
    from solvers.dp.bounds import placement_floor as _placement_floor
    rng = random.Random(f"floor-{seed}")
    problem = random_problem(rng, n=6, devices=3, skips=True, schedule="1f1b", tight_memory=False)
    floor = _placement_floor(problem, math.inf, math.inf)
    for p, lb in floor.items():
        fixed = Problem.from_dict({**problem.to_dict(), "stages": p})
        best = brute_force_contiguous(fixed, placement=True)
        assert lb <= best.iteration_s * (1 + 1e-9)


def test_no_anchor_beats_the_dp_even_when_the_time_limit_cuts_it_short():
    from solvers.anchors import ANCHORS, anchor_solution
    rng = random.Random(11)
    problem = random_problem(rng, n=80, devices=6, skips=True, schedule="1f1b", tight_memory=False)
    ours = solve_dp(problem, time_limit_s=0.0)
    for name in ANCHORS:
        if name == "blind":
            continue
        theirs = score(problem, anchor_solution(problem, name))
        if theirs.feasible:
            assert ours.predicted["iteration_s"] <= theirs.iteration_s * (1 + 1e-12), name


@pytest.mark.parametrize("replicas", [2, 4])
def test_at_scale_the_plan_is_never_worse_than_even_replica_groups_with_balanced_cuts(replicas):
    """A 300-node residual chain over two Titan V boxes (16 GPUs), ``max_replicas`` 2 or 4, 2 s: the exact
    search over runs of devices cannot finish, and it used to return one device per stage, 1.8x slower than
    every stage a group of 4 with even cuts. Now such plans seed it and the best cuts for the incumbent's
    groups are searched: the plan is at least as fast as each of them, and uses replicas."""
    from test_solver_certificates import residual_chain
    from solvers.dp.tables import Tables, balanced_cuts
    from solvers.groups import GroupTable
    from solvers.score import score_assignment
    from solvers.solution import assignment_from_cuts

    problem = Problem.from_dict({**residual_chain(300, 2).to_dict(), "format": "fxpipe-problem/2",
                                 "max_replicas": replicas})
    sol = solve_dp(problem, time_limit_s=2.0)
    got = score(problem, sol).iteration_s
    tables, table, order = Tables(problem), GroupTable(problem), hierarchical_order(problem)
    seeds = []
    for r in range(1, replicas + 1):
        for p in range(1, 16 // r + 1):
            groups = [tuple(order[k * r:(k + 1) * r]) for k in range(p)]
            speeds = [table.groups[table.add(g)].speed for g in groups]
            seeds.append(score_assignment(problem, assignment_from_cuts(tables.order, balanced_cuts(tables, p, speeds)),
                                          groups).iteration_s)
    assert got <= min(seeds) * (1 + 1e-12)
    assert min(seeds) < min(seeds[:16]) * 0.8   # replicas pay off here (the first 16: one device per stage)
    assert any(len(stage.devices) > 1 for stage in sol.stages)
