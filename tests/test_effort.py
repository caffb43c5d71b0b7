"""How much ``compile`` measures: ``effort="fast"`` (default) times the nodes once and plans; ``"thorough"`` adds
the stage-timing rounds, the stages' memory and their contention. And the micro-batching check's cost."""

import sys

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.runtime.checks.batch_check import check_micro_batching
from fxpipe.runtime.execute.microbatch import BatchLayout


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])


def _spy_refinements(monkeypatch) -> list[str]:
    """Record every refinement compile runs (the measurements beyond the node profile), letting each run."""
    rounds = sys.modules["fxpipe.refine.rounds"]
    calls: list[str] = []
    for name in ("stage_factors", "measure_stage_bytes", "measure_contention"):
        real = getattr(rounds, name)
        monkeypatch.setattr(rounds, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def test_the_default_compile_measures_the_nodes_once_and_nothing_more(monkeypatch):
    calls = _spy_refinements(monkeypatch)
    model, x = _model(), torch.randn(16, 32)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, profile=fxpipe.ProfileOptions(cache=False))
    assert calls == []
    assert "stage_profile" not in pipe.plan.profile and "contention" not in pipe.plan.profile
    assert all(st.measured_bytes is None for st in pipe.plan.stages)
    assert (fxpipe.ProfileOptions().warmup, fxpipe.ProfileOptions().repeats) == (1, 1)
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("as_string", [True, False])
def test_thorough_effort_is_todays_full_measurement(monkeypatch, as_string):
    profile = "thorough" if as_string else fxpipe.ProfileOptions(effort="thorough", cache=False)
    calls = _spy_refinements(monkeypatch)
    model, x = _model(), torch.randn(16, 32)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, stages=2, profile=profile)
    assert calls[0] == "stage_factors" and calls[-2:] == ["measure_stage_bytes", "measure_contention"]
    assert pipe.plan.profile["stage_profile"] and pipe.plan.profile["contention"]["steps"] == 3
    assert all(st.measured_bytes for st in pipe.plan.stages)
    assert fxpipe.ProfileOptions.of("thorough").repeats == 3


def test_fields_given_explicitly_win_over_the_effort():
    fast = fxpipe.ProfileOptions(repeats=5, stage_timing=True)
    assert (fast.repeats, fast.stage_timing, fast.contention_steps) == (5, True, 0)
    thorough = fxpipe.ProfileOptions(effort="thorough", stage_timing=False, contention_steps=0)
    assert (thorough.repeats, thorough.stage_timing) == (3, False)


def test_bad_efforts_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match="effort must be one of 'fast', 'thorough', got 'quick'"):
        fxpipe.ProfileOptions(effort="quick")
    with pytest.raises(ValueError, match="contention_steps=2 is measured after stage timing.*effort='thorough'"):
        fxpipe.ProfileOptions(contention_steps=2)
    with pytest.raises(TypeError, match="'fast', 'thorough'"):
        fxpipe.compile(_model(), ["cpu"], (torch.randn(4, 32),), profile=3)


def test_the_micro_batching_check_runs_two_micro_batches_not_the_whole_batch_twice():
    gm = torch.fx.symbolic_trace(_model())
    seen: list[int] = []
    gm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    check_micro_batching(gm, (torch.randn(32, 32),), BatchLayout(), chunks=8)
    assert seen == [8, 4, 4]        # micro-batches 0 and 1 together, then each alone


def test_the_two_micro_batch_check_still_refuses_a_model_that_mixes_samples():
    class Centre(nn.Module):
        def forward(self, x):
            return x - x.mean(0, keepdim=True)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), Centre()))
    with pytest.raises(fxpipe.FxpipeError, match="first 2 micro-batches \\(of 5.*batch-level operation"):
        check_micro_batching(gm, (torch.randn(11, 8),), BatchLayout(), chunks=5)   # uneven: 3, 2, 2, 2, 2
