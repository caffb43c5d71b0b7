"""``fxpipe.launch --compare DIR``: a launched run checked against one process training the whole batches.

The launch runs' checkpoint (``DIR``'s latest, :mod:`fxpipe.distributed.snapshots`) holds their parameters and
the loss of every step they trained (``losses`` in its metadata, kept across ``--resume``). This trains the same
model (built as the ranks built it: the same ``--model``, ``--config`` and ``--seed``) on the same first batches
of ``--data``, whole, with the same optimizer, learning rate and loss, in this process, and prints both loss
series and the largest differences; it returns 0 when every loss and parameter agrees within ``rtol`` (relative,
with ``atol`` for values near zero), else 1. No process group: run it with ``python -m fxpipe.launch``, the same
arguments as the launch, ``--compare DIR`` added.

A ``"bf16-mixed"`` plan's run is compared with one process under the same policy (every float32 parameter read as
its bfloat16 copy) at bfloat16's tolerance. The tolerance follows the dtype the model trains in (:func:`tolerance`): a pipeline adds the same numbers in
another order, which float32 rounds at 1e-7 and bfloat16 at 4e-3 of the tensor's largest value, so a bfloat16
plan (``fxpipe plan`` on a preset) compared at float32's tolerance would say DIFFER of a run that is right.
"""

from __future__ import annotations

import os
import tempfile
from itertools import islice
from typing import Any, Callable, Iterable

import torch
from torch import nn

__all__ = ["compare_run"]


def _loss(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
          precision: str | None = None) -> torch.Tensor:
    """The step's loss as the launch computed it: the model's own for a dict of keyword inputs, else
    ``loss_fn(model(inputs), target)``; under ``"bf16-mixed"`` with every float32 parameter read as its bfloat16
    copy (the policy the plan runs, :mod:`fxpipe.frontend.precision`; the gradients land in the float32 ones)."""
    from fxpipe.frontend.precision import compute_copy, compute_input, is_mixed

    def run(*args: Any, **kwargs: Any) -> Any:
        if not is_mixed(precision):
            return model(*args, **kwargs)
        copies = {n: compute_copy(p) for n, p in model.named_parameters()}
        return torch.func.functional_call(model, copies, tuple(compute_input(a) for a in args),
                                          {k: compute_input(v) for k, v in kwargs.items()})
    if not isinstance(batch, dict):
        x, y = batch
        return loss_fn(run(x), y)
    out = run(**batch)
    own = getattr(out, "loss", None)
    if own is None and isinstance(out, dict):
        own = out.get("loss")
    if own is None:
        raise ValueError("--compare: the model returned no loss of its own for a batch of keyword inputs")
    return own


def _saved_parameters(path: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory(prefix="fxpipe-compare-") as tmp:
        whole = os.path.join(tmp, "checkpoint.pt")
        dcp_to_torch_save(path, whole)
        saved = torch.load(whole, weights_only=False)
    return {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}


# torch.testing.assert_close's relative tolerances for the low-precision dtypes; float32's is looser than its
# (1.3e-6) because a pipeline's sums are reordered over several steps of training
RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}


def tolerance(model: nn.Module, precision: str | None = None) -> tuple[float, float]:
    """``(rtol, atol)`` for the dtype of ``model``'s floating parameters (the lowest in precision where they
    mix), or bfloat16's where ``precision`` computes in it (``"bf16-mixed"``): float32's (1e-5, 1e-5), else
    ``rtol`` from :data:`RTOL`, ``atol`` 1e-5."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if precision == "bf16-mixed":
        dtypes.add(torch.bfloat16)
    return max((RTOL.get(d, 1e-5) for d in dtypes), default=1e-5), 1e-5


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    """Elementwise within ``atol + rtol * |a|``, where ``atol`` is at least ``rtol`` of ``a``'s largest value:
    an element near zero in a tensor of large ones carries its sums' rounding too."""
    scale = a.abs().max().item() if a.numel() else 0.0
    return torch.allclose(a, b, rtol=rtol, atol=max(atol, rtol * scale))


def compare_run(checkpoint: str, model: nn.Module, batches: Iterable[Any], optimizer: Callable[..., Any],
                loss_fn: Callable[[Any, Any], torch.Tensor], *, rtol: float | None = None,
                atol: float | None = None, write: Callable[[str], None] = print, precision: str | None = None) -> int:
    """Train ``model`` on the first batches the checkpoint's run trained and compare (module doc), under the plan's
    ``precision``; ``rtol`` and ``atol`` default to :func:`tolerance`'s for the model's dtype and the precision."""
    auto_rtol, auto_atol = tolerance(model, precision)
    rtol, atol = auto_rtol if rtol is None else rtol, auto_atol if atol is None else atol
    from fxpipe.distributed import snapshots
    found = snapshots.latest(checkpoint)
    if found is None:
        raise ValueError(f"--compare {checkpoint}: no checkpoint there (fxpipe.launch --checkpoint writes one)")
    path, meta = found
    launched = meta.get("losses")
    if launched is None or len(launched) != meta["step"]:
        raise ValueError(f"--compare {checkpoint}: the checkpoint records no loss for each of its {meta['step']} "
                         "steps (written by an older fxpipe.launch): train the run again")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params) if params else None
    losses = []
    for batch in islice(iter(batches), meta["step"]):
        loss = _loss(model, batch, loss_fn, precision)
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    if len(losses) != len(launched):
        raise ValueError(f"--compare: --data gave {len(losses)} batches; the checkpoint's run trained {len(launched)}")
    saved = _saved_parameters(path)
    named = dict(model.named_parameters())
    missing = sorted(set(named) - set(saved))
    if missing:
        raise ValueError(f"--compare: the checkpoint holds no {missing[:3]}: it is not this model's")
    loss_gap = max(abs(a - b) for a, b in zip(losses, launched))
    worst = max(((saved[n].float() - p.detach().float()).abs().max().item(), n) for n, p in named.items())
    close = all(abs(a - b) <= atol + rtol * abs(a) for a, b in zip(losses, launched)) and all(
        _close(saved[n].float(), p.detach().float(), rtol, atol) for n, p in named.items())
    write(f"one process: losses {' '.join(f'{x:.6f}' for x in losses)}")
    write(f"launched:    losses {' '.join(f'{x:.6f}' for x in launched)}")
    write(f"largest loss difference {loss_gap:.1e}, largest parameter difference {worst[0]:.1e} ({worst[1]}) over "
          f"{len(named)} parameters")
    write(f"MATCH: the launched run trained as one process does (rtol {rtol:g}, atol {atol:g})" if close else
          f"DIFFER: the launched run is not one process's (rtol {rtol:g}, atol {atol:g})")
    return 0 if close else 1
