"""The label search over chains of ideals (solvers.dp.ideals, solvers.dp.convex): its lattice holds every
ideal once, its plans equal brute force over the whole reference space, and its certificates hold when
its time runs out."""

import itertools
import math
import random

import networkx as nx
import pytest

from certificates import check_certificate, timed
from problems import KINDS, SHAPES, reference_problem, shaped_problem
from solvers.problem import SCHEDULES
from solvers import InfeasibleError, Problem, score, solve, solve_dp
from solvers.brute import brute_force_reference
from solvers.dp.convex import convex_lattice, solve_convex
from solvers.dp.lattice import Lattice
from solvers.dp.tables import Tables


def problems(seeds: range, max_nodes: int, max_devices: int):
    for seed in seeds:
        for kind in KINDS:
            rng = random.Random(f"ideals-{seed}-{kind}")
            yield f"{seed}-{kind}", reference_problem(rng, kind, rng.randint(3, max_nodes),
                                                     rng.randint(1, max_devices), rng.choice(SCHEDULES),
                                                     rng.random() < 0.5)
        for shape in SHAPES:   # several sources or sinks, dense, free nodes, diamonds, fixed stage counts
            yield f"{seed}-{shape}", shaped_problem(random.Random(f"ideals-{seed}-{shape}"), shape)


def down_sets(problem: Problem) -> set[frozenset[str]]:
    """Every set of nodes closed under predecessors, by trying every subset."""
    preds = {v: {e.src for e in problem.edges if e.dst == v} for v in problem.order}
    return {frozenset(s) for r in range(len(problem.order) + 1) for s in itertools.combinations(problem.order, r)
            if all(preds[v] <= set(s) for v in s)}


@pytest.mark.parametrize("seed", range(10))
def test_the_lattice_holds_every_ideal_once_each_after_its_subsets(seed):
    for name, problem in problems(range(seed, seed + 1), 8, 1):
        tables = Tables(problem)
        lattice = Lattice.build(tables)
        got = [frozenset(tables.order[x] for x in Lattice.members(mask)) for mask in lattice.ideals]
        assert len(got) == len(set(got)), name
        assert set(got) == down_sets(problem), name
        graph = nx.DiGraph([(e.src, e.dst) for e in problem.edges])
        graph.add_nodes_from(problem.order)
        assert len(got) == sum(1 for _ in nx.antichains(graph)), name   # ideals biject with antichains
        for i, j in itertools.combinations(range(len(got)), 2):   # i < j: never a superset of j
            assert not got[i] > got[j], name


def test_the_lattice_refuses_a_graph_with_more_ideals_than_its_limit():
    """Ten parallel pairs have 3^10 ideals: the enumeration stops at the limit instead of listing them."""
    nodes = [dict(id=f"{b}{i}", fwd_s=1.0, bwd_s=1.0) for i in range(10) for b in "ab"]
    edges = [dict(src=f"a{i}", dst=f"b{i}", bytes=1.0) for i in range(10)]
    problem = Problem.from_dict(dict(format="fxpipe-problem/1", micro_batches=2, schedule="1f1b", nodes=nodes,
                                     edges=edges, devices=[dict(id="d0", memory_bytes=1e9)],
                                     links=dict(bandwidth_Bps=[[0]], latency_s=[[0]])))
    assert convex_lattice(problem, limit=1000) is None
    assert len(convex_lattice(problem, limit=3 ** 10).ideals) == 3 ** 10


@pytest.mark.parametrize("seed", range(20))
def test_the_search_equals_brute_force_over_the_reference_space(seed):
    """From no incumbent (the deepening bounds) and from the DP's contiguous plan (one search under it);
    720 problems of nine kinds, every schedule's memory model."""
    for name, problem in problems(range(seed * 4, seed * 4 + 4), 6, 3):
        best = brute_force_reference(problem)
        sol, wall = timed(solve_convex, problem, 60.0)
        if best is None:
            assert sol is None, name
            continue
        check_certificate(problem, sol, wall, best.iteration_s)
        assert score(problem, sol).iteration_s == pytest.approx(best.iteration_s, rel=1e-7), name
        assert sol.solver["optimal"] is True and sol.solver["covers_reference"] is True, name
        try:
            dp = solve_dp(problem)
        except InfeasibleError:
            continue
        for prove in (False, True):
            sol, wall = timed(solve_convex, problem, 60.0, dp, prove=prove)
            check_certificate(problem, sol, wall, best.iteration_s)
            assert sol.predicted["iteration_s"] == pytest.approx(best.iteration_s, rel=1e-7), name
            assert sol.solver["optimal"] is True, name


def test_out_of_time_it_keeps_the_incumbent_and_proves_only_what_holds():
    rng = random.Random("ideals-timeout")
    problem = reference_problem(rng, "branch", 7, 3, "1f1b", False)
    dp = solve_dp(problem)
    sol, wall = timed(solve_convex, problem, 0.0, dp)
    check_certificate(problem, sol, wall, brute_force_reference(problem).iteration_s)
    assert sol.predicted["iteration_s"] == pytest.approx(dp.predicted["iteration_s"])
    assert sol.solver["space_optimal"] is False or sol.solver["optimal"] is True
    assert solve_convex(problem, 0.0) is None   # no incumbent and no time: nothing, not a wrong plan


def test_auto_certifies_a_residual_network_whose_branches_no_one_order_splits():
    """ResNet's shape in small: blocks whose downsample branch runs beside three convolutions, on the
    8-GPU Titan V box. Contiguous cuts of the traced order cannot put a branch where the best plan has it;
    auto's search over the ideals finds the optimum over every convex partition and placement."""
    from test_solver_certificates import titan_boxes

    rng = random.Random(7)
    devices, links = titan_boxes(1)
    nodes, edges, last = [dict(id="in", fwd_s=1e-4, bwd_s=1e-4, act_bytes=1e6)], [], "in"
    for b in range(12):
        ids = [f"b{b}c{i}" for i in range(3)] + [f"b{b}down", f"b{b}add"]
        for v in ids:
            nodes.append(dict(id=v, fwd_s=rng.uniform(2e-4, 2e-3), bwd_s=rng.uniform(4e-4, 4e-3),
                              param_bytes=rng.uniform(0, 4e6), act_bytes=rng.uniform(1e6, 8e6)))
        chain = [last] + ids[:3] + [ids[4]]
        edges += [dict(src=a, dst=c, bytes=rng.uniform(1e6, 8e6)) for a, c in zip(chain, chain[1:])]
        edges += [dict(src=last, dst=ids[3], bytes=rng.uniform(1e6, 8e6)),
                  dict(src=ids[3], dst=ids[4], bytes=rng.uniform(1e6, 8e6))]
        last = ids[4]
    problem = Problem.from_dict(dict(format="fxpipe-problem/1", micro_batches=8, schedule="1f1b",
                                     optimizer_state_factor=2.0, nodes=nodes, edges=edges, devices=devices,
                                     links=links))
    sol, wall = timed(solve, problem, "auto", time_limit_s=60.0)
    check_certificate(problem, sol, wall, None)
    phases = [p["phase"] for p in sol.solver["phases"]]
    assert phases == ["dp", "ideals"] and sol.solver["optimal"] is True
    assert math.isfinite(sol.solver["lower_bound_s"])


def test_auto_leaves_the_search_out_when_a_better_plan_would_need_too_many_stages(monkeypatch):
    """GPT-2's 3 181 ideals give 3.7 million stages under its DP plan's cap: the search would take the
    whole limit and finish nothing, where the exact decomposition certifies. Here the cap is lowered."""
    import solvers.dp.convex

    rng = random.Random("ideals-steps")
    problem = reference_problem(rng, "parallel", 7, 3, "1f1b", False)
    dp = solve_dp(problem)
    lattice = convex_lattice(problem, dp.predicted["iteration_s"])
    steps = lattice.count_steps(dp.predicted["iteration_s"] / problem.micro_batches
                                * max(d.speed for d in problem.devices), 10 ** 6)
    assert steps > 3
    monkeypatch.setattr(solvers.dp.convex, "MAX_STEPS", steps - 1)
    assert convex_lattice(problem, dp.predicted["iteration_s"]) is None
    assert convex_lattice(problem) is not None   # with no plan to beat, nothing to count under
    sol = solve(problem, "auto")
    assert "ideals" not in [p["phase"] for p in sol.solver["phases"]]
    assert sol.solver["optimal"] is True   # the exact decomposition still certifies it
    monkeypatch.setattr(solvers.dp.convex, "MAX_STEPS", steps)
    assert [p["phase"] for p in solve(problem, "auto").solver["phases"]] == ["dp", "ideals"]


def test_a_stage_count_that_takes_all_its_time_does_not_starve_the_larger_ones(monkeypatch):
    """Counts are searched smallest first, each with half of what is left of the first pass: one that never
    ends (here 2, made to run out its time) leaves the others theirs, and is tried again at the end."""
    import time as clock

    import solvers.dp.convex

    real = solvers.dp.convex.solve_ideals_p
    calls: list[tuple[int, float]] = []

    def stuck_at_two(problem, tables, lattice, p, ub, space, deadline):
        calls.append((p, deadline - clock.perf_counter()))
        if p == 2:
            clock.sleep(max(0.0, deadline - clock.perf_counter()))
            raise solvers.dp.convex.Timeout
        return real(problem, tables, lattice, p, ub, space, deadline)
    monkeypatch.setattr(solvers.dp.convex, "solve_ideals_p", stuck_at_two)
    rng = random.Random("ideals-starve-2")   # free stage count (some seeds fix it)
    problem = reference_problem(rng, "branch", 6, 3, "1f1b", False)
    dp = solve_dp(problem)
    sol, wall = timed(solve_convex, problem, 1.0, dp)
    check_certificate(problem, sol, wall, brute_force_reference(problem).iteration_s)
    assert [p for p, _ in calls] == [1, 2, 3, 2]   # 3 after 2 ran out of its share; 2 again at the end
    assert calls[1][1] == pytest.approx(0.7 / 2, abs=0.05)   # half of the first pass (70 % of the limit)
    assert calls[2][1] == pytest.approx(0.7 / 2, abs=0.05)   # the last count: the rest of the first pass
    assert calls[3][1] > 0.25   # the second pass: all that is left (at least the 30 % past the first)
    assert sol.predicted["iteration_s"] <= dp.predicted["iteration_s"]
    # whether 2 stages could still win is only known from the compute bound: certified only if it says not
    two = solvers.dp.convex.analytic_lower(problem, Tables(problem), 2, solvers.dp.convex.Space(
        "classes", solvers.dp.convex.GroupTable(problem), classes=solvers.dp.convex.device_classes(problem)))
    assert sol.solver["optimal"] is (two >= sol.predicted["iteration_s"] * (1 - 1e-7))


def test_proving_searches_a_count_cut_short_under_rising_bounds_and_still_finds_the_optimum(monkeypatch):
    """``prove``: the second pass deepens (bounds rising from below, each a proof when it fails) instead of
    one search under the incumbent; it still ends at the optimum over the whole reference space."""
    import time as clock

    import solvers.dp.convex

    real = solvers.dp.convex.solve_ideals_p
    bounds: list[tuple[int, float]] = []

    def first_two_hangs(problem, tables, lattice, p, ub, space, deadline):
        bounds.append((p, ub))
        if p == 2 and len([q for q, _ in bounds if q == 2]) == 1:
            clock.sleep(max(0.0, deadline - clock.perf_counter()))
            raise solvers.dp.convex.Timeout
        return real(problem, tables, lattice, p, ub, space, deadline)
    monkeypatch.setattr(solvers.dp.convex, "solve_ideals_p", first_two_hangs)
    rng = random.Random("ideals-starve-19")   # its best plan has 2 stages
    problem = reference_problem(rng, "branch", 6, 3, "1f1b", False)
    best = brute_force_reference(problem)
    dp = solve_dp(problem)
    sol, wall = timed(solve_convex, problem, 1.0, dp, prove=True)
    check_certificate(problem, sol, wall, best.iteration_s)
    assert sol.predicted["iteration_s"] == pytest.approx(best.iteration_s, rel=1e-7)
    assert sol.solver["optimal"] is True
    again = [ub for p, ub in bounds if p == 2][1:]
    assert again and again == sorted(again) and again[0] < dp.predicted["iteration_s"]   # rising, from below
