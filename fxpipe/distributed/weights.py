"""Where a rank's weights come from: a state dict (in memory or a ``torch.save`` file), a safetensors file, or a
``torch.distributed.checkpoint`` directory — read one tensor at a time, so a rank never holds the whole model.

:func:`open_weights` returns a :class:`Weights`: ``names`` (every key it holds) and ``read(names)`` (those
tensors, on the CPU). A ``torch.save`` file is memory-mapped (``torch.load(mmap=True)``): only the pages of the
tensors read are loaded. A safetensors file is opened with ``safetensors.safe_open`` and reads only the keys
asked for. A checkpoint directory is the one :func:`fxpipe.distributed.checkpoint.save` writes (keys
``model.<name>``) or any ``torch.distributed.checkpoint`` of the model's ``state_dict()`` (keys ``<name>``);
it is read with ``dcp.load(..., no_dist=True)``, this rank's keys only, without waiting for other ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

__all__ = ["Weights", "open_weights"]


class Weights:
    """Named tensors to load from: ``names`` and ``read(names) -> {name: tensor}``."""

    def __init__(self, source: str, names: set[str], read: Callable[[list[str]], dict[str, torch.Tensor]]) -> None:
        self.source, self.names, self._read = source, names, read

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return self._read(names)


def _from_dict(state: Mapping[str, Any], source: str) -> Weights:
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"weights {source}: {bad[0]!r} is a {type(state[bad[0]]).__name__}, not a tensor; pass the "
                        "model's state_dict() (name -> tensor)")
    return Weights(source, set(state), lambda names: {n: state[n] for n in names})


def _safetensors(path: str) -> Weights:
    try:
        from safetensors import safe_open
    except ImportError as exc:   # an optional dependency: only this format needs it
        raise ImportError(f"reading {path} needs the safetensors package: pip install safetensors") from exc
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())

    def read(wanted: list[str]) -> dict[str, torch.Tensor]:
        with safe_open(path, framework="pt") as f:
            return {n: f.get_tensor(n) for n in wanted}
    return Weights(path, names, read)


def _dcp(path: str) -> Weights:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {k: m for k, m in stored.items() if isinstance(m, TensorStorageMetadata)}
    # fxpipe.distributed.checkpoint.save prefixes the model's names with "model." (beside "optim." entries)
    prefix = "model." if any(k.startswith("optim.") for k in stored) or all(k.startswith("model.") for k in tensors) \
        else ""
    names = {k[len(prefix):] for k in tensors if k.startswith(prefix)}

    def read(wanted: list[str]) -> dict[str, torch.Tensor]:
        state = {prefix + n: torch.empty(tensors[prefix + n].size, dtype=tensors[prefix + n].properties.dtype)
                 for n in wanted}
        dcp.load(state, checkpoint_id=path, no_dist=True)   # this rank's keys only; no collective
        return {n: state[prefix + n] for n in wanted}
    return Weights(path, names, read)


def open_weights(weights: str | os.PathLike | Mapping[str, Any]) -> Weights:
    """The weights at ``weights``: a ``{name: tensor}`` dict, a ``.safetensors`` file, a
    ``torch.distributed.checkpoint`` directory or a ``torch.save`` file of a state dict."""
    if isinstance(weights, Mapping):
        return _from_dict(weights, "(a dict)")
    path = str(weights)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise FileNotFoundError(f"weights {path} is a directory without .metadata: not a torch.distributed."
                                    "checkpoint; pass such a directory, a .safetensors file or a torch.save state dict")
        return _dcp(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights {path} does not exist: pass a torch.save state dict, a .safetensors file "
                                "or a torch.distributed.checkpoint directory")
    if Path(path).suffix == ".safetensors":
        return _safetensors(path)
    try:   # memory-mapped: the tensors of other ranks are never read into memory
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:   # a pickle error, a zip error...: name the file and what it should be
        raise ValueError(f"weights {path} could not be read as a torch.save state dict ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}); save model.state_dict() with torch.save, "
                         "or pass a .safetensors file or a torch.distributed.checkpoint directory") from exc
    if not isinstance(state, Mapping):
        raise TypeError(f"weights {path} holds a {type(state).__name__}, not a state dict: save model.state_dict()")
    return _from_dict(state, path)
