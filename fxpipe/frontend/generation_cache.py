"""Hugging Face models that would return a generation cache are traced with the cache off.

Every transformers causal-LM config says ``use_cache=True``: the model's output then carries
``past_key_values``, a ``transformers.Cache`` holding every layer's keys and values so that generation can
reuse them. A pipeline trains and evaluates whole sequences: nothing reads that cache, torch.export cannot
flatten it (it is not a pytree), and returning it would send every stage's keys and values to the last
stage. The pipelining libraries leave it to the user (PiPPy's and torchtitan's Hugging Face examples set
``config.use_cache = False`` by hand); :func:`generation_cache_off` does it for the length of the trace,
so the model itself is left as it was, and says which configs it changed. The pipeline's outputs then have
``past_key_values=None`` where the model's hold a cache; ``plan.frontend["reason"]`` says so.

A caller who passes ``use_cache`` as an example keyword argument gets what they asked for.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

__all__ = ["generation_cache_off", "CACHE_OFF_REASON"]

CACHE_OFF_REASON = ("traced with config.use_cache=False (a training pipeline returns no generation cache: "
                    "past_key_values is None)")


@contextmanager
def generation_cache_off(model: nn.Module, kwargs: dict[str, Any]) -> Iterator[list[str]]:
    """Within the block, every ``config`` of ``model`` and its submodules that says ``use_cache=True`` says
    False (restored after, also on an error); yields the modules whose config it changed (their paths,
    ``""`` for the model), none when ``use_cache`` is one of ``kwargs``."""
    changed: list[Any] = []
    owners: list[str] = []
    if "use_cache" not in kwargs:
        seen: set[int] = set()
        for path, module in model.named_modules():
            config = getattr(module, "config", None)
            if config is None or id(config) in seen:
                continue
            seen.add(id(config))
            if getattr(config, "use_cache", None) is True:
                changed.append(config)
                owners.append(path)
    for config in changed:
        config.use_cache = False
    try:
        yield owners
    finally:
        for config in changed:
            config.use_cache = True
