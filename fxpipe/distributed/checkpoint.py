"""Checkpoints of a pipeline trained on ranks, with ``torch.distributed.checkpoint``: each rank writes its own stages.

Every key is the model's own name for a tensor (``named_parameters``/``named_buffers`` of ``model_fn()``), so
the keys of different ranks never collide and a checkpoint does not depend on which rank held what. The
optimizer's state goes under ``optim.<parameter name>.<state key>`` (an optimizer's own ``state_dict`` numbers
its parameters per rank, which would collide). Loading reads the checkpoint's metadata for the optimizer
entries of this rank's parameters, so a fresh optimizer can be resumed; its hyper-parameters are the ones it
was constructed with. Because nothing in a key names a rank or a stage, a checkpoint loads into the ranks of
another plan of the same model (resharding: 4 stages written, 2 read, or another ``dp``): each rank reads the
entries of the tensors it now holds, wherever they were written from. Replicas of a ``dp`` group write the same
keys; ``torch.distributed.checkpoint`` keeps one copy.

Sharded states: a parameter that FSDP2 (``fully_shard`` over a ``dp`` mesh) or tensor parallelism made a
``DTensor`` is saved as that ``DTensor``, and so is its optimizer state (Adam's moments are ``DTensor`` s shaped
like it): ``torch.distributed.checkpoint`` writes each rank's shard with the tensor's global shape, and a
loading rank reads the part it holds now: a plain tensor (another plan, no sharding) or its shard of another
mesh, from a checkpoint written sharded or plain. The names come from ``stage.named_parameters()``, which
names a parameter by its module slot, so a ``DTensor`` that replaced it keeps the model's name.

Expert shards (:mod:`fxpipe.distributed.parallel.expert_parallel`) are plain tensors of this rank's experts; they
and their moments are written and read as the ``DTensor`` s they are pieces of (``Shard(0)`` over the ep group,
:func:`~fxpipe.distributed.parallel.expert_parallel.global_view`, sharing their storage), so the checkpoint holds
each layer's whole expert tensors and another ``ep``, or none, reads them back.

One exception: ``torch.distributed.checkpoint`` (torch 2.15) cannot write a ``DTensor`` placed
``_StridedShard`` (GPT-2's fused q/k/v weight under tensor parallelism,
:class:`~fxpipe.distributed.parallel.tp_plans.Conv1DFusedColwise`): it describes each rank's strided columns as
one contiguous block and refuses the plan ("overlapping chunks"). Such a tensor (and its optimizer moments) is
written as the same global tensor redistributed to plain ``Shard`` s of the same dimensions (one all-gather of
that tensor per save), and read that way, then redistributed back: what is stored is the model's global tensor
under its own name, which a plain model or any other mesh loads as usual.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fxpipe.distributed.parallel.expert_parallel import global_shape, global_view, own_view

__all__ = ["save", "load"]


def _tensors(stage: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters (``DTensor`` s where sharded) and buffers by their names in the model."""
    ranked = getattr(stage, "ranked", stage)   # a PipelineRank's stages
    own = {id(t) for k in ranked.own for t in ranked.specs[k].module.buffers()}
    buffers = {name: t for name, t in ranked.model.named_buffers() if id(t) in own}
    return {**dict(stage.named_parameters()), **buffers}


def _like(param: torch.Tensor, meta: TensorStorageMetadata) -> torch.Tensor:
    """Room for a stored optimizer entry of ``param``: shaped like the parameter (a moment) it is laid out as the
    parameter is now (a ``DTensor`` 's shard where sharded, an expert shard's global view); anything else (a step
    count) plain."""
    if tuple(meta.size) == global_shape(param):   # a DTensor's shape is its global one
        return global_view(torch.empty_like(param.detach(), dtype=meta.properties.dtype), param)
    return torch.empty(meta.size, dtype=meta.properties.dtype)


def _strided(t: Any) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def _storable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``torch.distributed.checkpoint`` can write and read it: a strided ``DTensor`` redistributed to plain
    ``Shard`` s of the same dimensions (the same global tensor), anything else as it is (module doc)."""
    if not _strided(t):
        return t
    return t.redistribute(t.device_mesh, [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements])


def _optimizer_names(stage: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in stage.named_parameters()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in names]
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} tensors that are not this rank's parameters: build it "
                         "over stage.parameters()")
    return [names[id(p)] for p in order]


def save(stage: Any, optimizer: torch.optim.Optimizer | None, path: str) -> None:
    """Write this rank's parameters, buffers and optimizer state to the checkpoint directory ``path`` (collective:
    every rank calls it)."""
    state: dict[str, Any] = {f"model.{name}": _storable(global_view(t.detach(), t))
                             for name, t in _tensors(stage).items()}
    if optimizer is not None:
        names = _optimizer_names(stage, optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, entries in optimizer.state_dict()["state"].items():
            for key, value in entries.items():
                state[f"optim.{names[index]}.{key}"] = _storable(global_view(value, params[index]))
    dcp.save(state, checkpoint_id=path)


def load(stage: Any, optimizer: torch.optim.Optimizer | None, path: str) -> None:
    """Read this rank's parameters, buffers and optimizer state from ``path`` (collective), in place."""
    state: dict[str, Any] = {f"model.{name}": global_view(t.detach(), t) for name, t in _tensors(stage).items()}
    names = _optimizer_names(stage, optimizer) if optimizer is not None else []
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    params = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    prefixes = {f"optim.{name}.": i for i, name in enumerate(names)}
    wanted: dict[str, tuple[int, str]] = {}
    for key, meta in stored.items():
        name_index = next(((p, i) for p, i in prefixes.items() if key.startswith(p)), None)
        if name_index is None:
            continue
        prefix, index = name_index
        wanted[key] = (index, key[len(prefix):])
        state[key] = _like(params[index], meta) if isinstance(meta, TensorStorageMetadata) else None
    missing = [k for k in state if k.startswith("model.") and k not in stored]
    if missing:
        raise KeyError(f"the checkpoint at {path} has no {missing[:3]} ({len(missing)} of this rank's tensors): "
                       "it was saved for another model or plan")
    strided = {k: t for k, t in state.items() if _strided(t)}   # read as plain Shards, then placed back
    state.update({k: _storable(t) for k, t in strided.items()})
    dcp.load(state, checkpoint_id=path)
    for key, target in strided.items():
        back = state[key].redistribute(target.device_mesh, target.placements)
        if key.startswith("model."):
            target.to_local().copy_(back.to_local())
        state[key] = back
    if optimizer is not None:
        restored = optimizer.state_dict()
        restored["state"] = {}
        for key, (index, entry) in wanted.items():
            value = state[key]
            value = own_view(value, params[index])   # an expert shard's moment, back in the shard's layout
            restored["state"].setdefault(index, {})[entry] = value
        optimizer.load_state_dict(restored)
