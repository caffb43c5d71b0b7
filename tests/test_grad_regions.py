"""Grad-mode and autocast regions inside a traced forward: refused with a TraceError, kept inside a leaf module.

torch.fx records the operations of a ``with torch.no_grad():`` block but not the block, so the pipeline
would differentiate through values the model treats as constants (issue 15: a 6.7e-2 gradient error).
"""

import threading
import warnings

import pytest
import torch
import torch.autograd.grad_mode as grad_mode
from torch import nn

import fxpipe
from equivalence import assert_same_step

EST = fxpipe.ProfileOptions(mode="estimate")


class NoGrad(nn.Module):
    """A gate computed as a constant: its projection gets no gradient in the model."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            g = torch.sigmoid(self.proj(x))
        return x * g


class NoGradDecorator(NoGrad):
    @torch.no_grad()
    def gate(self, x):
        return torch.sigmoid(self.proj(x))

    def forward(self, x):
        return x * self.gate(x)


class NoGradBareDecorator(NoGradDecorator):
    @torch.no_grad
    def gate(self, x):
        return torch.sigmoid(self.proj(x))


class EnableGrad(NoGrad):
    def forward(self, x):
        with torch.enable_grad():
            return self.proj(x)


class SetGradEnabled(NoGrad):
    def forward(self, x):
        with torch.set_grad_enabled(False):
            g = self.proj(x)
        return x * g


class SetGradEnabledCall(NoGrad):
    def forward(self, x):
        torch.set_grad_enabled(False)   # the call form changes the mode without `with`
        g = self.proj(x)
        torch.set_grad_enabled(True)
        return x * g


class InferenceMode(NoGrad):
    def forward(self, x):
        with torch.inference_mode():
            return self.proj(x)


class Autocast(NoGrad):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.proj(x)


class AmpAutocast(NoGrad):
    def forward(self, x):
        with torch.amp.autocast("cpu", dtype=torch.bfloat16):
            return self.proj(x)


class CpuAmpAutocast(NoGrad):
    def forward(self, x):
        with torch.cpu.amp.autocast(dtype=torch.bfloat16):
            return self.proj(x)


class CudaAmpAutocast(NoGrad):
    def forward(self, x):
        with torch.cuda.amp.autocast():
            return self.proj(x)


class AutocastDecorator(NoGrad):
    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, x):
        return self.proj(x)


class Host(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
        self.blk = nn.Sequential(nn.ReLU(), inner)

    def forward(self, x):
        return self.b(torch.relu(self.blk(self.a(x))).float())   # an autocast region returns bfloat16


REGIONS = [
    (NoGrad, "torch.no_grad() region", "with torch.no_grad():"),
    (NoGradDecorator, "torch.no_grad() region", "@torch.no_grad()"),
    (NoGradBareDecorator, "torch.no_grad() region", "@torch.no_grad"),
    (EnableGrad, "torch.enable_grad() region", "with torch.enable_grad():"),
    (SetGradEnabled, "torch.set_grad_enabled(False)", "with torch.set_grad_enabled(False):"),
    (SetGradEnabledCall, "torch.set_grad_enabled(False)", "torch.set_grad_enabled(False)"),
    (InferenceMode, "torch.inference_mode(True) region", "with torch.inference_mode():"),
    (Autocast, "torch.autocast('cpu', dtype=torch.bfloat16", 'with torch.autocast("cpu", dtype=torch.bfloat16):'),
    (AmpAutocast, "torch.autocast('cpu', dtype=torch.bfloat16", "with torch.amp.autocast("),
    (CpuAmpAutocast, "torch.cpu.amp.autocast('cpu', dtype=torch.bfloat16", "with torch.cpu.amp.autocast("),
    (CudaAmpAutocast, "torch.cuda.amp.autocast('cuda'", "with torch.cuda.amp.autocast():"),
    (AutocastDecorator, "torch.autocast('cpu', dtype=torch.bfloat16", '@torch.autocast("cpu"'),
]


def _model(cls):
    with warnings.catch_warnings():   # torch.cpu/cuda.amp.autocast are deprecated; CUDA may be absent
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return Host(cls())


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize("cls,operation,code", REGIONS, ids=[r[0].__name__ for r in REGIONS])
def test_region_in_traced_forward_is_refused_naming_module_operation_and_fix(cls, operation, code):
    model = _model(cls)
    before = {c: c.__dict__[n] for c, n in [(grad_mode.no_grad, "__enter__"), (grad_mode.set_grad_enabled, "__init__"),
                                             (torch.amp.autocast_mode.autocast, "__enter__")]}
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), profile=EST)
    err, msg = info.value, str(info.value)
    assert err.module == "blk.1"
    assert f"submodule 'blk.1' ({cls.__name__})" in msg
    assert operation in msg
    assert code in err.operation and "test_grad_regions.py" in err.operation
    assert f"leaf_modules=[{cls.__name__}]" in msg
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    assert all(c.__dict__[n] is f for (c, f), n in zip(before.items(), ["__enter__", "__init__", "__enter__"])), \
        "the context managers are left unpatched after tracing"


class RootRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            g = self.a(x)
        return self.b(x) * g


def test_region_in_the_models_own_forward_says_to_move_it_into_a_leaf():
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.trace(RootRegion())
    msg = str(info.value)
    assert info.value.module is None
    assert "torch.no_grad() region" in msg and "the model's own forward (RootRegion)" in msg
    assert "move the region into a submodule and make that a leaf" in msg


@pytest.mark.parametrize("cls", [NoGrad, NoGradDecorator, SetGradEnabledCall])
def test_the_fix_a_leaf_keeps_the_region_and_gradients_equal_the_models(cls):
    """The message's fix, applied: pipe(x) and pipe.step give the model's gradients (the projection inside
    the no_grad region gets none, as in the model; traced through it would get one)."""
    model = _model(cls)
    x, t = torch.randn(8, 8), torch.randn(8, 4)

    def build():
        return fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, leaf_modules=[cls], profile=EST)
    assert_same_step(model, build, (x,), chunks=2)

    pipe = build()
    model.zero_grad(set_to_none=True)
    loss = pipe.step(x, t, nn.functional.mse_loss)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    want_loss = sum(nn.functional.mse_loss(model(xi), ti) * 0.5 for xi, ti in zip(x.chunk(2), t.chunk(2)))
    want_loss.backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert "blk.1.proj.weight" not in want          # the model treats the gate as a constant
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-6, atol=1e-7)


def test_autocast_region_inside_a_leaf_keeps_the_models_dtype_and_values():
    model = _model(Autocast)
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, leaf_modules=[Autocast], profile=EST)
    stage = next(s for s in pipe.stages if any(isinstance(m, Autocast) for m in s.modules()))
    assert any(n.op == "call_module" and n.target == "blk.1" for n in stage.graph.nodes)
    with torch.no_grad():
        assert torch.equal(pipe(x), torch.cat([model(xi) for xi in x.chunk(2)]))


class SpawnsNoGrad(nn.Module):
    """Traced code that lets another thread use torch.no_grad() while it is being traced."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        errors = []

        def other():
            try:
                with torch.no_grad():
                    torch.ones(2) * 2
            except BaseException as exc:   # collected and asserted below
                errors.append(exc)
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert not errors, errors
        return self.lin(x)


def test_other_threads_may_enter_regions_while_a_model_is_traced():
    gm = fxpipe.trace(SpawnsNoGrad())
    assert any(n.op == "call_module" for n in gm.graph.nodes)
