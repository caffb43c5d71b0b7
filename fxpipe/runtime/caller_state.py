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
tensor-parallel stages (:mod:`fxpipe.distributed.parallel.tp`) run under the caller's.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

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

    @classmethod
    def capture(cls) -> "CallerState":
        """This thread's state now."""
        return cls(grad=torch.is_grad_enabled(), inference=torch.is_inference_mode_enabled(),
                   autocast=tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICE_TYPES
                                  if torch.is_autocast_enabled(d)),
                   autocast_cache=torch.is_autocast_cache_enabled(),
                   implicit_replication=bool(_GET_IMPLICIT and _GET_IMPLICIT()))

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block in this state (through torch's own context managers, so it nests and unwinds)."""
        with ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
            if self.implicit_replication and _SET_IMPLICIT is not None:
                before = _GET_IMPLICIT()
                _SET_IMPLICIT(True)
                stack.callback(_SET_IMPLICIT, before)
            yield

    def describe(self) -> str:
        """How a message names a state that cannot train: ``torch.no_grad()`` or ``torch.inference_mode()``."""
        return "torch.inference_mode()" if self.inference else "torch.no_grad()"
