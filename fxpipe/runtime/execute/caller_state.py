"""The caller's grad mode and autocast, carried into the worker threads that run the stages.

Grad mode, inference mode and autocast are thread-local in torch: a worker thread
starts with gradients on and autocast off, whatever the caller of ``pipe(x)`` or
``pipe.step`` set. ``with torch.autocast("cpu", dtype=torch.bfloat16): pipe(x)``
would compute in float32 where the model computes in bfloat16, and
``torch.no_grad()`` around ``pipe.step`` would be ignored. :meth:`CallerState.capture`
reads the caller's state at the call; every worker enters it with
:meth:`CallerState.entered` around its operations (forward, the loss, backward;
``torch.utils.checkpoint`` restores it for a recomputation by itself). DTensor's implicit replication
(``torch.distributed.tensor.experimental.implicit_replication``, thread-local as well) is carried the same way:
tensor-parallel stages (:mod:`fxpipe.distributed.parallel.tp`) run under the caller's. So is the caller's stack
of ``TorchDispatchMode`` objects (``FlopCounterMode``, a mode that counts or logs operators): the workers'
operators pass through it as the plain model's would, so ``with FlopCounterMode(): pipe.step(...)`` counts the
step. The modes are pushed on each worker's own (thread-local) stack, not re-entered: entering a mode sets
process-wide flags that threads unwinding out of order would corrupt; the caller's entry already set them.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode,
                                          _push_mode)

__all__ = ["CallerState", "AUTOCAST_DEVICE_TYPES"]

# Every device type torch has an autocast state for (one per type, thread-local each).
AUTOCAST_DEVICE_TYPES = tuple(d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia",
                                          "privateuseone") if torch.amp.is_autocast_available(d))

# DTensor's thread-local flag (torch.distributed.tensor.experimental.implicit_replication sets it); None where absent
_GET_IMPLICIT = getattr(torch._C, "_get_dtensor_allow_implicit_replication", None)
_SET_IMPLICIT = getattr(torch._C, "_set_dtensor_allow_implicit_replication", None)


@dataclass(frozen=True)
class CallerState:
    """A thread's grad mode and autocast settings, to be entered in another thread."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]   # (device type, dtype) for each type with autocast on
    autocast_cache: bool
    implicit_replication: bool = False
    dispatch_modes: tuple[TorchDispatchMode, ...] = ()   # the caller's stack, innermost last

    @classmethod
    def capture(cls) -> "CallerState":
        """This thread's state now."""
        return cls(grad=torch.is_grad_enabled(), inference=torch.is_inference_mode_enabled(),
                   autocast=tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICE_TYPES
                                  if torch.is_autocast_enabled(d)),
                   autocast_cache=torch.is_autocast_cache_enabled(),
                   implicit_replication=bool(_GET_IMPLICIT and _GET_IMPLICIT()),
                   dispatch_modes=tuple(_get_current_dispatch_mode_stack()))

    @contextmanager
    def entered(self, keep_casts: bool = False) -> Iterator[None]:
        """Run the block in this state (through torch's own context managers, so it nests and unwinds).

        Autocast's cache of cast weights is one for the process, and a thread leaving its outermost autocast
        clears it, for every thread. ``keep_casts`` leaves it to the caller's autocast to clear, as for the plain
        model, whose weights are cast once per autocast region: a worker that runs a whole step in this state
        then neither re-casts a weight for each micro-batch nor makes the other workers re-cast theirs."""
        with ExitStack() as stack:
            if keep_casts and self.autocast:   # one nesting level more, dropped after autocast's own exit
                stack.callback(torch._C.autocast_decrement_nesting)
                torch._C.autocast_increment_nesting()
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
            if self.implicit_replication and _SET_IMPLICIT is not None:
                before = _GET_IMPLICIT()
                _SET_IMPLICIT(True)
                stack.callback(_SET_IMPLICIT, before)
            for mode in self.dispatch_modes:
                _push_mode(mode)
                stack.callback(_pop_mode, mode.__dict__.get("_dispatch_key") or mode.__dict__.get("_mode_key"))
            yield

    def describe(self) -> str:
        """How a message names a state that cannot train: ``torch.no_grad()`` or ``torch.inference_mode()``."""
        return "torch.inference_mode()" if self.inference else "torch.no_grad()"
