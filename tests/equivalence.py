"""Helpers shared by tests: run a model and its pipeline, compare outputs and gradients."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import fxpipe
from fxpipe.runtime.execute.microbatch import gather, scatter

__all__ = ["reference_step", "pipeline_step", "assert_same_step", "max_relative_error", "calibrate_batchnorm"]


def _loss(out: Any, seed: int = 1234) -> torch.Tensor:
    """A fixed random projection of every output tensor: sensitive to every element."""
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            w = torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device)
            total = total + (t * w).sum()
    return total


def _step(model: nn.Module, run) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = run()
    _loss(out).backward()
    outs = [t.detach().clone() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outs, grads


def reference_step(model: nn.Module, inputs: tuple, chunks: int = 1):
    """Outputs and gradients of the unpartitioned model, on the full batch or on micro-batches."""
    if chunks == 1:
        return _step(model, lambda: model(*inputs))
    micro = scatter(list(inputs), chunks)
    return _step(model, lambda: gather([model(*m) for m in micro]))


def pipeline_step(pipe: fxpipe.Pipeline, model: nn.Module, inputs: tuple):
    return _step(model, lambda: pipe(*inputs))


def max_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got.to(want.device) - want).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _errors(outs, grads, ref_outs, ref_grads) -> tuple[list[float], dict[str, float]]:
    assert len(outs) == len(ref_outs), f"{len(outs)} outputs, expected {len(ref_outs)}"
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        assert a.shape == b.shape, f"output {i}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert set(grads) == set(ref_grads), (
        f"parameters with gradients differ: missing {sorted(set(ref_grads) - set(grads))[:5]}, "
        f"extra {sorted(set(grads) - set(ref_grads))[:5]}")
    return ([max_relative_error(a, b) for a, b in zip(outs, ref_outs)],
            {n: max_relative_error(grads[n], ref_grads[n]) for n in ref_grads})


def _judge_by_float64(model, inputs, chunks, outs, grads, micro_outs, micro_grads, out_err, over,
                      out_tol, grad_tol) -> None:
    """Decide the values over tolerance against a float64 run of the micro-batched model.

    Some fp32 gradients are pure rounding noise (heavy cancellation: the model
    run twice on the same input differs by 3e-4, and by 150% from float64), so
    no fixed tolerance can judge them. For those values the pipeline must be
    as close to the float64 result as the fp32 model itself is (twice its
    error, plus the tolerance); a real fault (a lost micro-batch, a wrong
    stage input) is orders of magnitude beyond that.
    """
    import copy

    m64 = copy.deepcopy(model).double()
    to64 = lambda v: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    outs64, grads64 = reference_step(m64, tuple(to64(v) for v in inputs), chunks)
    del m64
    for i, e in enumerate(out_err):
        if e > out_tol:
            pipe_e = max_relative_error(outs[i].double(), outs64[i])
            ref_e = max_relative_error(micro_outs[i].double(), outs64[i])
            assert pipe_e <= 2 * ref_e + out_tol, (
                f"output {i}: relative error {e:.3g} vs the micro-batched model; against float64 the "
                f"pipeline is off by {pipe_e:.3g}, the model by {ref_e:.3g}")
    for n in over:
        pipe_e = max_relative_error(grads[n].double(), grads64[n])
        ref_e = max_relative_error(micro_grads[n].double(), grads64[n])
        assert pipe_e <= 2 * ref_e + grad_tol, (
            f"gradient of {n}: relative error vs the micro-batched model over {grad_tol}; against float64 "
            f"the pipeline is off by {pipe_e:.3g}, the model by {ref_e:.3g}")


def assert_same_step(model: nn.Module, pipe_factory, inputs: tuple, chunks: int, out_tol: float = 1e-5,
                     grad_tol: float = 1e-4) -> dict[str, float]:
    """Check one training step of ``pipe_factory()`` against the unpartitioned model.

    1. Against the model run on the same micro-batches (same kernels on the same
       shapes): outputs within ``out_tol`` and every gradient within ``grad_tol``,
       relative to the largest magnitude. This is fxpipe's own exactness. A value
       over tolerance is judged against float64 (see ``_judge_by_float64``).
    2. Against the model on the full batch: within the same tolerances, or within
       twice what the model itself changes between full batch and micro-batches
       (fp32 kernels sum in another order per batch size), whichever is larger.
    At most two gradient copies are alive at once (models of 600M parameters
    run on a 24 GiB machine). Returns the largest errors seen, for reports.
    """
    micro_outs, micro_grads = reference_step(model, inputs, chunks)
    pipe = pipe_factory()
    outs, grads = pipeline_step(pipe, model, inputs)
    del pipe
    out_err, grad_err = _errors(outs, grads, micro_outs, micro_grads)
    over = [n for n, e in grad_err.items() if e > grad_tol]
    if over or any(e > out_tol for e in out_err):
        _judge_by_float64(model, inputs, chunks, outs, grads, micro_outs, micro_grads, out_err, over,
                          out_tol, grad_tol)
    # Full batch: its gradients stay in .grad, compared against both stored copies.
    model.zero_grad(set_to_none=True)
    full = model(*inputs)
    _loss(full).backward()
    full_outs = [t.detach() for t in tree_flatten(full)[0] if isinstance(t, torch.Tensor)]
    full_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    full_out_err, full_grad_err = _errors(outs, grads, full_outs, full_grads)
    noise_out, noise_grad = _errors(micro_outs, micro_grads, full_outs, full_grads)
    model.zero_grad(set_to_none=True)
    for i, e in enumerate(full_out_err):
        allowed = max(out_tol, 2 * noise_out[i])
        assert e <= allowed, f"output {i} vs full-batch model: relative error {e:.3g} > {allowed:.3g}"
    for n, e in full_grad_err.items():
        allowed = max(grad_tol, 2 * noise_grad[n])
        assert e <= allowed, f"gradient of {n} vs full-batch model: relative error {e:.3g} > {allowed:.3g}"
    report = {"out": max(out_err), "grad": max(grad_err.values(), default=0.0),
              "full_out": max(full_out_err), "full_grad": max(full_grad_err.values(), default=0.0)}
    del outs, grads, micro_outs, micro_grads, full_outs, full_grads, full
    gc.collect()
    return report


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, inputs: tuple, passes: int = 2) -> nn.Module:
    """Give BatchNorm layers the running statistics a trained model would have, then eval().

    A random model in eval mode keeps BN's initial statistics (mean 0, var 1),
    so activations grow layer after layer and fp32 gradients of deep models
    lose most of their digits (a float64 run disagrees with float32 by >100%):
    no comparison is meaningful there. Calibrated statistics normalise them.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return model.eval()
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration passes
    model.train()
    for _ in range(passes):
        model(*inputs)
    for m, mom in zip(bns, saved):
        m.momentum = mom
    return model.eval()
