"""Module hooks: a traced graph calls only the modules it keeps as calls (leaves), so hooks on the others
are refused (backward: they could change gradients) or warned about (forward: they ran once, at trace)."""

import warnings

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import assert_same_step

EST = fxpipe.ProfileOptions(mode="estimate")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.blk, self.b = nn.Linear(8, 8), Block(), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.blk(self.a(x))))


def _halving(module, grad_input, grad_output):
    return tuple(None if g is None else g / 2 for g in grad_input)   # gradient into the block, halved


def _net(hook_on: str = "blk"):
    torch.manual_seed(0)
    net = Net()
    net.get_submodule(hook_on).register_full_backward_hook(_halving)
    return net


@pytest.mark.parametrize("frontend", ["fx", "export", "auto"])
def test_a_backward_hook_the_graph_would_drop_is_refused(frontend):
    with pytest.raises(ValueError, match=r"backward hook\(s\) on blk \(_halving\)(.|\n)*leaf_modules=\["):
        fxpipe.compile(_net(), ["cpu", "cpu"], (torch.randn(8, 8),), profile=EST,
                       options=fxpipe.CompileOptions(frontend=frontend))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-v"])
def test_backward_hooks_on_leaves_run_and_give_the_models_gradients(schedule):
    """The fix (the block a leaf), and a hook on nn.Linear, which fx keeps as a call by itself."""
    for hook_on, leaves in (("blk", [Block]), ("a", [])):
        model, x = _net(hook_on), torch.randn(8, 8)
        assert_same_step(model, lambda: fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, schedule=schedule,
                                                       profile=EST,
                                                       options=fxpipe.CompileOptions(leaf_modules=leaves,
                                                       frontend="fx")),
                         (x,), chunks=2)


def test_a_forward_hook_that_would_not_run_is_warned_about_and_runs_in_a_leaf():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 8)
    seen = []
    model.blk.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    with pytest.warns(UserWarning, match=r"forward hook\(s\) on blk \(.*<lambda>\) ran once while the model was "
                                         r"traced(.|\n)*will not call them"):
        fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile=EST, options=fxpipe.CompileOptions(frontend="fx"))
    # no checkpointing: a recomputed forward calls its hooks again, as torch.utils.checkpoint's does
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, profile=EST, checkpoint="never",
                          options=fxpipe.CompileOptions(frontend="fx", leaf_modules=[Block]))
    seen.clear()
    pipe.step(x, None, lambda out, target: out.sum(), reduction="sum")
    assert seen == [4, 4]   # once per micro-batch, as the model called on each


def test_library_hooks_that_act_on_values_are_not_warned_about():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)),
                          nn.utils.spectral_norm(nn.Linear(8, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*updates buffer")   # spectral norm's power iteration
        fxpipe.compile(model.eval(), ["cpu", "cpu"], (torch.randn(8, 8),), chunks=2, profile=EST)
