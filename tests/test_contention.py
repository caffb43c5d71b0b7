"""solvers.contention: the per-stage speeds beside other operations that reproduce a measured step."""

import pytest

from solvers.contention import fit_stage_speeds
from solvers.simulate import simulate, stage_medians

FWD, BWD = [1.0, 2.0, 1.5, 1.0], [2.0, 3.0, 2.5, 2.0]
TRUE = [[0.6, 0.8], [0.7, 0.9], [0.5, 0.75], [0.65, 1.2]]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("slots", [None, 2])
def test_the_speeds_that_made_a_simulated_step_are_found_again(schedule, slots):
    """Four workers on two cores, with turns (slots) or time-shared: every operation runs beside another
    some of the time, so every speed, one above 1 included, is determined by the medians."""
    measured = stage_medians(simulate(FWD, BWD, 4, schedule, cores=2, stage_efficiency=TRUE,
                                      slots=slots).timeline, 4)
    found = fit_stage_speeds(FWD, BWD, measured, 4, schedule, cores=2, slots=slots)
    for got, want in zip(found, TRUE):
        assert got == pytest.approx(want, rel=1e-2)
    again = stage_medians(simulate(FWD, BWD, 4, schedule, cores=2, stage_efficiency=found, slots=slots).timeline, 4)
    for got, want in zip(again, measured):
        assert got == pytest.approx(want, rel=2e-3)


def test_interleaved_stages_share_their_workers_speeds_are_still_found():
    fwd, bwd = FWD * 2, BWD * 2
    true = TRUE + [[0.9, 0.7], [0.8, 0.85], [0.55, 0.6], [0.75, 0.95]]
    measured = stage_medians(simulate(fwd, bwd, 8, "interleaved-1f1b", workers=4, cores=2, stage_efficiency=true,
                                      slots=2).timeline, 8)
    found = fit_stage_speeds(fwd, bwd, measured, 8, "interleaved-1f1b", cores=2, workers=4, slots=2)
    again = stage_medians(simulate(fwd, bwd, 8, "interleaved-1f1b", workers=4, cores=2, stage_efficiency=found,
                                   slots=2).timeline, 8)
    for got, want in zip(again, measured):
        assert got == pytest.approx(want, rel=2e-3)


def test_an_operation_that_never_runs_beside_another_keeps_speed_one():
    """One micro-batch through two stages: nothing ever overlaps, so no speed can be fitted; slower measured
    times do not become a made-up contention."""
    measured = [[1.5, 2.5], [3.0, 4.0]]
    assert fit_stage_speeds([1.0, 2.0], [2.0, 3.0], measured, 1, "gpipe", cores=2) == [[1.0, 1.0], [1.0, 1.0]]


def test_measurements_that_cannot_be_fitted_are_refused():
    with pytest.raises(ValueError, match="for each of the 2 stages"):
        fit_stage_speeds([1.0, 1.0], [1.0, 1.0], [[1.0, 1.0]], 4, "gpipe", cores=2)
    with pytest.raises(ValueError, match="cannot be negative"):
        fit_stage_speeds([1.0, 1.0], [1.0, 1.0], [[1.0, -1.0], [1.0, 1.0]], 4, "gpipe", cores=2)


def test_an_operation_that_takes_no_time_keeps_speed_one_and_the_others_are_still_fitted():
    """The backward of a stage where nothing trains: zero alone, zero measured."""
    fwd, bwd = [1.0, 2.0], [0.0, 3.0]
    true = [[0.6, 1.0], [0.7, 0.8]]
    measured = stage_medians(simulate(fwd, bwd, 4, "gpipe", cores=1.5, stage_efficiency=true).timeline, 2)
    assert measured[0][1] == 0.0
    found = fit_stage_speeds(fwd, bwd, measured, 4, "gpipe", cores=1.5)
    assert found[0][1] == 1.0
    again = stage_medians(simulate(fwd, bwd, 4, "gpipe", cores=1.5, stage_efficiency=found).timeline, 2)
    for got, want in zip(again, measured):
        assert got == pytest.approx(want, rel=2e-3)
