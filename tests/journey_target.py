"""Test helper for the LLM journey under ``python -m fxpipe.launch``: a factory and a data function per Hugging
Face family of :mod:`hf_models`, importable as ``journey_target:llama`` and ``journey_target:data_llama``
(``tests/`` on ``PYTHONPATH``). The data are dicts of the model's keyword inputs, labels padded with -100."""

from __future__ import annotations

from typing import Any

from hf_models import FAMILIES, build, padded_batch

STEPS = 5


def batches(family: str) -> list[dict[str, Any]]:
    """The journey's batches: the last one smaller, as a data loader's last batch."""
    return [padded_batch(family, 8 if i < STEPS - 1 else 6, seed=i + 1) for i in range(STEPS)]


for _family in FAMILIES:
    _name = _family.replace("-", "_")
    globals()[_name] = (lambda f: lambda: build(f))(_family)
    globals()[f"data_{_name}"] = (lambda f: lambda: batches(f))(_family)

