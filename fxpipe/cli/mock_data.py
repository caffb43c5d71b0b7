"""``--data mock``: deterministic token batches for a language model plan, as Megatron-LM's ``--mock-data``.

``fxpipe.launch --data mock`` (or ``mock:KEY=VALUE,...``) trains a plan made for a causal or masked language
model without a dataset: to try a launch on the cluster, and to check it against one process
(``fxpipe.launch --compare``), from any directory, with nothing but the installed package. Each batch holds
``input_ids`` of the plan's recorded example shape (its batch of sequences of its length: ``plan.frontend``'s
input record) drawn uniformly from the model's vocabulary, and ``labels``: the ids right-padded with ``-100``
past a random length of each sequence (at least 2 tokens), so the model's own loss counts a different number of
tokens in every sequence, as padded batches do. Batch ``k`` is drawn from a generator seeded with ``(seed, k)``:
every process reads the same batches, and a resumed run the ones it skipped to.

Options: ``batches=N`` (default: no end), ``last=N`` (the last of ``batches`` holds ``N`` sequences: a short
last batch, as a data loader's without ``drop_last``), ``seed=S`` (default 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

__all__ = ["MockTokens", "parse_mock"]

_KEYS = ("batches", "last", "seed")


@dataclass(frozen=True)
class MockTokens:
    """Token batches of ``batch`` x ``seq_len`` ids below ``vocab``, as the module docstring says."""

    batch: int
    seq_len: int
    vocab: int
    batches: int | None = None
    last: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batches is not None and self.batches < 1:
            raise ValueError(f"--data mock: batches={self.batches}; give 1 or more")
        if self.last is not None and (self.batches is None or not 1 <= self.last <= self.batch):
            raise ValueError(f"--data mock: last={self.last} needs batches=N and 1 <= last <= the plan's batch "
                             f"({self.batch})")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        k = 0
        while self.batches is None or k < self.batches:
            yield self.batch_at(k)
            k += 1

    def batch_at(self, k: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        n = self.last if self.last is not None and k == (self.batches or 0) - 1 else self.batch
        ids = torch.randint(0, self.vocab, (n, self.seq_len), generator=g)
        labels = ids.clone()
        for row, length in enumerate(torch.randint(2, self.seq_len + 1, (n,), generator=g).tolist()):
            labels[row, length:] = -100
        return {"input_ids": ids, "labels": labels}


def parse_mock(text: str, frontend: dict[str, Any], model: torch.nn.Module) -> MockTokens:
    """``mock`` or ``mock:KEY=VALUE,...`` for a plan (its front end's record of the example inputs) of ``model``
    (its ``config.vocab_size``)."""
    _, _, options = text.partition(":")
    values: dict[str, int] = {}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if key not in _KEYS or not eq or not value.lstrip("-").isdigit():
            raise ValueError(f"--data {text}: expected mock or mock:KEY=N,... with KEY among {', '.join(_KEYS)} "
                             f"(e.g. mock:batches=5,last=6), got {item!r}")
        values[key] = int(value)
    shape = _token_shape(frontend)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if shape is None or not isinstance(vocab, int):
        raise ValueError("--data mock makes token batches for a language model (a Hugging Face model with a "
                         "config.vocab_size, planned with input_ids of shape (batch, sequence)); this plan's model "
                         "is not one: give --data pkg.module:batches or path/to/file.py:batches")
    if "labels" not in str(((frontend or {}).get("inputs") or {}).get("structure", "")):
        raise ValueError("--data mock trains on the model's own loss, and this plan was made without labels: plan "
                         "the model with labels among its inputs (fxpipe plan hf:TYPE does; fxpipe.plan(..., "
                         "example_kwargs={'labels': ...})), or give --data pkg.module:batches")
    return MockTokens(shape[0], shape[1], vocab, **values)


def _token_shape(frontend: dict[str, Any]) -> tuple[int, int] | None:
    """(batch, sequence length) of the plan's first example input, where that is a 2-d integer tensor."""
    leaves = ((frontend or {}).get("inputs") or {}).get("leaves") or []
    first = leaves[0] if leaves else None
    if not isinstance(first, dict):
        return None
    shape, dtype = first.get("shape"), str(first.get("dtype", ""))
    if not isinstance(shape, list) or len(shape) != 2 or "int" not in dtype:
        return None
    return int(shape[0]), int(shape[1])
