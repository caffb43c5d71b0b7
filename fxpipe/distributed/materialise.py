"""Materialising a model built on the ``meta`` device: only this rank's tensors become real, loaded by name.

:class:`fxpipe.distributed.PipelineRank` with ``weights=`` builds ``model_fn()`` under ``torch.device("meta")``
(no memory), traces and splits it there, then :func:`materialise` gives each of this rank's parameters and
buffers real storage on its stage's device (``torch.empty_like``, then a copy from the weights: the same
steps as ``nn.Module.to_empty`` + ``load_state_dict``, for a subset). A tensor is found in the weights by any of
its names in the model (a tied weight has several; a state dict may keep one). A buffer the weights do not
hold because it is not persistent (``register_buffer(..., persistent=False)``: rotary tables, position ids,
masks) is recomputed by the model's own ``__init__``: ``model_fn()`` once more with every parameter sent to
``meta`` as it is registered (as ``accelerate.init_empty_weights``), so its buffers are real and its
parameters cost at most one parameter's memory at a time.

:func:`empty_model` builds the model without memory for the front end the plan was made with. The ``torch.fx``
front end traces a model on ``meta`` as it traces it on the CPU. ``torch.export`` does not: it records the
device of every tensor the forward creates (Hugging Face's ``torch.arange(..., device=embeds.device)`` becomes
``aten.arange(..., device='meta')``), and code that branches on a device type traces other nodes, so a
``meta``-built Llama traced to another fingerprint than its plan's and its graph would create ``meta`` tensors.
For that front end the model is built and traced under a ``FakeTensorMode`` (torch's own tensors with shapes,
dtypes and a device, but no storage): its tensors say ``cpu`` as in the planning process, the trace is the plan's,
and :func:`materialise` gives them real storage as it does ``meta`` ones.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from fxpipe.distributed.weights import Weights

__all__ = ["empty_model", "materialise", "parameters_on_meta"]


def empty_model(model_fn: Callable[[], nn.Module], frontend: dict | None
                ) -> tuple[nn.Module, contextlib.AbstractContextManager]:
    """``model_fn()`` built without memory for the plan's front end ``frontend`` (``plan.frontend``), and the
    context to capture it in (module doc): on ``meta`` for ``torch.fx``; under a ``FakeTensorMode`` (CPU fake
    tensors), captured in the same mode, for ``torch.export``."""
    if isinstance(frontend, dict) and frontend.get("name") == "export":
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode()
        with mode:
            return model_fn(), mode
    with torch.device("meta"):
        return model_fn(), contextlib.nullcontext()


def is_empty(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no storage: a ``meta`` tensor or a fake one (:func:`empty_model`)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return t.device.type == "meta" or isinstance(t, FakeTensor)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within it, every parameter a module registers moves to ``meta`` at once; buffers stay where they are made."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
    nn.Module.register_parameter = on_meta   # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register   # type: ignore[method-assign]


def _names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return names


def materialise(model: nn.Module, modules: list[nn.Module], tensors: dict[int, tuple[torch.Tensor, torch.device]],
                weights: Weights, model_fn: Callable[[], nn.Module], rank: int) -> None:
    """Give every tensor of ``tensors`` (``id -> (meta tensor, device)``) real storage on its device, loaded from
    ``weights``, in every module of ``model`` and ``modules`` (the traced graph and the stages share them)."""
    names = _names(model)
    persistent = set(model.state_dict(keep_vars=True))
    found: dict[int, str] = {}
    recompute: dict[int, str] = {}
    for key, (t, _) in tensors.items():
        own = names.get(key)
        if own is None:
            raise ValueError(f"rank {rank}: a tensor of this rank's stages is neither a parameter nor a buffer of "
                             "model_fn()'s model (a tensor kept as a plain attribute and read in forward?): register "
                             "it with register_buffer so that it has a name to load by")
        hit = next((n for n in own if n in weights.names), None)
        if hit is not None:
            found[key] = hit
        elif not any(n in persistent for n in own):
            recompute[key] = own[0]
        else:
            raise KeyError(f"rank {rank}: the weights {weights.source} have no {own[0]!r} "
                           f"{tuple(t.shape)} (nor {', '.join(own[1:]) or 'another name'}): they were saved for "
                           "another model; save this model's state_dict() (or fxd.checkpoint.save) and pass that")
    loaded = weights.read(sorted(set(found.values()))) if found else {}
    rebuilt: dict[str, torch.Tensor] = {}
    if recompute:   # non-persistent buffers: the model's own __init__ computes them
        with parameters_on_meta():
            full = model_fn()
        rebuilt = dict(full.named_buffers(remove_duplicate=False))
    real: dict[int, torch.Tensor] = {}
    for key, (t, device) in tensors.items():
        name = found.get(key) or recompute[key]
        source = loaded[name] if key in found else rebuilt[name]
        if tuple(source.shape) != tuple(t.shape):
            raise ValueError(f"rank {rank}: {name!r} is {tuple(source.shape)} in {weights.source if key in found else 'model_fn()'} "
                             f"but {tuple(t.shape)} in the model: the weights were saved for another configuration")
        value = torch.empty(t.shape, dtype=t.dtype, device=device).copy_(source)   # t: meta or fake (no storage)
        real[key] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
    seen: set[int] = set()
    for root in [model, *modules]:
        for sub in root.modules():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            for table in (sub._parameters, sub._buffers):
                for attr, t in list(table.items()):
                    if t is not None and id(t) in real:
                        table[attr] = real[id(t)]
