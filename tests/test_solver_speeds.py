"""Devices of different speeds: the rest-of-plan bound (solvers.dp.speeds) and the DP that uses it."""

from __future__ import annotations

import random

import pytest

from solvers import InfeasibleError, Problem, brute_force_contiguous, score, solve_dp
from solvers.dp.search import fastest_first
from solvers.dp.speeds import SpeedRest


def _value(work: list[float], speeds: list[float], m: int, slowest_at_least: float) -> float:
    """What a split of the rest's work onto these speeds adds: its sum plus (m - 1) times the plan's max."""
    times = [w / v for w, v in zip(work, speeds)]
    return sum(times) + (m - 1) * max([slowest_at_least, *times])


@pytest.mark.parametrize("seed", range(200))
def test_the_bound_is_below_every_split_and_reached_by_one(seed):
    rng = random.Random(f"speed-rest-{seed}")
    speeds = [rng.choice([0.25, 0.5, 1.0, 1.5, 2.0]) for _ in range(rng.randint(1, 6))]
    m, work = rng.randint(1, 16), rng.uniform(0.1, 10.0)
    slowest_at_least = rng.choice([0.0, rng.uniform(0.0, 2.0 * work / sum(speeds))])
    rest = SpeedRest(speeds, m)
    bound = rest.bound(work, slowest_at_least)
    for _ in range(300):   # random splits of the work, none below the bound
        shares = [rng.random() ** 3 for _ in speeds]
        split = [work * s / sum(shares) for s in shares]
        assert _value(split, speeds, m, slowest_at_least) >= bound * (1 - 1e-12)
    # the bound is a split's value: fill the fastest devices up to the best cap, in order
    best = None
    for cap in [slowest_at_least, *(work / sum(sorted(speeds, reverse=True)[:r]) for r in range(1, len(speeds) + 1))]:
        left, split = work, []
        for v in sorted(speeds, reverse=True):
            split.append(min(left, v * cap))
            left -= split[-1]
        if left <= 1e-12 * work:
            value = _value(split, sorted(speeds, reverse=True), m, slowest_at_least)
            best = value if best is None else min(best, value)
    assert best == pytest.approx(bound, rel=1e-9)


def test_alike_devices_give_the_old_bound():
    rest = SpeedRest([2.0] * 4, micro_batches=8)
    # all the work at speed 2, and the slowest stage at least an even share or the floor given
    assert rest.bound(8.0, 0.0) == pytest.approx(8.0 / 2 + 7 * 8.0 / 8)
    assert rest.bound(8.0, 3.0) == pytest.approx(8.0 / 2 + 7 * 3.0)


def test_a_slow_device_must_take_its_share():
    # 1 unit of work on speeds 1 and 0.5, m = 1: the sum alone counts; all on the fast device is best
    assert SpeedRest([1.0, 0.5], micro_batches=1).bound(1.0, 0.0) == pytest.approx(1.0)
    # m = 3: the max counts twice; the balanced split (2/3 on the fast device) gives 2/3 + 2/3 + 2 x 2/3
    assert SpeedRest([1.0, 0.5], micro_batches=3).bound(1.0, 0.0) == pytest.approx(8 / 3)


def _mixed_problem(rng: random.Random, n: int, devices: int) -> Problem:
    nodes = [dict(id=f"n{i}", fwd_s=rng.uniform(0.1, 1), bwd_s=rng.uniform(0.1, 2),
                  param_bytes=rng.uniform(0, 10), act_bytes=rng.uniform(0, 10)) for i in range(n)]
    edges = [dict(src=f"n{i}", dst=f"n{i + 1}", bytes=rng.uniform(0, 2)) for i in range(n - 1)]
    if rng.random() < 0.5:
        edges += [dict(src=f"n{i}", dst=f"n{i + 2}", bytes=rng.uniform(0, 2)) for i in range(0, n - 2, 2)]
    bw = [[0 if i == j else rng.choice([5, 10, 20]) for j in range(devices)] for i in range(devices)]
    speeds = [1.0, rng.choice([0.25, 0.5])] + [rng.choice([0.25, 0.5, 1.0, 2.0]) for _ in range(devices - 2)]
    rng.shuffle(speeds)
    return Problem.from_dict(dict(
        format="fxpipe-problem/1", micro_batches=rng.randint(4, 16), schedule=rng.choice(["gpipe", "1f1b"]),
        optimizer_state_factor=1, nodes=nodes, edges=edges,
        devices=[dict(id=f"d{i}", memory_bytes=rng.choice([1e9, rng.uniform(30, 80)]), speed=s)
                 for i, s in enumerate(speeds)],
        links=dict(bandwidth_Bps=bw, latency_s=[[0.0] * devices for _ in range(devices)])))


@pytest.mark.parametrize("seed", range(60))
def test_the_dp_equals_brute_force_on_devices_of_different_speeds(seed):
    rng = random.Random(f"mixed-speeds-{seed}")
    problem = _mixed_problem(rng, n=rng.randint(4, 7), devices=rng.randint(2, 4))
    best = brute_force_contiguous(problem, placement=True)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_dp(problem, placement=True)
        return
    got = solve_dp(problem, placement=True)
    assert got.solver["optimal"] is True or got.solver["covers_reference"] is False
    assert score(problem, got).iteration_s == pytest.approx(best.iteration_s, rel=1e-9)


def test_the_fastest_devices_come_first_each_speed_in_hierarchical_order():
    problem = _mixed_problem(random.Random("order"), n=6, devices=4)
    order = fastest_first(problem)
    speeds = [problem.devices[d].speed for d in order]
    assert speeds == sorted(speeds, reverse=True) and sorted(order) == list(range(4))


def test_memory_that_only_some_devices_have_is_named_in_the_error():
    # two stages of 50 bytes each at least (one node of 50 bytes of parameters each), devices of 60 and 40
    problem = Problem.from_dict(dict(
        format="fxpipe-problem/1", micro_batches=1, schedule="gpipe", optimizer_state_factor=0,
        nodes=[dict(id=f"n{i}", fwd_s=1.0, bwd_s=1.0, param_bytes=50.0, act_bytes=0.0) for i in range(2)],
        edges=[dict(src="n0", dst="n1", bytes=1.0)],
        devices=[dict(id="big", memory_bytes=60.0), dict(id="small", memory_bytes=40.0)],
        links=dict(bandwidth_Bps=[[0, 1], [1, 0]], latency_s=[[0, 0], [0, 0]])))
    with pytest.raises(InfeasibleError, match=r"fullest stage needs 50 bytes .*\(memory from 40 to 60 bytes\)"):
        solve_dp(problem)


def test_a_certifying_search_stopped_by_its_share_runs_again_with_the_time_left(monkeypatch):
    """The replica search gets half of what is left; when the searches after it end early it runs again,
    so the solve certifies its space instead of stopping with time unused."""
    import solvers.dp.search as search_module
    problem = Problem.from_dict({**_mixed_problem(random.Random("resume"), n=6, devices=4).to_dict(),
                                 "format": "fxpipe-problem/2", "max_replicas": 2})
    calls: dict[str, int] = {}
    real = search_module.CountDeepening.advance

    def advance(self, ub, deadline):
        calls[self.space.kind] = calls.get(self.space.kind, 0) + 1
        if self.space.kind == "runs" and calls[self.space.kind] == 1:   # the first replica search: its share runs out
            raise search_module.Timeout
        return real(self, ub, deadline)

    monkeypatch.setattr(search_module.CountDeepening, "advance", advance)
    got = solve_dp(problem, time_limit_s=60.0)
    assert calls["runs"] > 1 and got.solver["space_optimal"] is True
    monkeypatch.setattr(search_module.CountDeepening, "advance", real)
    assert score(problem, got).iteration_s == pytest.approx(score(problem, solve_dp(problem)).iteration_s, rel=1e-9)
