"""``fxpipe.launch --compare DIR``: a launched run checked against one process training the whole batches.

The launch runs' checkpoint (``DIR``'s latest, :mod:`fxpipe.distributed.snapshots`) holds their parameters and
the loss of every step they trained (``losses`` in its metadata, kept across ``--resume``). This trains the same
model (built as the ranks built it: the same ``--model``, ``--config`` and ``--seed``) on the same first batches
of ``--data``, whole, with the same optimizer, learning rate and loss, in this process, and prints both loss
series and the largest differences; it returns 0 when every loss and parameter agrees within ``rtol`` (relative,
with ``atol`` for values near zero), else 1. No process group: run it with ``python -m fxpipe.launch``, the same
arguments as the launch, ``--compare DIR`` added.
"""

from __future__ import annotations

import os
import tempfile
from itertools import islice
from typing import Any, Callable, Iterable

import torch
from torch import nn

__all__ = ["compare_run"]


def _loss(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
    """The step's loss as the launch computed it: the model's own for a dict of keyword inputs, else
    ``loss_fn(model(inputs), target)``."""
    if not isinstance(batch, dict):
        x, y = batch
        return loss_fn(model(x), y)
    out = model(**batch)
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


def compare_run(checkpoint: str, model: nn.Module, batches: Iterable[Any], optimizer: Callable[..., Any],
                loss_fn: Callable[[Any, Any], torch.Tensor], *, rtol: float = 1e-5,
                atol: float = 1e-5, write: Callable[[str], None] = print) -> int:
    """Train ``model`` on the first batches the checkpoint's run trained and compare (module doc)."""
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
        loss = _loss(model, batch, loss_fn)
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
        torch.allclose(saved[n].float(), p.detach().float(), rtol=rtol, atol=atol) for n, p in named.items())
    write(f"one process: losses {' '.join(f'{x:.6f}' for x in losses)}")
    write(f"launched:    losses {' '.join(f'{x:.6f}' for x in launched)}")
    write(f"largest loss difference {loss_gap:.1e}, largest parameter difference {worst[0]:.1e} ({worst[1]}) over "
          f"{len(named)} parameters")
    write(f"MATCH: the launched run trained as one process does (rtol {rtol:g}, atol {atol:g})" if close else
          f"DIFFER: the launched run is not one process's (rtol {rtol:g}, atol {atol:g})")
    return 0 if close else 1
