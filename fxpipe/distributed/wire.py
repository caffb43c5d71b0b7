"""What goes over the wire between ranks: message tags, the header describing a value, the end-of-step status.

Every point-to-point message of a step has its own tag, so a receive matches exactly one send whatever
order the two ranks' schedules post them in (gloo matches by source and tag; a skip connection's value
and the next stage's may arrive in any order). A tag names the channel (one value and one consuming
stage, numbered the same on every rank), the direction (value forward, gradient backward), the
micro-batch and the part (header length, header, then one part per tensor).

A value's *header* (its pytree structure, each tensor's shape, dtype and ``requires_grad``, the
non-tensor leaves) is sent only the first time a micro-batch of that input signature crosses the
channel; both ranks know the signatures (every rank is given the batch), so neither waits for a header
it already has and a new shape (the last, smaller batch; another sequence length) brings a new one.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

__all__ = ["TensorMeta", "Header", "tag", "header_of", "encode_header", "decode_header", "encode_status",
           "decode_status", "STATUS_TAG", "STATUS_BYTES", "signature", "MAX_MICRO_BATCHES", "MAX_TENSORS",
           "nccl_order_hazard"]

STATUS_TAG = 1            # one status message per peer and step: finished, or failed and where
STATUS_BYTES = 4096
MAX_MICRO_BATCHES = 1024
MAX_TENSORS = 62          # tensors in one value (parts 2..63)
_PARTS = MAX_TENSORS + 2
_FIRST = 16               # tags below are the control messages'


def tag(channel: int, backward: bool, micro_batch: int, part: int) -> int:
    """The tag of one message: gloo tags are 32-bit, so the numbering is dense and checked."""
    if micro_batch >= MAX_MICRO_BATCHES:
        raise ValueError(f"fxpipe.distributed runs at most {MAX_MICRO_BATCHES} micro-batches per step (or per "
                         f"AsyncTrainer.train call), got micro-batch {micro_batch}: use fewer chunks, or train "
                         "on fewer batches per call")
    value = _FIRST + ((channel * 2 + int(backward)) * MAX_MICRO_BATCHES + micro_batch) * _PARTS + part
    if value >= 2 ** 31:
        raise ValueError(f"too many values cross between ranks ({channel + 1} channels) for 32-bit message tags")
    return value


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor of a value."""

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool


@dataclass(frozen=True)
class Header:
    """A value's structure: its flat leaves (tensors as :class:`TensorMeta`) and its pytree spec."""

    spec: str
    leaves: list[Any]

    def tensors(self) -> list[tuple[int, TensorMeta]]:
        """(flat position, meta) of each tensor leaf."""
        return [(pos, leaf) for pos, leaf in enumerate(self.leaves) if isinstance(leaf, TensorMeta)]

    def build(self, tensors: list[torch.Tensor]) -> Any:
        """The value, with ``tensors`` (received, in flat order) in place of the metas."""
        found = iter(tensors)
        return tree_unflatten([next(found) if isinstance(leaf, TensorMeta) else leaf for leaf in self.leaves],
                              treespec_loads(self.spec))


def header_of(value: Any) -> Header:
    flat, spec = tree_flatten(value)
    leaves = [TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.requires_grad)
              if isinstance(t, torch.Tensor) else t for t in flat]
    if sum(isinstance(t, TensorMeta) for t in leaves) > MAX_TENSORS:
        raise ValueError(f"a value crossing ranks holds more than {MAX_TENSORS} tensors; cut the stages elsewhere")
    return Header(treespec_dumps(spec), leaves)


def encode_header(header: Header) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8)


def decode_header(data: torch.Tensor) -> Header:
    return pickle.loads(data.numpy().tobytes())   # written by fxpipe on another rank of this job


def encode_status(status: dict[str, Any]) -> torch.Tensor:
    """A status as a fixed-size buffer (the receiver posts its receive before it knows the length)."""
    text = json.dumps(status)
    if len(text) > STATUS_BYTES:
        failure = dict(status.get("failure") or {})
        failure["error"] = str(failure.get("error", ""))[:STATUS_BYTES // 2] + " [...]"
        text = json.dumps({**status, "failure": failure})
    buf = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
    raw = text.encode()
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def decode_status(buf: torch.Tensor) -> dict[str, Any]:
    return json.loads(buf.numpy().tobytes().rstrip(b"\0").decode())


def signature(micro_batch: dict[str, Any]) -> str:
    """What a micro-batch's boundary shapes depend on: its inputs' shapes and dtypes (and non-tensor inputs)."""
    flat, spec = tree_flatten(micro_batch)
    return repr(([(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in flat], str(spec)))


def nccl_order_hazard(channels: list[tuple[str, int]], producer: dict[str, int], stage_rank: list[int]) -> str | None:
    """Why the two ranks of a channel might post its messages in different orders (a backend that matches by
    order alone, NCCL, would then pair a receive with the wrong send), or ``None`` when they cannot. Within one
    channel (a value and the stage that reads it) the producer sends micro-batch by micro-batch in its
    forwards' order and the reader receives in its own forwards' order, the same increasing one; gradients go
    back in the reader's backward order and are received in the producer's, which every schedule shares. The
    exception is a value the loss (consumer ``-1``) reads from another rank: it is received in the last
    stage's backward order, GPipe's reversed. ``channels`` are the ``(value, consumer stage)`` pairs that cross
    ranks."""
    for name, consumer in channels:
        if consumer == -1:
            return f"the loss reads {name!r} from rank {stage_rank[producer[name]]}, in the backward order"
    return None
