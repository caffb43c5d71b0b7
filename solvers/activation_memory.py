"""Peak activation memory of a worker, by walking its schedule: in flight, checkpointing, split backward.

The solvers' memory limit counts saved activations times the micro-batches in
flight (``Problem.inflight``). That is exact for a stage without checkpointing
in GPipe and 1F1B, but not what a worker holds when some micro-batches are
checkpointed (only their inputs and outputs stay; a backward recomputes one
micro-batch's activations at a time) or when the backward is split (a
micro-batch whose weight pass is pending keeps its activations and, past the
first stage, the gradients at the weight frontier). :func:`worker_peak_bytes`
follows the worker's operations in order and returns the largest total:

- ``F(i)``: ``forward_peak`` on top of what is held while it runs, then ``+ full``
  (``checkpointed`` variants for a checkpointed micro-batch);
- ``B(i)`` (``I(i)`` under a split backward): ``backward_peak`` on top while it runs (the loss first, on the stage
  that computes it; the recomputation too when checkpointed; ``backward_peak_split`` for a split backward's
  input pass); then what ``F`` added is released, and a split backward keeps ``weight_pending``
  until ``W(i)`` (``weight_peak`` on top while it runs). A checkpointed micro-batch's ``I``
  first recomputes its activations (``full - checkpointed`` more) and keeps them, with the
  gradients at the weight frontier, until its ``W``
  (:func:`fxpipe.runtime.backward.recompute.forward_saving_nothing`).

The sizes come measured (:mod:`fxpipe.refine.stage_memory`: one forward and backward of
every stage under the allocator's eye) or estimated (:meth:`StageBytes.estimate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from solvers.schedules import BACKWARDS, Op

__all__ = ["StageBytes", "worker_peak_bytes"]


@dataclass(frozen=True)
class StageBytes:
    """What one micro-batch of a stage holds and needs, in bytes; a ``*_peak`` is the most an operation
    has allocated at once above what the worker held when it started (its own ``full`` included)."""

    full: float                     # kept from F to B, not checkpointed: saved activations, inputs, outputs
    checkpointed: float             # kept from F to B, checkpointed: received inputs and outputs
    forward_peak: float             # F
    forward_peak_checkpointed: float
    backward_peak: float            # B, the loss first on the stage that computes it
    backward_peak_checkpointed: float   # B with the recomputation
    backward_peak_split: float      # B of a split backward (input gradients only)
    weight_pending: float = 0.0     # kept from a split backward's B to its W
    weight_peak: float = 0.0        # W
    # the same for a checkpointed micro-batch, whose B recomputes first (None: estimated from the above)
    backward_peak_split_checkpointed: float | None = None
    weight_pending_checkpointed: float | None = None

    @classmethod
    def estimate(cls, full: float, checkpointed: float, recompute: float, workspace: float = 0.0,
                 loss: float = 0.0, weight_pending: float = 0.0) -> "StageBytes":
        """Sizes from a model of the stage: ``workspace`` (an operation's transient buffers) on top of
        every operation, the ``loss``'s buffers on top of a backward, or ``recompute`` (the
        activations a checkpointed backward rebuilds) if larger."""
        return cls(full=full, checkpointed=checkpointed, forward_peak=full + workspace,
                   forward_peak_checkpointed=checkpointed + workspace, backward_peak=workspace + loss,
                   backward_peak_checkpointed=workspace + max(loss, recompute), backward_peak_split=workspace + loss,
                   weight_pending=weight_pending, weight_peak=workspace)


def worker_peak_bytes(order: Sequence[Op], stage_bytes: Callable[[int], StageBytes],
                      checkpointed: Callable[[int, int], bool]) -> float:
    """Peak bytes a worker holds while it runs ``order`` (a whole backward ``B``, or a split one's ``I`` and
    ``W``, read off each operation's kind)."""
    live = peak = 0.0
    pending: dict[tuple[int, int], float] = {}
    for kind, stage, i in order:
        b, ckpt = stage_bytes(stage), checkpointed(stage, i)
        if kind == "F":
            peak = max(peak, live + (b.forward_peak_checkpointed if ckpt else b.forward_peak))
            live += b.checkpointed if ckpt else b.full
        elif kind in BACKWARDS:
            split_backward = kind == "I"
            if split_backward and ckpt:   # the recomputed activations, then the input gradients on top
                during = b.backward_peak_split_checkpointed
                if during is None:
                    during = max(b.backward_peak_checkpointed, b.full - b.checkpointed + b.backward_peak_split)
            else:
                during = (b.backward_peak_checkpointed if ckpt else
                          b.backward_peak_split if split_backward else b.backward_peak)
            peak = max(peak, live + during)
            live -= b.checkpointed if ckpt else b.full
            if split_backward:
                held = b.weight_pending_checkpointed if ckpt and b.weight_pending_checkpointed is not None \
                    else b.weight_pending
                pending[(stage, i)] = held
                live += held
        elif kind == "W":
            if (stage, i) in pending:
                peak = max(peak, live + b.weight_peak)
                live -= pending.pop((stage, i))
        else:
            raise ValueError(f"unknown operation kind {kind!r}")
    return peak
