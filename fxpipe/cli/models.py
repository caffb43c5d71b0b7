"""What ``fxpipe plan`` and ``fxpipe bench`` take as MODEL: a model and one batch of example inputs.

MODEL is ``torchvision:resnet101``, ``timm:convnext_tiny``, ``hf:llama`` (a Hugging Face causal language model
from its config, :mod:`fxpipe.cli.hf`: ``--config``, ``--seq-len``), ``pkg.module:factory`` (imported) or
``path/to/file.py:factory`` (loaded from the file); a bare name (``resnet101``) is torchvision's. A factory
is called without arguments and returns a module, or ``(module, example_inputs)`` for a model whose input is
not an image batch (``example_inputs`` a tuple holding one full batch). Otherwise the input is a random batch
of ``--input-shape`` per sample (default: the model's own from timm's config, else ``3,H,W`` with
``--image-size``). Every failure is a ``ValueError`` naming what was given and what would work.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ModelSpec", "load_function", "load_model", "parse_shape"]

HOW = ("MODEL is torchvision:NAME, timm:NAME, hf:TYPE (a Hugging Face causal LM from its config: hf:llama, "
       "hf:gpt2, hf:qwen2 ...), pkg.module:factory or path/to/file.py:factory (e.g. torchvision:resnet101)")


class ModelSpec:
    """A parsed MODEL argument: ``source`` (torchvision, timm, module, file), ``name`` and its factory."""

    def __init__(self, text: str, config: dict[str, Any] | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.text = text
        self.config, self.dtype = dict(config or {}), dtype   # hf:TYPE's config overrides and dtype
        source, sep, name = text.rpartition(":") if ":" in text else ("torchvision", ":", text)
        if not sep or not name or not source:
            raise ValueError(f"cannot read MODEL {text!r}: {HOW}")
        self.name = name
        self.source = (source if source in ("torchvision", "timm", "hf")
                       else "file" if source.endswith(".py") else "module")
        self._origin = source
        self.factory = self._factory()

    def _factory(self) -> Callable[[], Any]:
        if self.config and self.source != "hf":
            raise ValueError(f"--config sets a Hugging Face config; {self.text} is not hf:TYPE (e.g. hf:llama)")
        if self.source == "hf":
            from fxpipe.cli.hf import build_hf
            return lambda: build_hf(self.name, self.config, self.dtype)
        if self.source == "torchvision":
            import torchvision
            known = torchvision.models.list_models()
            if self.name not in known:
                raise ValueError(f"torchvision has no model {self.name!r}{_close(self.name, known)}; "
                                 f"`python -c 'import torchvision; print(torchvision.models.list_models())'` "
                                 "lists them")
            return lambda: torchvision.models.get_model(self.name)
        if self.source == "timm":
            try:
                import timm
            except ImportError as exc:
                raise ValueError(f"{self.text}: timm is not installed (pip install timm)") from exc
            known = timm.list_models()
            if self.name not in known:
                raise ValueError(f"timm has no model {self.name!r}{_close(self.name, known)}; "
                                 "timm.list_models('pattern*') lists them")
            return lambda: timm.create_model(self.name, pretrained=False)
        module = _import_file(self._origin) if self.source == "file" else _import_module(self._origin)
        factory = getattr(module, self.name, None)
        if not callable(factory):
            names = [n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n))]
            raise ValueError(f"{self._origin} has no callable {self.name!r}{_close(self.name, names)}: "
                             "name a function that returns an nn.Module (or (module, example_inputs))")
        return factory

    def make(self) -> tuple[nn.Module, tuple | None]:
        """The module and the factory's example inputs (if it gave any), built on the current default device and
        in ``dtype``: the one way MODEL becomes a module, for ``fxpipe plan`` and for every rank of
        ``fxpipe.launch`` alike (the same graph, so the plan's fingerprint). ``hf:TYPE`` takes the dtype as
        transformers does (``from_config(dtype=...)``: the parameters in it, buffers such as rotary frequencies
        kept in float32); any other model with no floating parameter in ``dtype`` is cast whole
        (``model.to(dtype)``), its floating example inputs too (a model already holding some is taken as built,
        as :meth:`fxpipe.frontend.capture.Captured.dtype_mismatch` takes it). Other failures name what was given."""
        made = self.factory()
        model, inputs = made if isinstance(made, tuple) else (made, None)
        if not isinstance(model, nn.Module):
            raise ValueError(f"{self.text} returned {type(model).__name__}, not an nn.Module "
                             "(or a tuple (module, example_inputs))")
        if inputs is not None and not isinstance(inputs, tuple):
            inputs = (inputs,)
        floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if self.dtype is not None and floats and self.dtype not in floats:
            model = model.to(self.dtype)
            if inputs is not None:
                inputs = tuple(t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                               for t in inputs)
        return model, inputs

    def build(self, device: str | torch.device = "cpu") -> tuple[nn.Module, tuple | None]:
        """:meth:`make` on ``device``, the module in train mode; on ``meta`` nothing is allocated (a model that
        cannot be built there is built on the CPU and moved)."""
        try:
            with torch.device(device):
                model, inputs = self.make()
        except (NotImplementedError, RuntimeError):
            if str(device) != "meta" or self.source == "hf":   # a language model built for real: gigabytes
                raise
            model, inputs = self.make()   # e.g. an initialiser that reads values; built for real, then dropped
        return model.to(device).train(), inputs

    def input_shape(self, model: nn.Module, image_size: int) -> tuple[int, ...]:
        """The per-sample input shape to use when none was given: timm's config, else an RGB image."""
        config = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
        if self.source == "timm" and "input_size" in config:
            return tuple(config["input_size"])
        return (3, image_size, image_size)


def load_model(text: str, batch: int, shape: tuple[int, ...] | None, image_size: int,
               device: str | torch.device = "cpu", *, config: dict[str, Any] | None = None, seq_len: int = 1024,
               dtype: torch.dtype | None = None) -> tuple[nn.Module, tuple]:
    """MODEL built on ``device`` and one batch of ``batch`` example inputs (random, or the factory's; ``hf:TYPE``:
    ``batch`` sequences of ``seq_len`` tokens). ``dtype``: the model's floating parameters and inputs in it."""
    spec = ModelSpec(text, config, dtype)
    model, inputs = spec.build(device)
    if spec.source == "hf":
        from fxpipe.cli.hf import token_inputs
        if shape is not None:
            raise ValueError(f"{text} takes token ids: give --seq-len (and --batch), not --input-shape")
        inputs = token_inputs(model, batch, seq_len, device)
    if inputs is None:
        inputs = (torch.randn(batch, *(shape or spec.input_shape(model, image_size)), device=device, dtype=dtype),)
    elif str(device) == "meta":
        inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
    return model, inputs


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """``"3,224,224"`` (or ``3x224x224``) -> ``(3, 224, 224)``: one sample's shape, without the batch."""
    if text is None:
        return None
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"--input-shape must be one sample's shape as positive integers, e.g. 3,224,224 "
                         f"(the batch dimension comes from --batch), got {text!r}")
    return shape


def load_function(text: str, flag: str) -> Callable[..., Any]:
    """The function ``pkg.module:name`` (imported) or ``path/to/file.py:name`` (loaded from the file, relative to
    the working directory) names: ``fxpipe.launch``'s ``--data`` and ``--loss``, as MODEL's factories are found.
    A ``ValueError`` names ``flag``, what was given and what would work."""
    origin, sep, name = text.rpartition(":")
    if not sep or not origin or not name:
        raise ValueError(f"{flag} {text!r}: expected pkg.module:function or path/to/file.py:function")
    try:
        module = _import_file(origin) if origin.endswith(".py") else _import_module(origin)
    except ValueError as exc:
        raise ValueError(f"{flag} {text}: {str(exc).split('; ')[0]}"
                         + ("" if origin.endswith(".py") else "; is its package on PYTHONPATH?")) from exc
    found = getattr(module, name, None)
    if not callable(found):
        names = [n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise ValueError(f"{flag} {text}: {origin} has no function {name!r}{_close(name, names)}")
    return found


def _close(name: str, known: list[str]) -> str:
    near = difflib.get_close_matches(name, known, n=3)
    return f" (did you mean {', '.join(near)}?)" if near else ""


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(f"cannot import {name!r} ({exc}); {HOW}") from exc


def _import_file(path: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"no file {path!r}; {HOW}")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent.resolve()))   # its own sibling imports work, as `python file.py`
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module
