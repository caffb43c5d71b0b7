"""Random stages and the shared generator: dropout that a checkpoint's recomputation replays exactly.

``torch.utils.checkpoint`` replays a forward's randomness by saving the
device's default generator state before it and setting it back for the
recomputation. That generator is per device, shared by every thread: two
stages on one device (CPU workers, or interleaved stages on one GPU) that run
at once would draw from it in an unpredictable interleaving, and a
recomputation that sets its state would move it under the other stage's feet;
the replayed dropout mask would then differ from the forward's, and the
gradient would silently be that of another mask.

So: a stage whose graph has a random operation (:func:`is_random`: dropout, the
``rand*``/``bernoulli``/``normal_`` family, or a leaf module holding a dropout)
runs its forward, and its backward when that recomputes, holding the lock of
its device's generator (:func:`rng_guard`); a stage without one checkpoints
with ``preserve_rng_state=False`` and never touches the generator. Random
stages on one device therefore take turns; stages on distinct GPUs never wait.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import ContextManager

import torch
import torch.fx as fx

__all__ = ["is_random", "rng_guard"]

_RANDOM_PARTS = ("dropout", "bernoulli", "rand", "multinomial", "normal_", "uniform_", "exponential_",
                 "geometric_", "cauchy_", "random_", "poisson")
_RANDOM_EXACT = ("normal", "rrelu")
_locks: dict[str, threading.RLock] = {}
_locks_guard = threading.Lock()


def _name(target: object) -> str:
    return (target if isinstance(target, str) else getattr(target, "__name__", str(target))).lower()


def is_random(gm: fx.GraphModule) -> bool:
    """Whether running ``gm`` now may draw from a random generator (a dropout module in eval mode, or a
    functional dropout traced with ``training=False``, does not)."""
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            name = _name(node.target)
            if "dropout" in name and node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True) \
                    is False:
                continue
            if name in _RANDOM_EXACT or any(k in name for k in _RANDOM_PARTS):
                return True
        if node.op == "call_module":
            for sub in gm.get_submodule(node.target).modules():
                kind = type(sub).__name__.lower()
                if sub.training and any(k in kind for k in ("dropout", "stochastic", "random", "noise", "rrelu")):
                    return True
    return False


def rng_guard(device: torch.device, random: bool) -> ContextManager[object]:
    """Hold ``device``'s generator lock when ``random`` (re-entrant: a nested guard on one thread passes)."""
    if not random:
        return nullcontext()
    key = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    with _locks_guard:
        lock = _locks.setdefault(key, threading.RLock())
    return lock
