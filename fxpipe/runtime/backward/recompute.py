"""A checkpointed stage forward whose recomputation replays the forward's buffers and changes none.

``torch.utils.checkpoint`` runs a stage's forward again during backward. A
forward that updates a buffer (a training BatchNorm's running statistics and
``num_batches_tracked``, ``self.count.add_(...)``, an EMA ``buf.mul_(..).add_(..)``)
would update it a second time there, and would read it as the later
micro-batches left it rather than as the first forward saw it: statistics that
move twice per micro-batch, and gradients of another computation.

torchgpipe handles BatchNorm alone (its recomputation skips the update). Here
any buffer the stage may write (:func:`fxpipe.runtime.boundaries.aliasing.written_buffers`)
is copied as the forward begins, and each recomputation runs with fresh copies
of those values swapped into the stage's modules, then puts the live buffers
back: the recomputation computes exactly what the forward computed and its
writes land in the copies. Both contexts are checkpoint's own hooks
(``context_fn``, non-reentrant mode). The swap is safe because a stage's
backward never runs beside its own forward (one worker per stage; ``pipe(x)``
leaves backward until all forwards are done).

A split backward (zero-bubble schedules: input gradients now, weight gradients
later) needs the recomputed graph twice, which checkpoint's recomputation does
not allow (it frees what it recomputed as the backward uses it). For it,
:func:`forward_saving_nothing` runs the forward keeping no saved tensor and
returns ``again()``, the recomputation the caller runs itself before that
backward, with the same buffer replay.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import (checkpoint as torch_checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from fxpipe.runtime.boundaries.aliasing import written_buffers

__all__ = ["checkpoint_stage", "forward_saving_nothing"]

_META_KEY = "fxpipe_written_buffers"
_SCRIPT_KEY = "fxpipe_runs_torchscript"


def _written(module: fx.GraphModule) -> list[tuple[nn.Module, str, int]]:
    """Every place ``module``'s hierarchy holds a buffer it may write: (owner, attribute, buffer's id)."""
    if _META_KEY not in module.meta:   # the graph never changes once a stage is built
        module.meta[_META_KEY] = written_buffers(module)
    names = module.meta[_META_KEY]
    if not names:
        return []
    ids = {id(module.get_buffer(name)) for name in names}
    places, seen = [], set()
    for owner in module.modules():
        for key, buffer in owner._buffers.items():
            if buffer is not None and id(buffer) in ids and (id(owner), key) not in seen:
                seen.add((id(owner), key))
                places.append((owner, key, id(buffer)))
    return places


class _Snapshot:
    """Entered around the forward: keeps the written buffers' values as it begins."""

    def __init__(self, places: list[tuple[nn.Module, str, int]]) -> None:
        self.places = places
        self.values: dict[int, torch.Tensor] = {}

    def __enter__(self) -> None:
        with torch.no_grad():
            for owner, key, ident in self.places:
                if ident not in self.values:
                    self.values[ident] = owner._buffers[key].detach().clone()

    def __exit__(self, *exc: Any) -> None:
        return None


class _Replay:
    """Entered around each recomputation: the snapshot's values in place of the buffers, then the buffers back
    (also when checkpoint stops the recomputation early, by raising through here)."""

    def __init__(self, snapshot: _Snapshot) -> None:
        self.snapshot = snapshot
        self.live: list[tuple[nn.Module, str, torch.Tensor]] = []

    def __enter__(self) -> None:
        copies = {ident: value.clone() for ident, value in self.snapshot.values.items()}   # one per recompute
        self.live = [(owner, key, owner._buffers[key]) for owner, key, _ in self.snapshot.places]
        for owner, key, ident in self.snapshot.places:
            owner._buffers[key] = copies[ident]

    def __exit__(self, *exc: Any) -> None:
        for owner, key, buffer in self.live:
            owner._buffers[key] = buffer
        self.live = []


def _runs_torchscript(module: fx.GraphModule) -> bool:
    """Whether ``module`` calls compiled TorchScript (a scripted or traced submodule, a scripted function)."""
    if _SCRIPT_KEY not in module.meta:
        module.meta[_SCRIPT_KEY] = any(isinstance(m, torch.jit.ScriptModule) for m in module.modules()) or any(
            n.op == "call_function" and isinstance(n.target, torch.jit.ScriptFunction) for n in module.graph.nodes)
    return module.meta[_SCRIPT_KEY]


def checkpoint_stage(module: fx.GraphModule, *args: Any, preserve_rng_state: bool,
                     policy: Callable[..., Any] | None = None) -> Any:
    """``torch.utils.checkpoint`` (non-reentrant) of ``module(*args)``, with its buffers replayed, not updated
    twice, by the recomputation. ``policy``: a selective checkpointing policy
    (:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`): what the forward keeps and the
    recomputation skips.

    A stage that runs TorchScript recomputes without early stop: torch stops a recomputation early by raising
    an exception through the forward, and the TorchScript interpreter turns it into a bare ``RuntimeError``
    that fails the backward (``torch.utils.checkpoint`` of a scripted module fails the same way).
    """
    places = _written(module)
    early_stop = set_checkpoint_early_stop(False) if _runs_torchscript(module) else contextlib.nullcontext()
    if not places:   # (a partial of torch's own contexts: what torch.compile traces through)
        selective = {} if policy is None else {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                                               policy)}
        with early_stop:
            return torch_checkpoint(module, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                                    **selective)
    snapshot = _Snapshot(places)

    def contexts() -> tuple[Any, Any]:
        forward, recompute = create_selective_checkpoint_contexts(policy) if policy is not None else (None, None)
        return _Both(snapshot, forward), _Both(_Replay(snapshot), recompute)
    with early_stop:
        return torch_checkpoint(module, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                                context_fn=contexts)


class _Both:
    """Two contexts entered as one (the buffer replay's and the selective policy's), the second optional."""

    def __init__(self, first: Any, second: Any) -> None:
        self.stack = contextlib.ExitStack()
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.stack.enter_context(self.first)
        if self.second is not None:
            self.stack.enter_context(self.second)

    def __exit__(self, *exc: Any) -> Any:
        return self.stack.__exit__(*exc)


def _drop(_: torch.Tensor) -> None:
    return None


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("fxpipe: this stage forward saved nothing for backward; backpropagate the outputs of its "
                       "recomputation (forward_saving_nothing's again()) instead")


def forward_saving_nothing(module: fx.GraphModule, *args: Any) -> tuple[Any, Callable[[], Any]]:
    """``module(*args)`` keeping no tensor for backward (its outputs carry ``requires_grad`` for the next stage,
    but are never backpropagated), and ``again()``: the forward run once more, the written buffers as this
    forward found them and left unchanged, returning outputs whose graph keeps what backward needs. The caller
    replays the random numbers around ``again()`` (the seeded guard of :mod:`fxpipe.runtime.backward.rng`)."""
    snapshot = _Snapshot(_written(module))
    with snapshot, torch.autograd.graph.saved_tensors_hooks(_drop, _never_unpacked):
        result = module(*args)

    def again() -> Any:
        with _Replay(snapshot):
            return module(*args)
    return result, again
