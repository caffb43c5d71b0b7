"""compile keeps every submodule's train/eval mode as the user set it (issue 15, item 3).

Fine-tuning freezes BatchNorm with ``bn.eval()`` inside a model in training mode; a compile that calls
``model.train(was)`` or ``pipeline.train()`` would put it back in training mode and a step would overwrite
its running statistics.
"""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.runtime.batchnorm import DeferredBatchNorm
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
