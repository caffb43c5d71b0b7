"""Compiled stages: each stage module ``torch.compile``'d in place after partitioning, as torchtitan compiles
each transformer block.

``fxpipe.compile(torch.compile(model, **opts), ...)`` or ``CompileOptions(compile_stages=True | {...})``
partitions the model the compiler wrapped and compiles every stage module with the same options
(:func:`compile_stages`: ``nn.Module.compile``, in place, so that parameters, state dict names and every
caller of ``spec.module(...)`` stay as they were). Fusion then stays inside a stage: a stage is one fx graph
with explicit inputs and outputs, so dynamo captures it whole (a graph break would show in its recompiles).

Shapes: the options' ``dynamic`` stays as the user gave it (default ``None``, dynamo's automatic dynamic
shapes). A stage compiles for the first micro-batch shape it sees; the first micro-batch of another size
(uneven micro-batches, ``torch.tensor_split`` of 8 samples in 3 gives 3, 3, 2; the smaller last batch of an
epoch) recompiles it once with the changed dimensions symbolic, and that graph runs every later size. So a
stage compiles at most twice per grad mode and train/eval mode (three times where a micro-batch of one
sample appears: dynamo specialises sizes 0 and 1), never once per step. Padding the micro-batches instead
would change what the model computes (a BatchNorm's statistics, a loss averaged over the padded samples).

Split backward: a stage compiled through AOT autograd is one autograd node whose backward is one compiled
graph computing the input and the weight gradients together. The zero-bubble schedules' weight pass
(:mod:`fxpipe.runtime.backward.split_backward`) would run that graph a second time (torch refuses: its buffers are
donated to the first backward, ``retain_graph`` is not allowed; pytorch/pytorch#161904, and torchtitan and
AReaL turn compilation off for these schedules), so ``zb-h1`` and ``zb-v`` are refused with compiled
stages (:func:`refuse_split_backward`) and ``schedule="auto"`` leaves them out. Checkpointing
(``torch.utils.checkpoint`` around the compiled stage, :mod:`fxpipe.runtime.backward.recompute`) recomputes the
compiled forward and works with every other schedule.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from fxpipe.errors import FxpipeError

__all__ = ["compile_stages", "describe", "options_of", "planned_compilation", "refuse_split_backward",
           "SPLIT_REFUSAL"]

SPLIT_REFUSAL = ("a torch.compile'd stage is one autograd node whose compiled backward computes the input and the "
                 "weight gradients together (AOT autograd), so a zero-bubble schedule's separate weight pass would "
                 "run it twice, which torch refuses (pytorch/pytorch#161904)")


def options_of(optimized: nn.Module) -> dict[str, Any]:
    """The ``torch.compile`` keyword arguments a ``torch.compile``'d module was made with (backend, mode's or
    options' inductor settings, ``fullgraph``, ``dynamic``), read back from dynamo's wrapper. Raises
    :class:`FxpipeError` naming ``CompileOptions(compile_stages=...)`` where this torch keeps them elsewhere."""
    try:
        context = optimized.dynamo_ctx
        wrapper = context.callback._torchdynamo_orig_backend._torchdynamo_orig_backend._torchdynamo_orig_backend
        found: dict[str, Any] = {}
        if type(wrapper).__name__ == "_TorchCompileInductorWrapper":
            found["backend"] = "inductor"
            if wrapper.config:
                found["options"] = dict(wrapper.config)   # mode="..." is its options here
        elif type(wrapper).__name__ == "_TorchCompileWrapper":
            from torch._dynamo.backends.registry import list_backends, lookup_backend

            named = wrapper.compiler_name in list_backends(exclude_tags=()) and lookup_backend(
                wrapper.compiler_name) is wrapper.compiler_fn
            found["backend"] = wrapper.compiler_name if named else wrapper.compiler_fn
            found.update(wrapper.kwargs)
        else:
            raise AttributeError(type(wrapper).__name__)
        if context.fullgraph:
            found["fullgraph"] = True
        if context._dynamic is not None:
            found["dynamic"] = context._dynamic
        return found
    except AttributeError as exc:
        raise FxpipeError(f"fxpipe could not read the options of this torch.compile'd module in torch "
                          f"{torch.__version__} ({exc}): pass the module itself with fxpipe.CompileOptions("
                          "compile_stages={...}) holding the torch.compile arguments (True for its defaults)") from exc


def describe(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` as JSON values: a backend function by its qualified name, anything else not JSON by ``repr``."""
    def plain(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
            return value
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if callable(value) and hasattr(value, "__qualname__"):
            return f"{getattr(value, '__module__', '')}.{value.__qualname__}".lstrip(".")
        return repr(value)
    return {"backend": "inductor", **{k: plain(v) for k, v in kwargs.items()}}


def planned_compilation(record: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments a saved plan's stages were compiled with (``plan.compiled``), for
    processes that build their stages from the plan; ``None`` for eager stages. Raises :class:`FxpipeError`
    for a backend saved by name that this process cannot look up (a function of the user's)."""
    if not record:
        return None
    kwargs = dict(record.get("options", {}))
    from torch._dynamo.backends.registry import list_backends

    if kwargs.get("backend", "inductor") not in list_backends(exclude_tags=()):
        raise FxpipeError(f"the plan's stages were compiled with backend {kwargs['backend']!r}, which the plan names "
                          "but cannot hold: pass compile_stages={'backend': <the function>, ...} (or False for eager "
                          "stages)")
    return kwargs


def compile_stages(modules: Sequence[nn.Module], kwargs: Mapping[str, Any]) -> None:
    """``module.compile(**kwargs)`` for each stage module: compiled in place when first called, its
    parameters, buffers and state dict names unchanged."""
    for module in modules:
        module.compile(**kwargs)


def refuse_split_backward(schedule: str, compiled: Mapping[str, Any] | None) -> None:
    """Refuse a zero-bubble schedule (split backward) for compiled stages, saying why and what runs instead."""
    from solvers.schedules import splits_backward

    if compiled is not None and splits_backward(schedule):
        raise FxpipeError(f"schedule {schedule!r} splits each stage's backward into an input-gradient and a weight-"
                          f"gradient pass, and {SPLIT_REFUSAL}: use '1f1b' or 'interleaved-1f1b' with compiled "
                          "stages (schedule='auto' chooses among the others), or eager stages "
                          "(CompileOptions(compile_stages=False))")
