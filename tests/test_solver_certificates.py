"""Certificates mean what shared/problem-format.md says, on every solver path; auto never loses a plan
and is exact over the whole reference space (convex partitions x placements) on small problems."""

import math
import random
import time

import pytest

from certificates import check_certificate, timed
from problems import KINDS, reference_problem
from solvers import InfeasibleError, Problem, score, solve, solve_dp
from solvers.brute import brute_force_reference
from solvers.certificate import compute_lower_bound
from solvers.ilp import solve_ilp
from solvers.joint import joint_search


def parallel_branches() -> Problem:
    """Two parallel branches listed interleaved, three devices (one at half speed), PIX/PHB/SYS-like
    links. The optimum is a convex, non-contiguous partition on a placement the DP does not choose."""
    costs = {"a1": (1, 4), "b1": (2, 1), "a2": (3, 1), "b2": (3, 1)}
    nodes = [{"id": v, "fwd_s": float(costs.get(v, (0, 0))[0]), "bwd_s": float(costs.get(v, (0, 0))[1])}
             for v in ("in", "a1", "b1", "a2", "b2", "out")]
    edges = [("in", "a1", 0), ("in", "b1", 20), ("a1", "a2", 20), ("b1", "b2", 0), ("a2", "out", 0),
             ("b2", "out", 40)]
    return Problem.from_dict({
        "format": "fxpipe-problem/1", "micro_batches": 4, "schedule": "gpipe", "stages": None,
        "nodes": nodes, "edges": [{"src": s, "dst": d, "bytes": b} for s, d, b in edges],
        "devices": [{"id": "g0", "memory_bytes": 1e9}, {"id": "g1", "memory_bytes": 1e9},
                    {"id": "g2", "memory_bytes": 1e9, "speed": 0.5}],
        "links": {"bandwidth_Bps": [[0, 10, 5], [10, 0, 2], [5, 2, 0]], "latency_s": [[0] * 3] * 3}})


@pytest.mark.parametrize("ideals", [True, False])
def test_parallel_branches_are_solved_and_certified_over_convex_partitions_and_placement(monkeypatch, ideals):
    """By the label search over the graph's ideals; without it (too many ideals), by the bound and the
    exact decomposition."""
    import solvers.auto

    if not ideals:
        monkeypatch.setattr(solvers.auto, "convex_lattice", lambda *args: None)
    problem = parallel_branches()
    best = brute_force_reference(problem)
    assert best.iteration_s == pytest.approx(46.0)
    dp, wall = timed(solve_dp, problem)
    check_certificate(problem, dp, wall, best.iteration_s)
    assert dp.predicted["iteration_s"] == pytest.approx(52.0)   # contiguous cuts cannot do better...
    assert dp.solver["optimal"] is False and dp.solver["space_optimal"] is True   # ...and it says so
    assert dp.solver["gap"] > 0
    # Convex cuts on the DP's placement: 47, exact for that placement only (was reported optimal).
    ilp, wall = timed(solve_ilp, problem, warm_start=dp)
    check_certificate(problem, ilp, wall, best.iteration_s)
    assert ilp.predicted["iteration_s"] == pytest.approx(47.0)
    assert ilp.solver["optimal"] is False and ilp.solver["space_optimal"] is True
    auto, wall = timed(solve, problem, "auto")
    check_certificate(problem, auto, wall, best.iteration_s)
    assert auto.predicted["iteration_s"] == pytest.approx(46.0)
    assert auto.solver["optimal"] is True and auto.solver["gap"] == 0.0
    assert [p["phase"] for p in auto.solver["phases"]] == (["dp", "ideals"] if ideals else ["dp", "spine", "exact"])


SOLVER_PATHS = {
    "dp": lambda p: solve(p, "dp"),
    "dp-blind": lambda p: solve_dp(p, placement=False),
    "dp-cut-short": lambda p: solve_dp(p, time_limit_s=0.0),
    "ilp": lambda p: solve(p, "ilp"),
    "ilp-cut-short": lambda p: solve_ilp(p, time_limit_s=1e-3),
    "exact": lambda p: solve(p, "exact"),
    "auto": lambda p: solve(p, "auto"),
    "auto-cut-short": lambda p: solve(p, "auto", time_limit_s=0.0),
    "joint": lambda p: joint_search(p, [1, 2, 4], ["gpipe", "1f1b"])[:2],   # (plan, problem it solves)
}


@pytest.mark.parametrize("path", sorted(SOLVER_PATHS))
@pytest.mark.parametrize("kind", KINDS)
def test_fields_never_contradict_on_any_solver_path(path, kind):
    for seed in range(6):
        rng = random.Random(f"cert-{path}-{kind}-{seed}")
        problem = reference_problem(rng, kind, rng.randint(3, 6), rng.randint(1, 3),
                                    rng.choice(["gpipe", "1f1b"]), rng.random() < 0.5)
        try:
            sol, wall = timed(SOLVER_PATHS[path], problem)
        except InfeasibleError:
            continue
        if isinstance(sol, tuple):
            sol, problem = sol
        best = brute_force_reference(problem)
        check_certificate(problem, sol, wall, best.iteration_s)


def test_compute_lower_bound_holds_for_every_plan():
    for seed in range(40):
        rng = random.Random(f"lb-{seed}")
        problem = reference_problem(rng, rng.choice(KINDS), rng.randint(3, 6), rng.randint(1, 3),
                                    "1f1b", False)
        assert compute_lower_bound(problem) <= brute_force_reference(problem).iteration_s * (1 + 1e-12)


def brute_force_agreement(seeds: range, max_nodes: int, max_devices: int) -> tuple[int, int]:
    """Auto against brute force over the reference space; returns (problems, feasible ones)."""
    total = feasible = 0
    for seed in seeds:
        for kind in KINDS:
            rng = random.Random(f"ref-{seed}-{kind}-{max_nodes}-{max_devices}")
            problem = reference_problem(rng, kind, rng.randint(3, max_nodes), rng.randint(1, max_devices),
                                        rng.choice(["gpipe", "1f1b"]), rng.random() < 0.5)
            best = brute_force_reference(problem)
            total += 1
            if best is None:
                with pytest.raises(InfeasibleError):
                    solve(problem, "auto")
                continue
            feasible += 1
            sol = solve(problem, "auto")
            assert score(problem, sol).iteration_s == pytest.approx(best.iteration_s, rel=1e-7), (seed, kind)
            assert sol.solver["optimal"] is True, (seed, kind, sol.solver)
    return total, feasible


def test_auto_equals_brute_force_over_the_reference_space():
    """320 problems, 80 of each kind, heterogeneous devices and links, memory binding in half."""
    total, feasible = brute_force_agreement(range(80), 6, 3)
    assert total == 320 and feasible >= 240


def test_memory_binds_in_the_brute_force_corpus():
    """Half the problems have memory that excludes plans (else the memory constraints are untested)."""
    binding = 0
    for seed in range(80):
        for kind in KINDS:
            rng = random.Random(f"ref-{seed}-{kind}-6-3")
            problem = reference_problem(rng, kind, rng.randint(3, 6), rng.randint(1, 3),
                                        rng.choice(["gpipe", "1f1b"]), rng.random() < 0.5)
            loose = Problem.from_dict({**problem.to_dict(), "devices": [
                {**d, "memory_bytes": 1e12} for d in problem.to_dict()["devices"]]})
            best, free = brute_force_reference(problem), brute_force_reference(loose)
            binding += best is None or best.iteration_s > free.iteration_s * (1 + 1e-9)
    assert binding >= 40


@pytest.mark.slow
def test_auto_equals_brute_force_on_larger_problems():
    assert brute_force_agreement(range(40), 7, 3)[0] == 160
    assert brute_force_agreement(range(10), 6, 4)[0] == 40


def test_a_phase_that_finds_nothing_leaves_the_dp_plan(monkeypatch):
    """At scale the convex phase can run out of time with nothing: auto keeps the DP's plan and says so."""
    import solvers.auto
    import solvers.exact

    def no_plan(*args, **kwargs):
        raise InfeasibleError("the ILP found no feasible convex partition within its time limit")
    monkeypatch.setattr(solvers.exact, "solve_exact", no_plan)
    monkeypatch.setattr(solvers.auto, "solve_convex", lambda *args, **kwargs: None)   # nothing in its time
    problem = parallel_branches()
    sol, wall = timed(solve, problem, "auto")
    check_certificate(problem, sol, wall, 46.0)
    assert sol.predicted["iteration_s"] == pytest.approx(52.0) and sol.solver["chosen"] == "dp"
    ideals, phase = sol.solver["phases"][1], sol.solver["phases"][-1]
    assert ideals["phase"] == "ideals" and ideals["status"] == "no plan within its time limit"
    assert phase["phase"] == "exact" and phase["status"] == "no plan" and "time limit" in phase["error"]
    assert sol.solver["optimal"] is False and math.isfinite(sol.solver["lower_bound_s"])


def titan_boxes(boxes: int) -> tuple[list[dict], dict]:
    """Devices and links of ``boxes`` 8-GPU Titan V boxes (PIX/PHB/SYS), joined by a network link."""
    from pathlib import Path

    from fxpipe.planning.topology import links_from_classes, parse_nvidia_smi_topo
    titan = parse_nvidia_smi_topo((Path(__file__).parent / "data" / "titan-v-8gpu-2socket.txt").read_text())
    n = 8 * boxes
    classes = [["X" if i == j else titan[i % 8][j % 8] if i // 8 == j // 8 else "NET" for j in range(n)]
               for i in range(n)]
    links = links_from_classes(classes)
    devices = [{"id": f"cuda:{i}", "memory_bytes": 12 * 2**30} for i in range(n)]
    return devices, {"bandwidth_Bps": links.bandwidth_Bps, "latency_s": links.latency_s}


def residual_chain(n: int, boxes: int, branchy: bool = False, seed: int = 0) -> Problem:
    """A residual chain (a skip over every three nodes); ``branchy`` drops the chain edge into every
    skip's target, so that the order is no longer a path and the convex phase has work to do."""
    rng = random.Random(seed)
    devices, links = titan_boxes(boxes)
    nodes = [dict(id=f"n{i}", fwd_s=rng.uniform(1e-4, 1e-3), bwd_s=rng.uniform(2e-4, 2e-3),
                  param_bytes=rng.uniform(0, 4e6), act_bytes=rng.uniform(1e6, 8e6)) for i in range(n)]
    skips = {i + 3: i for i in range(0, n - 3, 3)}
    edges = [dict(src=f"n{i}", dst=f"n{i + 1}", bytes=rng.uniform(1e6, 8e6)) for i in range(n - 1)
             if not (branchy and i + 1 in skips and i % 2)]
    edges += [dict(src=f"n{a}", dst=f"n{b}", bytes=rng.uniform(1e6, 8e6)) for b, a in skips.items()]
    return Problem.from_dict(dict(format="fxpipe-problem/1", name=f"chain{n}x{8 * boxes}", micro_batches=8,
                                  schedule="1f1b", optimizer_state_factor=2.0, nodes=nodes, edges=edges,
                                  devices=devices, links=links))


@pytest.mark.parametrize("quick_bound", [True, False])
def test_auto_keeps_the_dp_plan_when_the_convex_phase_runs_out_of_time(monkeypatch, quick_bound):
    """A stand-in for 3000 x 16 at CI size: a branchy chain on the two boxes, one second per phase.
    The convex phase cannot finish; the plan is never worse than the DP's and the fields agree.
    (2 s for the whole solve: the DP takes half; the heaviest chain's bound may take the rest, since
    too many placements leave the ILP one placement only. With a bound that ends at once, as on a
    short chain, the ILP runs out of time; with this chain's, which does not end, the ILP is skipped.)"""
    import solvers.auto

    if quick_bound:
        monkeypatch.setattr(solvers.auto, "spine_lower_bound", lambda problem, limit: 0.0)
    problem = residual_chain(100, 2, branchy=True)
    sol, wall = timed(solve, problem, "auto", time_limit_s=2.0)
    check_certificate(problem, sol, wall, None)
    found = [p["iteration_s"] for p in sol.solver["phases"] if "iteration_s" in p]
    assert sol.predicted["iteration_s"] == min(found)   # the best plan of any phase, whichever it was
    phases = sol.solver["phases"]
    assert [p["phase"] for p in phases] == ["dp", "spine", "ilp" if quick_bound else "convex"]
    if not quick_bound:
        assert phases[-1]["status"] == "skipped: the time limit of 2.0 s is spent"
    assert sol.solver["covers_reference"] is False and sol.solver["optimal"] is False


@pytest.mark.slow
def test_auto_returns_a_plan_at_3000_nodes_on_16_devices(tmp_path):
    """The issue's case: the command used to exit 3 ("infeasible") after the ILP phase found nothing."""
    import json
    import subprocess
    import sys

    problem = residual_chain(3000, 2)
    problem.save(tmp_path / "p.json")
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "solvers", "solve", str(tmp_path / "p.json")],
                         capture_output=True, text=True)
    wall = time.perf_counter() - started
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)   # stdout is the solution and nothing else
    from solvers import Solution
    check_certificate(problem, Solution.from_dict(doc), wall, None)
    assert doc["solver"]["covers_reference"] is True   # a chain: every convex partition is contiguous


def test_exact_refuses_placements_beyond_its_reach_instead_of_enumerating_them():
    from solvers import SolverError
    with pytest.raises(SolverError, match="more than 5000 placements.*use method 'auto'"):
        solve(residual_chain(20, 2, branchy=True), "exact")


def test_auto_finds_the_convex_plan_when_no_contiguous_one_fits():
    """Parallel branches with binding memory: no contiguous partition fits on any placement (the DP
    proves it), a convex one does. auto used to stop at the DP's InfeasibleError or the ILP's, on the
    DP's placement; it now searches every placement and certifies the plan."""
    rng = random.Random("ref-62-parallel")
    problem = reference_problem(rng, "parallel", rng.randint(4, 6), 3, rng.choice(["gpipe", "1f1b"]),
                                rng.random() < 0.5)
    with pytest.raises(InfeasibleError):
        solve_dp(problem)
    best = brute_force_reference(problem)
    sol, wall = timed(solve, problem, "auto")
    check_certificate(problem, sol, wall, best.iteration_s)
    assert sol.predicted["iteration_s"] == pytest.approx(best.iteration_s, rel=1e-7)
    assert sol.solver["optimal"] is True and sol.solver["phases"][0]["status"] == "no plan"


def test_a_method_whose_space_missed_a_plan_says_so_and_names_the_method_that_searches_it():
    """``solve(method='dp')`` and ``solve(method='ilp')`` search part of the reference space: when no plan of
    that part fits while a plan of the rest does, the error says what was searched and that 'auto' searches
    more (it used to advise adding memory, and the ILP's read "on devices stage s on device s")."""
    rng = random.Random("ref-62-parallel")   # the problem of the test above: only a convex plan fits
    problem = reference_problem(rng, "parallel", rng.randint(4, 6), 3, rng.choice(["gpipe", "1f1b"]),
                                rng.random() < 0.5)
    assert brute_force_reference(problem) is not None
    with pytest.raises(InfeasibleError, match=r"Method 'dp' searches contiguous stages of one topological "
                                              r"order only; .* method 'auto' \(the default\)"):
        solve(problem, "dp")
    # memory only the last device has: stage s on device s cannot fit, a plan on that device does
    fits_last = Problem.from_dict({
        "format": "fxpipe-problem/1", "micro_batches": 2, "schedule": "1f1b", "stages": None,
        "optimizer_state_factor": 0,
        "nodes": [{"id": f"v{i}", "fwd_s": 1.0, "bwd_s": 1.0, "param_bytes": 10.0, "act_bytes": 0.0}
                  for i in range(3)],
        "edges": [{"src": "v0", "dst": "v1", "bytes": 1.0}, {"src": "v1", "dst": "v2", "bytes": 1.0}],
        "devices": [{"id": "a", "memory_bytes": 1.0}, {"id": "b", "memory_bytes": 1.0},
                    {"id": "c", "memory_bytes": 100.0}],
        "links": {"bandwidth_Bps": [[0, 1, 1], [1, 0, 1], [1, 1, 0]], "latency_s": [[0, 0, 0]] * 3}})
    assert solve(fits_last, "auto").stages[0].devices == ["c"]
    with pytest.raises(InfeasibleError, match=r"no convex partition with stage s on device s fits in memory; .*"
                                              r"Method 'ilp' searches that one placement only; .*'exact'"):
        solve(fits_last, "ilp")
    # devices alike: the placement searched is every placement, so the plain message stands
    alike = Problem.from_dict({**fits_last.to_dict(), "devices": [{"id": x, "memory_bytes": 1.0} for x in "abc"]})
    with pytest.raises(InfeasibleError) as info:
        solve(alike, "ilp")
    assert "Method 'ilp'" not in str(info.value)
