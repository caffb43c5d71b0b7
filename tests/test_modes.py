"""compile keeps every submodule's train/eval mode as the user set it (issue 15, item 3).

Fine-tuning freezes BatchNorm with ``bn.eval()`` inside a model in training mode; a compile that calls
``model.train(was)`` or ``pipeline.train()`` would put it back in training mode and a step would overwrite
its running statistics.
"""

import warnings

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.runtime.execute.batchnorm import DeferredBatchNorm
from equivalence import assert_same_step

EST = fxpipe.ProfileOptions(mode="estimate")


class Reads(nn.Module):
    """A traced-through block whose graph depends on its own mode (so compile traces both modes)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * (2.0 if self.training else 1.0)


def _frozen_bn_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), Reads(), nn.BatchNorm1d(8),
                          nn.Dropout(0.0), nn.Linear(8, 4))
    model.train()
    with torch.no_grad():   # statistics unlike a fresh BN's, so an update would show
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model[1].eval()      # frozen BatchNorm
    model[5].eval()      # and a frozen dropout
    return model


def _flags(model):
    return {name: m.training for name, m in model.named_modules()}


@pytest.mark.parametrize("deferred", [False, True])
def test_compile_keeps_each_submodules_mode_and_a_step_leaves_frozen_batchnorm_alone(deferred):
    model = _frozen_bn_model()
    before = _flags(model)
    x, t = torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, stages=2, profile=EST,
                          options=fxpipe.CompileOptions(deferred_batch_norm=deferred))
    assert len(pipe.stages) == 2
    assert _flags(model) == before
    frozen = [m for s in pipe.stages for m in s.modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean.data_ptr() == model[1].running_mean.data_ptr()]
    assert frozen and all(not m.training for m in frozen)
    assert all(isinstance(m, DeferredBatchNorm) for m in frozen) == deferred
    mean, var, count = (model[1].running_mean.clone(), model[1].running_var.clone(),
                        model[1].num_batches_tracked.clone())
    other = model[4].running_mean.clone()

    pipe.step(x, t, nn.functional.mse_loss)
    assert torch.equal(model[1].running_mean, mean) and torch.equal(model[1].running_var, var)
    assert torch.equal(model[1].num_batches_tracked, count)
    assert not torch.equal(model[4].running_mean, other)   # the training BatchNorm does move
    assert _flags(model) == before


def test_outputs_and_gradients_equal_the_models_with_a_frozen_batchnorm():
    model = _frozen_bn_model()
    before = _flags(model)
    x = torch.randn(8, 8)
    assert_same_step(model, lambda: fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, stages=2, profile=EST), (x,),
                     chunks=2)
    assert _flags(model) == before


def test_pipe_train_and_eval_still_set_every_stage_like_nn_module():
    model = _frozen_bn_model()
    model.eval()
    model[4].train()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=2, stages=2, profile=EST)
    assert not pipe.training and model[4].training and not model[1].training
    pipe.train()
    assert all(m.training for s in pipe.stages for m in s.modules())
    pipe.eval()
    assert not any(m.training for s in pipe.stages for m in s.modules())


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


def test_a_model_switched_to_eval_after_an_export_compile_is_warned_about_once(recwarn):
    """torch.export fixes dropout's flag in the graph, so ``model.eval()`` cannot reach the pipeline: its
    calls say once that they compute the train-mode model and how to get the other, instead of silently
    applying dropout. Under fx the model's own Dropout module is in the graph and follows ``model.eval()``."""
    torch.manual_seed(0)
    model, x = _Dropped().train(), torch.randn(8, 8)
    est = fxpipe.ProfileOptions(mode="estimate")
    exported = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, stages=2, profile=est,
                              options=fxpipe.CompileOptions(frontend="export"))
    traced = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, stages=2, profile=est,
                            options=fxpipe.CompileOptions(frontend="fx"))
    exported(x)
    assert not [w for w in recwarn if "mode" in str(w.message)]
    model.eval()
    with pytest.warns(UserWarning, match=r"_Dropped is in eval mode, but this pipeline runs its graph traced in "
                                         r"train mode.*model\.eval\(\) before fxpipe\.compile"):
        exported(x)
    recwarn.clear()
    exported(x)   # once per switch
    with torch.no_grad():
        assert torch.equal(traced(x), model(x))   # fx: the model's Dropout module, now in eval mode
    assert not [w for w in recwarn if "mode" in str(w.message)]
    model.train()
    exported(x)
    model.eval()
    with pytest.warns(UserWarning, match="is in eval mode"):
        exported(x)


@pytest.mark.parametrize("frontend", ["export", "fx"])
def test_a_dropout_of_rate_zero_does_not_make_the_graph_depend_on_the_mode(frontend, recwarn):
    """Hugging Face configs ship ``dropout=0.0``: torch.export records its training flag, but a rate-0
    dropout returns its input in both modes, so the pipeline follows ``pipe.eval()`` and ``model.eval()``
    without a refusal or a warning, and its stages draw no random numbers. A rate above 0 stays
    mode-dependent (the test above)."""
    class Zero(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(nn.functional.dropout(torch.relu(self.a(x)), p=0.0, training=self.training))

    torch.manual_seed(0)
    model, x = Zero().train(), torch.randn(8, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, stages=2,
                          profile=fxpipe.ProfileOptions(mode="estimate"),
                          options=fxpipe.CompileOptions(frontend=frontend))
    assert not pipe._mode.dependent   # (export's: found out on a meta copy of the model, asked here)
    assert not any(fxpipe.runtime.backward.rng.is_random(stage) for stage in pipe.stages)
    model.eval()
    pipe.eval()
    with torch.no_grad():
        assert torch.equal(pipe(x), model(x))
    assert not [w for w in recwarn if "mode" in str(w.message)]


def test_auto_micro_batches_keep_two_samples_for_a_train_mode_batch_norm():
    """A train-mode BatchNorm over one sample normalises it away (on a 1x1 map it is an error, as in
    Inception's auxiliary head): ``chunks="auto"`` makes micro-batches of two samples at least there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(8), nn.Flatten(),
                          nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).train()
    x = torch.randn(4, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the train-mode BatchNorm warning, tested above
        pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,))
    assert 1 <= pipe.plan.chunks <= 2
    tried = {row["chunks"] for row in pipe.plan.solver["search"]}
    assert tried and max(tried) <= 2
    assert tuple(pipe(x).shape) == (4, 4)


@pytest.mark.parametrize("frontend", ["export", "fx"])
def test_the_other_mode_is_traced_only_when_asked_and_a_plan_that_knows_never_traces_it(frontend, monkeypatch):
    """torch.fx's compile traces the other mode at once (cheap); torch.export's compile traces one mode and the
    other only when something asks (here a switch to the other mode, on a ``meta`` copy of the model: its
    parameters stay where they are), then refuses the other mode of a mode-dependent graph. A plan that says
    (torch.fx's) spares a process handed it (``capture_as_planned``: every rank) the other mode's trace; one that
    does not (torch.export's, ``fxpipe.plan``'s) has it traced when needed, as compile."""
    from fxpipe.frontend import capture as capture_module
    from fxpipe.frontend.capture import capture_as_planned
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    real = capture_module._traced
    for model, dependent in ((_Dropped().train(), frontend == "export"), (nn.Sequential(Reads(), nn.Linear(8, 4)), True),
                             (nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), False)):
        traces = []   # the other mode's traces (the first mode's is _choose's)
        monkeypatch.setattr(capture_module, "_traced", lambda *a, **k: traces.append(a[0]) or real(*a, **k))
        pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, stages=2, profile=EST,
                              options=fxpipe.CompileOptions(frontend=frontend, check_micro_batching=False))
        assert len(traces) == (frontend == "fx"), (type(model).__name__, len(traces))
        assert ("mode_dependent" in pipe.plan.frontend) == (frontend == "fx"), pipe.plan.frontend
        pipe.eval()
        if dependent:
            with pytest.raises(fxpipe.FxpipeError, match="compiled in train mode"):
                pipe(x)
        else:
            with torch.no_grad():
                pipe(x)
        assert len(traces) == 1 and pipe._mode.dependent is dependent, type(model).__name__
        assert all(t.device.type == "cpu" for t in model.parameters())
        if frontend == "export":   # the other mode's trace was of a copy on meta, the model left as it was
            assert next(traces[0].parameters()).device.type == "meta" and traces[0] is not model
        plan = fxpipe.Plan.from_dict(pipe.plan.to_dict())   # as a rank reads it
        traces.clear()
        captured = capture_as_planned(model, {**plan.frontend, "mode_dependent": dependent})
        assert captured.fingerprint == plan.fingerprint and captured.mode_dependent is dependent
        assert traces == [], traces   # the other mode was not traced
        unsaid = {k: v for k, v in plan.frontend.items() if k != "mode_dependent"}
        captured = capture_as_planned(model, unsaid)
        assert len(traces) == (frontend == "fx") and captured.depends_on_mode() is dependent and len(traces) == 1
        monkeypatch.undo()
