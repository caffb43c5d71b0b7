"""Refusing grad-mode and autocast regions in code that torch.fx traces through.

Symbolic tracing runs ``forward`` once on proxies and records the tensor
operations, not the thread's state around them: a ``with torch.no_grad():``
(or ``torch.enable_grad()``, ``torch.set_grad_enabled(...)``,
``torch.inference_mode()``, ``torch.autocast(...)`` and its ``torch.cuda.amp`` /
``torch.cpu.amp`` forms, as a ``with`` block or as a decorator) leaves no trace in
the graph. The pipeline would then differentiate through values the model treats
as constants, or compute in float32 what the model computes in bfloat16: a
silently wrong answer. So would a gradient hook put on a tensor in ``forward``
(``x.register_hook(fn)``): the graph keeps the operations, not the hook. While
:func:`refusing_grad_regions` is active, entering such a region (or registering
such a hook) from user code in the tracing thread raises :class:`DroppedRegion`,
which :mod:`fxpipe.frontend.trace` turns into a ``TraceError`` naming the module
and the fix (a leaf module runs its ``forward`` eagerly, region included).

The patches sit on the context managers' classes (``__enter__``, and
``set_grad_enabled.__init__``, which changes the mode even without ``with``);
they are installed once however many threads trace at the same time, and only
the tracing thread refuses: a pipeline running on other threads meanwhile, and
torch's or fxpipe's own uses, are let through.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import sys
import threading
from types import FrameType
from typing import Any, Callable, Iterator

import torch
import torch.amp.autocast_mode as amp_mode
import torch.autograd.grad_mode as grad_mode
import torch.cpu.amp.autocast_mode as cpu_amp_mode
import torch.cuda.amp.autocast_mode as cuda_amp_mode
import torch.utils._contextlib as contextlib_mode

__all__ = ["DroppedRegion", "refusing_grad_regions", "TENSOR_HOOK"]

TENSOR_HOOK = "gradient hook on a tensor (Tensor.register_hook)"


class DroppedRegion(TypeError):
    """A grad-mode or autocast region entered while torch.fx traced: ``operation`` names it, ``where`` the code."""

    def __init__(self, operation: str, where: str) -> None:
        super().__init__(f"{operation} at {where}: torch.fx records the operations inside it but not the region")
        self.operation, self.where = operation, where


def _autocast_name(cm: Any) -> str:
    spelled = {cuda_amp_mode.autocast: "torch.cuda.amp.autocast", cpu_amp_mode.autocast: "torch.cpu.amp.autocast"}
    name = spelled.get(type(cm), "torch.autocast")
    return f"{name}({cm.device!r}, dtype={cm.fast_dtype}, enabled={cm._enabled}) region"


# (class, method, how the message names the region): the methods that change the thread's state.
_PATCHED: list[tuple[type, str, Callable[..., str]]] = [
    (grad_mode.no_grad, "__enter__", lambda cm: "torch.no_grad() region"),
    (grad_mode.enable_grad, "__enter__", lambda cm: "torch.enable_grad() region"),
    (grad_mode.set_grad_enabled, "__init__", lambda cm, mode: f"torch.set_grad_enabled({mode})"),
    (grad_mode.inference_mode, "__enter__", lambda cm: f"torch.inference_mode({cm.mode}) region"),
    (amp_mode.autocast, "__enter__", _autocast_name),
    # not a region, but dropped the same way: a traced graph holds operations, not the hooks put on its values
    (torch.Tensor, "register_hook", lambda t, hook: TENSOR_HOOK),
]
# The context managers' own code: a region's origin is the first frame outside it.
_MACHINERY = {os.path.abspath(m.__file__ or "") for m in (grad_mode, amp_mode, cpu_amp_mode, cuda_amp_mode,
                                                             contextlib_mode)} | {os.path.abspath(__file__)}
_FXPIPE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # fxpipe/frontend/.. (no upward import)
_INTERNAL = (os.path.dirname(os.path.abspath(torch.__file__ or "")) + os.sep, _FXPIPE + os.sep)

_lock = threading.Lock()
_installed: list[tuple[type, str, Any]] = []   # (class, method, original) while some thread traces
_users = 0
_thread = threading.local()


def _origin(frame: FrameType | None) -> tuple[str, int]:
    """File and line of the code that asked for the region: for ``with``, the frame that entered it; for a
    decorator (torch's ``decorate_context`` / ``decorate_autocast``), the decorated function's definition."""
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _MACHINERY:
        func = frame.f_locals.get("func") if "func" in frame.f_code.co_freevars else None
        code = getattr(inspect.unwrap(func), "__code__", None) if callable(func) else None
        if code is not None:
            return code.co_filename, code.co_firstlineno
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("<unknown>", 0)


def _guarded(cls: type, original: Callable[..., Any], describe: Callable[..., str]) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        refused = getattr(_thread, "refused", None)
        if getattr(_thread, "tracing", False) and (refused is None or cls in refused):
            filename, line = _origin(sys._getframe(1))
            if not os.path.abspath(filename).startswith(_INTERNAL):   # torch's and fxpipe's own uses pass
                code = linecache.getline(filename, line).strip()
                raise DroppedRegion(describe(self, *args, **kwargs), f"{filename}:{line}: `{code}`")
        return original(self, *args, **kwargs)
    return method


@contextlib.contextmanager
def refusing_grad_regions(only: tuple[type, ...] | None = None) -> Iterator[None]:
    """Within the block, this thread's traced code may not enter a grad-mode or autocast region (``only``:
    regions of these context-manager classes, e.g. ``(torch.inference_mode,)``, which torch.export drops
    while it keeps the others)."""
    global _users
    with _lock:
        if _users == 0:
            for cls, name, describe in _PATCHED:
                original = cls.__dict__[name]
                _installed.append((cls, name, original))
                setattr(cls, name, _guarded(cls, original, describe))
        _users += 1
    before, refused = getattr(_thread, "tracing", False), getattr(_thread, "refused", None)
    _thread.tracing, _thread.refused = True, (set(only) if only is not None else None)
    try:
        yield
    finally:
        _thread.tracing, _thread.refused = before, refused
        with _lock:
            _users -= 1
            if _users == 0:
                while _installed:
                    cls, name, original = _installed.pop()
                    setattr(cls, name, original)
