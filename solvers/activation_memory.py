"""Peak activation memory of a worker, by walking its schedule: in flight, checkpointing, split backward.

The solvers' memory limit counts saved activations times the micro-batches in
flight (``Problem.inflight``). That is exact for a stage without checkpointing
in GPipe and 1F1B, but not what a worker holds when some micro-batches are
checkpointed (only their inputs and outputs stay; a backward recomputes one
micro-batch's activations at a time) or when the backward is split (a
micro-batch whose weight pass is pending keeps its activations and, past the
first stage, the gradients at the weight frontier). :func:`worker_peak_bytes`
follows the worker's operations in order and returns the largest total:

- ``F(i)``: ``+ full`` (``+ checkpointed`` when checkpointed), ``workspace`` on top while it runs;
- ``B(i)``: first the loss (``loss`` on top, on the stage that computes it), then the backward
  with ``workspace`` on top, plus ``recompute`` for a checkpointed micro-batch; then what ``F``
  added is released, and a split backward keeps ``weight_pending`` until ``W(i)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from solvers.schedules import Op

__all__ = ["StageBytes", "worker_peak_bytes"]


@dataclass(frozen=True)
class StageBytes:
    """What one micro-batch of a stage holds and needs, in bytes."""

    full: float               # in flight, not checkpointed: saved activations, received inputs, outputs
    checkpointed: float       # in flight, checkpointed: received inputs and outputs
    recompute: float          # rebuilt by a checkpointed backward
    workspace: float = 0.0    # transient buffers of one operation
    loss: float = 0.0         # the loss's transient buffers (the stage that computes it)
    weight_pending: float = 0.0   # held from a split backward's B to its W


def worker_peak_bytes(order: Sequence[Op], stage_bytes: Callable[[int], StageBytes],
                      checkpointed: Callable[[int, int], bool], split_backward: bool = False) -> float:
    """Peak bytes a worker holds while it runs ``order``."""
    live = peak = 0.0
    pending: dict[tuple[int, int], float] = {}
    for kind, stage, i in order:
        b, ckpt = stage_bytes(stage), checkpointed(stage, i)
        held = b.checkpointed if ckpt else b.full
        if kind == "F":
            live += held
            peak = max(peak, live + b.workspace)
        elif kind == "B":
            peak = max(peak, live + b.workspace + max(b.loss, b.recompute if ckpt else 0.0))
            live -= held
            if split_backward and not ckpt:
                pending[(stage, i)] = b.weight_pending
                live += b.weight_pending
        elif kind == "W":
            peak = max(peak, live + b.workspace)
            live -= pending.pop((stage, i), 0.0)
        else:
            raise ValueError(f"unknown operation kind {kind!r}")
    return peak
