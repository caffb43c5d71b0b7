"""The caller's grad mode, inference mode and autocast reach the worker threads (issue 15, item 4).

They are thread-local in torch: a worker thread starts with gradients on and autocast off, so
``with torch.autocast("cpu", dtype=torch.bfloat16): pipe(x)`` computed in float32 where the model
computes in bfloat16.
"""

import pytest
import torch
from torch import nn

import fxpipe

EST = fxpipe.ProfileOptions(mode="estimate")
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


class Probe(nn.Module):
    """A leaf that records the state its forward runs in."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                          torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")))
        return x


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), Probe(), nn.LayerNorm(32),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _compile(model, x, **kw):
    return fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, stages=2, **{"profile": EST, **kw},
                          options=fxpipe.CompileOptions(leaf_modules=[Probe]))


def _micro_reference(model, x, t=None):
    """The model on the same micro-batches (as the pipeline runs it); with ``t`` its loss, backward included."""
    outs, loss = [], 0.0
    for xi, ti in zip(x.chunk(2), (t.chunk(2) if t is not None else [None, None])):
        out = model(xi)
        outs.append(out)
        if t is not None:
            loss = loss + nn.functional.mse_loss(out, ti) * 0.5
    if t is not None:
        loss.backward()
    return torch.cat(outs), loss


def test_autocast_around_pipe_call_gives_the_models_dtype_and_values():
    model = _model()
    x = torch.randn(8, 16)
    pipe = _compile(model, x)
    with torch.autocast(**BF16):
        want, _ = _micro_reference(model, x)
        model[3].seen.clear()
        got = pipe(x)
    assert want.dtype == torch.bfloat16 and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert model[3].seen == [(True, False, torch.bfloat16)] * 2
    got.float().sum().backward()   # the graph reaches the parameters through the bfloat16 operations
    assert model[0].weight.grad is not None


def _max_relative_error(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", "always"), ("1f1b", "never"), ("zb-h1", "except_last")])
def test_autocast_around_pipe_step_gives_the_models_gradients(schedule, checkpoint, cache):
    """Without autocast's weight cache the pipeline computes exactly what the model does on its micro-batches.
    With it (the default) the model casts a weight once for both micro-batches and sums their gradients in
    bfloat16, where the pipeline's operations each cast their own: the gradients differ by bfloat16 rounding
    (its epsilon is 2**-7 = 7.8e-3)."""
    model = _model()
    x, t = torch.randn(8, 16), torch.randn(8, 4)
    pipe = _compile(model, x, schedule=schedule, checkpoint=checkpoint)
    model.zero_grad(set_to_none=True)
    with torch.autocast(**BF16, cache_enabled=cache):
        want_out, want_loss = _micro_reference(model, x, t)
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model[3].seen.clear()
    with torch.autocast(**BF16, cache_enabled=cache):
        loss, out = pipe.step(x, t, nn.functional.mse_loss, return_outputs=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want_out.detach(), rtol=0, atol=0)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=0 if not cache else 1e-6, atol=0 if not cache else 1e-6)
    for n, p in model.named_parameters():
        err = _max_relative_error(p.grad, want[n])
        assert err <= (0.0 if not cache else 2 ** -7), f"gradient of {n}: relative error {err:.3g}"
    assert model[3].seen and all(state == (True, False, torch.bfloat16) for state in model[3].seen)


def test_no_grad_around_pipe_call_builds_no_graph():
    model = _model()
    x = torch.randn(8, 16)
    pipe = _compile(model, x)
    model[3].seen.clear()
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad and out.grad_fn is None
    assert model[3].seen == [(False, False, False)] * 2
    torch.testing.assert_close(out, _micro_reference(model, x)[0].detach(), rtol=0, atol=0)


def test_inference_mode_around_pipe_call_runs_the_workers_in_it():
    model = _model()
    x = torch.randn(8, 16)
    pipe = _compile(model, x)
    with torch.inference_mode():
        want = _micro_reference(model, x)[0]
        model[3].seen.clear()
        out = pipe(x)
    assert out.is_inference() and not out.requires_grad
    assert model[3].seen == [(False, True, False)] * 2
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode,name", [(torch.no_grad, "torch.no_grad()"),
                                       (torch.inference_mode, "torch.inference_mode()")])
def test_pipe_step_under_no_grad_is_refused_with_the_fix(mode, name):
    model = _model()
    x, t = torch.randn(8, 16), torch.randn(8, 4)
    pipe = _compile(model, x)
    with mode(), pytest.raises(fxpipe.FxpipeError) as info:
        pipe.step(x, t, nn.functional.mse_loss)
    msg = str(info.value)
    assert name in msg and "call it outside that block" in msg and "pipe(x)" in msg
    assert all(p.grad is None for p in model.parameters())


def test_compile_under_no_grad_still_calibrates_in_training_steps():
    model = _model()
    x = torch.randn(8, 16)
    with torch.no_grad():
        pipe = _compile(model, x, profile=fxpipe.ProfileOptions(mode="estimate", calibrate=True,
                                                                calibration_steps=1))
    assert pipe.plan.profile.get("calibration") is not None
    assert all(p.grad is None for p in model.parameters())
