"""checkpoint="auto": the plan picks each device's cheapest checkpoint mode that fits its memory."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.planning.memory_model import choose_checkpoints, predict_worker_memory


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())])


def _compile(memory, schedule="gpipe"):
    x = torch.randn(256, 512)
    return fxpipe.compile(_mlp(), ["cpu"] * 2, (x,), chunks=8, stages=2, checkpoint="auto", schedule=schedule,
                          profile="estimate",
                          options=fxpipe.CompileOptions(memory_bytes=None if memory is None else [memory] * 2))


def test_auto_keeps_everything_when_memory_is_plenty_and_checkpoints_what_does_not_fit():
    roomy = _compile(None)
    assert [st.checkpoint for st in roomy.plan.stages] == ["never", "never"]
    need = [w.peak_bytes for w in predict_worker_memory(roomy.plan, checkpoint="never")]
    tight = _compile(min(need) - 1)           # neither worker fits without recomputation
    modes = [st.checkpoint for st in tight.plan.stages]
    assert "never" not in modes
    for w, pred in enumerate(predict_worker_memory(tight.plan)):
        assert pred.peak_bytes <= min(need) - 1, (w, modes)
    # the pipeline runs each stage in its own mode, and is still the model's function
    x, y = torch.randn(256, 512), torch.randn(256, 512)
    model = _mlp()
    reference = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(reference, tight.parameters()))
    assert tight.stage_checkpoint(0) == modes[0] and tight.checkpoint == "auto"
    tight.step(x, y, nn.MSELoss())
    assert all(p.grad is not None for p in tight.parameters())
    saved = fxpipe.Plan.from_dict(tight.plan.to_dict())
    assert [st.checkpoint for st in saved.stages] == modes


def test_auto_recomputes_every_stage_when_no_plan_fits_otherwise():
    roomy = _compile(None)
    always = max(w.peak_bytes for w in predict_worker_memory(roomy.plan, checkpoint="always"))
    never = min(w.peak_bytes for w in predict_worker_memory(roomy.plan, checkpoint="never"))
    assert always < never
    plan = _compile(always * 1.02).plan
    assert all(st.checkpoint != "never" for st in plan.stages)
    with pytest.raises(fxpipe.InfeasiblePlanError, match="checkpoint"):
        _compile(always * 0.5)


def test_choose_checkpoints_names_the_worker_that_cannot_fit():
    plan = _compile(None).plan
    with pytest.raises(MemoryError, match="worker 0 needs .* even with checkpoint='[a-z_:0-9]+' and has"):
        choose_checkpoints(plan, [1.0, 1e12])


def test_compile_recomputes_only_what_memory_needs_by_default_and_a_loaded_plan_runs_its_own_modes():
    """The default is "auto" (issue 45 part 0: no recomputation where the memory holds every activation); with
    ``plan=`` it is the plan's recomputation, whichever mode the plan was made with, never torchgpipe's default."""
    x = torch.randn(256, 512)
    default = fxpipe.compile(_mlp(), ["cpu"] * 2, (x,), chunks=8, stages=2, schedule="gpipe", profile="estimate")
    assert default.checkpoint == "auto" and [st.checkpoint for st in default.plan.stages] == ["never", "never"]
    assert default.plan.checkpoint == "auto" and default.plan.predicted["iteration_s"] > 0
    for made in ("always", "never", "auto"):
        plan = fxpipe.compile(_mlp(), ["cpu"] * 2, (x,), chunks=8, stages=2, schedule="gpipe", profile="estimate",
                              checkpoint=made).plan
        loaded = fxpipe.compile(_mlp(), ["cpu"] * 2, (x,), plan=fxpipe.Plan.from_dict(plan.to_dict()))
        want = [st.checkpoint or made for st in plan.stages]
        assert [loaded.stage_checkpoint(k) for k in range(2)] == want, made
    # an explicit mode with plan= still runs where the plan chose none
    forced = fxpipe.compile(_mlp(), ["cpu"] * 2, (x,), plan=plan.__class__.from_dict(
        {**plan.to_dict(), "checkpoint": "never", "stages": [{k: v for k, v in st.items() if k != "checkpoint"}
                                                              for st in plan.to_dict()["stages"]]}), checkpoint="always")
    assert [forced.stage_checkpoint(k) for k in range(2)] == ["always", "always"]
    with pytest.raises(ValueError, match="or 'auto'"):
        fxpipe.compile(_mlp(), ["cpu"] * 2, (x,), checkpoint="sometimes")
