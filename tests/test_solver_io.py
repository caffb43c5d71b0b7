"""Problem validation errors, JSON round trips and the ``python -m solvers`` command line."""

import copy
import json
import subprocess
import sys

import pytest

from solvers import InvalidProblemError, Problem, Solution, score, solve

BASE = {
    "format": "fxpipe-problem/1", "name": "tiny", "micro_batches": 4, "schedule": "1f1b", "stages": None,
    "optimizer_state_factor": 2.0,
    "nodes": [{"id": "a", "fwd_s": 1.0, "bwd_s": 2.0, "param_bytes": 10, "act_bytes": 5},
              {"id": "b", "fwd_s": 1.0, "bwd_s": 2.0, "param_bytes": 10, "act_bytes": 5},
              {"id": "c", "fwd_s": 1.0, "bwd_s": 2.0, "param_bytes": 10, "act_bytes": 5}],
    "edges": [{"src": "a", "dst": "b", "bytes": 100}, {"src": "b", "dst": "c", "bytes": 100}],
    "devices": [{"id": "g0", "memory_bytes": 1000, "speed": 1.0}, {"id": "g1", "memory_bytes": 1000}],
    "links": {"bandwidth_Bps": [[0, 1e3], [1e3, 0]], "latency_s": [[0, 1e-3], [1e-3, 0]]},
}


def broken(mutate):
    doc = copy.deepcopy(BASE)
    mutate(doc)
    return doc


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["edges"].append({"src": "c", "dst": "a", "bytes": 1}), "cycle: a -> b -> c -> a"),
    (lambda d: d["edges"].append({"src": "a", "dst": "zz", "bytes": 1}), "names node 'zz'"),
    (lambda d: d["nodes"][0].pop("fwd_s"), "node 'a': missing field 'fwd_s'"),
    (lambda d: d["nodes"][1].update(bwd_s=-1.0), "node 'b': field 'bwd_s' must be >= 0"),
    (lambda d: d["links"].update(bandwidth_Bps=[[0, 1, 1], [1, 0, 1], [1, 1, 0]]), "is 3x3 but there are 2 devices"),
    (lambda d: d.update(schedule="pipedream"), "unknown schedule 'pipedream'"),
    (lambda d: d.update(format="fxpipe-problem/9"), "this solver reads 'fxpipe-problem/1'"),
    (lambda d: d.pop("devices"), "missing field 'devices'"),
    (lambda d: d.update(stages=5), "stages=5 but it must lie in 1..2"),
    (lambda d: d["nodes"].append({"id": "a", "fwd_s": 0, "bwd_s": 0}), "node id 'a' appears twice"),
    (lambda d: d["links"].update(bandwidth_Bps=[[0, 0], [1e3, 0]]), "devices 0 and 1 cannot talk"),
])
def test_invalid_problems_are_named(mutate, message):
    with pytest.raises(InvalidProblemError) as info:
        Problem.from_dict(broken(mutate))
    assert message in str(info.value)


def test_problem_and_solution_round_trip(tmp_path):
    problem = Problem.from_dict(BASE)
    problem.save(tmp_path / "p.json")
    again = Problem.load(tmp_path / "p.json")
    assert again.to_dict() == problem.to_dict()
    sol = solve(again)
    sol.save(tmp_path / "s.json")
    assert score(again, Solution.load(tmp_path / "s.json")).iteration_s == sol.predicted["iteration_s"]


def test_non_topological_node_order_is_sorted():
    doc = broken(lambda d: d["nodes"].reverse())
    assert Problem.from_dict(doc).order == ["a", "b", "c"]


def test_score_rejects_backward_edges_and_reused_devices():
    problem = Problem.from_dict(BASE)
    backwards = Solution.from_dict({"format": "fxpipe-solution/1", "stages": [
        {"nodes": ["b"], "devices": ["g0"]}, {"nodes": ["a", "c"], "devices": ["g1"]}]})
    with pytest.raises(InvalidProblemError, match="goes backwards"):
        score(problem, backwards)
    reused = Solution.from_dict({"format": "fxpipe-solution/1", "stages": [
        {"nodes": ["a"], "devices": ["g0"]}, {"nodes": ["b", "c"], "devices": ["g0"]}]})
    with pytest.raises(InvalidProblemError, match="used by two stages"):
        score(problem, reused)


def test_reference_score_by_hand():
    # Stages {a, b} on g0 and {c} on g1: one 100-byte transfer, 0.1 s + 1 ms each way.
    problem = Problem.from_dict(BASE)
    sol = Solution.from_dict({"format": "fxpipe-solution/1", "stages": [
        {"nodes": ["a", "b"], "devices": ["g0"]}, {"nodes": ["c"], "devices": ["g1"]}]})
    sc = score(problem, sol)
    comm = 2 * (100 / 1e3 + 1e-3)
    assert sc.stage_s == pytest.approx([6 + comm, 3 + comm])
    assert sc.iteration_s == pytest.approx(sum(sc.stage_s) + 3 * (6 + comm))
    # 1f1b: stage 0 holds min(4, 2 - 0) = 2 micro-batches, stage 1 holds 1.
    assert sc.peak_bytes == pytest.approx([20 * 3 + 10 * 2, 10 * 3 + 5 * 1])


def test_cli_solve_and_score(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(BASE))
    run = lambda *a: subprocess.run([sys.executable, "-m", "solvers", *a], capture_output=True, text=True)  # noqa: E731
    solved = run("solve", str(tmp_path / "p.json"), "-o", str(tmp_path / "s.json"))
    assert solved.returncode == 0, solved.stderr
    scored = run("score", str(tmp_path / "p.json"), str(tmp_path / "s.json"))
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["iteration_s"] == pytest.approx(
        json.loads((tmp_path / "s.json").read_text())["predicted"]["iteration_s"])
    (tmp_path / "bad.json").write_text(json.dumps(broken(lambda d: d["nodes"][0].pop("fwd_s"))))
    bad = run("solve", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "missing field 'fwd_s'" in bad.stderr


def test_infeasible_says_what_memory_would_fit():
    doc = broken(lambda d: [dev.update(memory_bytes=50) for dev in d["devices"]])
    from solvers import InfeasibleError
    with pytest.raises(InfeasibleError) as info:
        solve(Problem.from_dict(doc))
    # Best split {a},{b,c} with 1f1b: stage 0 30 + 5*2 = 40, stage 1 60 + 10*1 = 70 -> 70 bytes.
    assert info.value.min_peak_bytes == pytest.approx(70)
    assert "smallest possible stage peak is 70 bytes" in str(info.value)
