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

Which stage takes its turn first is up to the threads, so drawing in turn from
one stream would give run-to-run different masks. Instead each step draws one
number from the caller's generator (:func:`step_seed`, as the unpartitioned
model would advance it), and stage ``k``'s forward of micro-batch ``i`` draws
from the generator seeded with ``(seed, k, i)`` and put back as it was after
(:func:`rng_guard` with ``seed``): the same seed gives bit-identical results,
whatever order the workers run in.
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator

import torch
import torch.fx as fx

from fxpipe.frontend.fingerprint import inert_dropout

__all__ = ["is_random", "rng_guard", "step_seed"]

_RANDOM_PARTS = ("dropout", "bernoulli", "rand", "multinomial", "normal_", "uniform_", "exponential_",
                 "geometric_", "cauchy_", "random_", "poisson")
_RANDOM_EXACT = ("normal", "rrelu")
_locks: dict[str, threading.RLock] = {}
_locks_guard = threading.Lock()


def _name(target: object) -> str:
    return (target if isinstance(target, str) else getattr(target, "__name__", str(target))).lower()


def is_random(gm: fx.GraphModule) -> bool:
    """Whether running ``gm`` now may draw from a random generator (a dropout module in eval mode, or a
    functional dropout traced with ``training=False`` or a rate of 0, does not)."""
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            if inert_dropout(node):
                continue
            name = _name(node.target)
            if name in _RANDOM_EXACT or any(k in name for k in _RANDOM_PARTS):
                return True
        if node.op == "call_module":
            for sub in gm.get_submodule(node.target).modules():
                kind = type(sub).__name__.lower()
                if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p == 0:
                    continue   # nn.Dropout(0.0), as many configs build it: draws nothing
                if sub.training and any(k in kind for k in ("dropout", "stochastic", "random", "noise", "rrelu")):
                    return True
    return False


def step_seed(random: list[bool]) -> int | None:
    """One draw from the caller's CPU generator for a step or call whose stages ``random`` say draw at all."""
    return int(torch.randint(0, 2**62, (1,)).item()) if any(random) else None


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


@contextmanager
def _seeded(lock: threading.RLock, device: torch.device, seed: int, stage: int, micro_batch: int) -> Iterator[None]:
    generator = _generator(device)
    with lock:
        state = generator.get_state()
        digest = hashlib.sha256(f"{seed}/{stage}/{micro_batch}".encode()).digest()
        generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        try:
            yield
        finally:
            generator.set_state(state)


def rng_guard(device: torch.device, random: bool, seed: int | None = None, stage: int = 0,
              micro_batch: int = 0) -> ContextManager[object]:
    """Hold ``device``'s generator lock when ``random`` (re-entrant: a nested guard on one thread passes);
    with ``seed`` (:func:`step_seed`), draw from the generator seeded for ``(seed, stage, micro_batch)``."""
    if not random:
        return nullcontext()
    key = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    with _locks_guard:
        lock = _locks.setdefault(key, threading.RLock())
    return lock if seed is None else _seeded(lock, device, seed, stage, micro_batch)
