"""A layer called as a module again under ``"bf16-mixed"``: it computes with its parameters' bfloat16 compute copies.

Under ``"bf16-mixed"`` (:mod:`fxpipe.frontend.precision`) the stage graph reads every float32 parameter through
:func:`~fxpipe.frontend.precision.compute_copy`: ``aten.linear(x, compute_copy(weight), compute_copy(bias))``. When
tensor parallelism calls such a layer as a module again
(:func:`fxpipe.distributed.parallel.module_calls.restore_module_calls`), the module must compute what those nodes
computed: :func:`computing_in_bfloat16` gives the layer with a forward that reads ``compute_copy(self.weight)`` and
``compute_copy(self.bias)``, the operation of the layer's own forward (``F.linear`` for ``nn.Linear``, Hugging
Face ``Conv1D``'s ``addmm`` and view) on them. Once torch's tensor-parallel style has made the parameters
``DTensor`` shards, the copy is the shard cast to bfloat16, once a step (the copy is kept while the parameter's
version is unchanged, as everywhere else), and the gradient flows back through the cast into the float32 shard:
the same policy as the layers tensor parallelism leaves alone, and as FSDP2's ``MixedPrecisionPolicy`` (on FSDP2
meshes the gathered parameters are bfloat16 already and the copy returns them as they are).

The layer given is a shallow copy of the model's own (its parameters, buffers and hooks are the same objects, as
the model's own layer put back would share them) whose class is a subclass of the layer's with that forward; the
class keeps the layer's name, so the styles that recognise a ``Conv1D`` by its name still do.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.frontend.precision import compute_copy

__all__ = ["computing_in_bfloat16"]

_CLASSES: dict[type, type] = {}


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, compute_copy(self.weight), None if self.bias is None else compute_copy(self.bias))


def _conv1d_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face ``Conv1D.forward`` (``addmm(bias, x2d, weight)`` viewed back) on the compute copies."""
    size_out = x.size()[:-1] + (self.nf,)
    x = torch.addmm(compute_copy(self.bias), x.view(-1, x.size(-1)), compute_copy(self.weight))
    return x.view(size_out)


def computing_in_bfloat16(module: nn.Module, conv1d: bool = False) -> nn.Module:
    """``module`` (an ``nn.Linear``, or with ``conv1d`` a Hugging Face ``Conv1D``:
    :func:`~fxpipe.distributed.parallel.module_calls.is_conv1d`) computing with its parameters' bfloat16 compute
    copies (module docstring); ``TypeError`` for another layer."""
    base = type(module)
    if base not in _CLASSES:
        if isinstance(module, nn.Linear):
            forward = _linear_forward
        elif conv1d:
            forward = _conv1d_forward
        else:
            raise TypeError(f"{base.__name__} is not a layer fxpipe calls as a module under bf16-mixed (an nn.Linear "
                            "or a Hugging Face Conv1D)")
        _CLASSES[base] = type(base.__name__, (base,), {"forward": forward, "__module__": __name__,
                                                       "__qualname__": f"computing_in_bfloat16({base.__name__})"})
    made = copy.copy(module)
    made.__class__ = _CLASSES[base]
    return made
