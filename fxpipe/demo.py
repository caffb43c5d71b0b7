"""The demo behind ``python -m fxpipe demo``: compile a torchvision model and check it.

Compiles the model onto the given devices, prints the plan, runs one training
step (forward, cross-entropy, backward) through the pipeline and through an
untouched copy of the model, and reports how far outputs and gradients are
apart. BatchNorm runs in eval mode, where micro-batching cannot change it.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
import torchvision

import fxpipe

__all__ = ["run_demo", "relative_error"]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` (0 when both are 0)."""
    scale = want.abs().max().item()
    diff = (got.detach().to(want.device) - want).abs().max().item()
    return diff / scale if scale > 0 else diff


def run_demo(model_name: str = "resnet50", devices: tuple[str, ...] = ("cpu", "cpu"), batch: int = 32,
             chunks: int = 4, image_size: int = 224, profile: str = "measure", seed: int = 0) -> bool:
    torch.manual_seed(seed)
    model = torchvision.models.get_model(model_name, num_classes=1000).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 3, image_size, image_size)
    target = torch.randint(0, 1000, (batch,))
    print(f"compiling torchvision {model_name} onto {list(devices)} (batch {batch}, chunks {chunks}, "
          f"profile {profile}) ...")
    started = time.perf_counter()
    pipe = fxpipe.compile(model, list(devices), example_inputs=(x,), chunks=chunks,
                          profile=dataclasses.replace(fxpipe.ProfileOptions.of(profile), progress=True))
    print(f"compiled in {time.perf_counter() - started:.1f}s\n")
    print(pipe.plan.summary())

    started = time.perf_counter()
    out = pipe(x)
    torch.nn.functional.cross_entropy(out, target.to(out.device)).backward()
    pipe_s = time.perf_counter() - started
    started = time.perf_counter()
    ref_out = reference(x)
    torch.nn.functional.cross_entropy(ref_out, target).backward()
    ref_s = time.perf_counter() - started

    out_err = relative_error(out, ref_out)
    grad_errs = {name: relative_error(p.grad, q.grad) for (name, p), q in
                 zip(model.named_parameters(), reference.parameters())}
    worst = max(grad_errs, key=grad_errs.get)
    ok = out_err <= 1e-5 and grad_errs[worst] <= 1e-4
    print(f"\ntraining step: pipeline {pipe_s:.2f}s, unpartitioned model {ref_s:.2f}s")
    print(f"outputs:   max relative difference {out_err:.2e} (tolerance 1e-05)")
    print(f"gradients: max relative difference {grad_errs[worst]:.2e} over {len(grad_errs)} parameters "
          f"(worst: {worst}; tolerance 1e-04)")
    print("MATCH: the pipeline computes the same function and gradients as the model" if ok
          else "MISMATCH: the pipeline differs from the model")
    return ok
