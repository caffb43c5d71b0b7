"""The schedule search's lower bound (solvers.schedule_search.lower_bound) against the simulator it bounds: on random
stage times, speeds, transfers and weight shares, no simulated iteration of any schedule is faster than the bound,
and the bound is reached where the work can be split as it assumes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers.schedule_search import Candidate, Trial, lower_bound, search
from solvers.schedules import SCHEDULES, check_schedule, stage_worker, stages_per_worker
from solvers.simulate import simulate

times = st.floats(0.0, 5.0, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), workers=st.integers(1, 4), micro_batches=st.integers(1, 8),
       data=st.data())
def test_no_simulated_iteration_is_faster_than_the_bound(schedule, workers, micro_batches, data):
    stages = stages_per_worker(schedule) * workers
    try:
        check_schedule(schedule, stages, workers, micro_batches)
    except ValueError:
        return
    work_f = data.draw(st.lists(times, min_size=stages, max_size=stages))
    work_b = data.draw(st.lists(times, min_size=stages, max_size=stages))
    speeds = data.draw(st.lists(st.floats(0.25, 4.0), min_size=workers, max_size=workers))
    share = data.draw(st.floats(0.0, 0.5))
    owner = [stage_worker(schedule, s, workers) for s in range(stages)]
    fwd = [f / speeds[owner[s]] for s, f in enumerate(work_f)]
    bwd = [b / speeds[owner[s]] for s, b in enumerate(work_b)]
    sends = {(s, s + 1): data.draw(st.floats(0.0, 1.0)) for s in range(stages - 1)}
    simulated = simulate(fwd, bwd, micro_batches, schedule, sends, workers=workers, weight_share=share).iteration_s
    bound = lower_bound(schedule, micro_batches, sum(work_f), sum(work_b), speeds)
    assert bound <= simulated * (1 + 1e-9) + 1e-12


def test_the_bound_is_reached_by_an_unequal_split_that_beats_the_equal_stages_formula():
    """Two workers, two micro-batches, stage times 2 and 1 (forward 1 + backward 1, forward 0 + backward 1):
    1F1B's iteration is 4, below the reference formula's ``(m - 1) T / p + T = 4.5`` for the same total, which the
    bound once was (and so pruned schedules that could win); the bound is 4, reached."""
    simulated = simulate([1.0, 0.0], [1.0, 1.0], 2, "1f1b").iteration_s
    assert simulated == pytest.approx(4.0)
    assert lower_bound("1f1b", 2, 1.0, 2.0, [1.0, 1.0]) == pytest.approx(simulated)
    assert lower_bound("gpipe", 2, 1.0, 2.0, [1.0, 1.0]) <= simulate([1.0, 0.0], [1.0, 1.0], 2, "gpipe").iteration_s


def test_the_bound_for_equal_workers_is_the_geometric_split():
    for m, p in [(1, 4), (2, 2), (6, 4), (8, 1)]:
        r = (m - 1) / m
        assert lower_bound("1f1b", m, 1.0, 2.0, [1.0] * p) == pytest.approx(max(3.0 / (1 - r ** p), m * 3.0 / p))


def test_a_candidate_whose_bound_is_above_the_best_found_is_not_solved():
    cands = [Candidate("gpipe", 1), Candidate("1f1b", 4), Candidate("zb-h1", 4)]
    bounds = {cands[0]: 5.0, cands[1]: 1.0, cands[2]: 1.5}
    solved = []

    def evaluate(c):
        solved.append(c)
        return Trial(c, {"1f1b": 2.0, "zb-h1": 2.6}[c.schedule], 1.0, "never", True)
    best, trials = search(cands, evaluate, bounds.__getitem__)
    assert solved == [cands[1], cands[2]]                       # by bound, the last one skipped
    assert best.candidate == cands[1] and [t.candidate for t in trials] == cands   # rows in the given order
    assert trials[0].skipped and not trials[0].feasible and "not solved" in trials[0].note
    assert trials[0].lower_bound_s == 5.0 and not trials[2].skipped


def test_bad_bound_arguments_are_refused():
    with pytest.raises(ValueError, match="positive speeds"):
        lower_bound("1f1b", 4, 1.0, 2.0, [])
    with pytest.raises(ValueError, match="micro_batches >= 1"):
        lower_bound("1f1b", 0, 1.0, 2.0, [1.0])


@given(st.lists(st.floats(1.0, 2.0), min_size=2, max_size=6), st.floats(0.0, 0.2), st.randoms())
@settings(max_examples=60, deadline=None)
def test_times_within_the_tolerance_resolve_by_schedule_then_micro_batches(times, tolerance, rnd):
    """Brute force: the choice is the first (fewest micro-batches, then in SCHEDULES order) of the trials within
    ``tolerance`` of the fastest; noise inside the tolerance that keeps the same set near the fastest cannot
    change it."""
    cands = [Candidate(SCHEDULES[k % len(SCHEDULES)], 2 + 2 * (k // len(SCHEDULES))) for k in range(len(times))]
    timed = dict(zip(cands, times))
    best, _ = search(cands, lambda c: Trial(c, timed[c], 1.0, "never", True), None, tolerance)
    fastest = min(times)
    near = [c for c in cands if timed[c] <= fastest * (1 + tolerance)]
    rank = {s: k for k, s in enumerate(SCHEDULES)}
    assert best.candidate == min(near, key=lambda c: (c.micro_batches, rank[c.schedule], timed[c]))
    if tolerance == 0:
        assert best.iteration_s == fastest
    order = list(cands)
    rnd.shuffle(order)   # the order the candidates come in does not matter
    again, _ = search(order, lambda c: Trial(c, timed[c], 1.0, "never", True), None, tolerance)
    assert again.candidate == best.candidate


def test_a_bound_within_the_tolerance_of_the_best_is_still_solved():
    cands = [Candidate("1f1b", 4), Candidate("gpipe", 4)]
    bounds = {cands[0]: 1.0, cands[1]: 2.05}

    def evaluate(c):
        return Trial(c, {"1f1b": 2.0, "gpipe": 2.08}[c.schedule], 1.0, "never", True)
    best, trials = search(cands, evaluate, bounds.__getitem__, tolerance=0.05)
    assert not trials[1].skipped and best.candidate == cands[1]   # gpipe within 5 %: the simpler schedule
    best, trials = search(cands, evaluate, bounds.__getitem__)
    assert trials[1].skipped and best.candidate == cands[0]
