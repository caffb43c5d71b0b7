"""Measured memory of every stage: what one micro-batch keeps, and what each operation allocates on top.

The memory model walks a worker's schedule (:mod:`solvers.activation_memory`)
with a handful of sizes per stage. Estimated from per-node sizes they miss what
only the whole stage shows: autograd's own buffers, gradients that meet in a
skip connection, the loss (a cross-entropy keeps its softmax and makes two
gradients the size of the logits). :func:`measure_stage_bytes` measures the
sizes instead, on micro-batch 0 and the stage's real inputs, by running the
operations the executor runs (:class:`fxpipe.runtime.execute.memory_probe.Replay`) each under
:func:`fxpipe.runtime.execute.memory_probe.allocations` (CPU: ``torch.profiler``'s allocator
events; CUDA: the caching allocator's counters):

- a forward and its backward: ``full`` (what the forward leaves allocated, fresh
  input copies included, as a transfer delivers them), ``forward_peak`` and
  ``backward_peak`` (the most allocated at once above what was held before);
- the same with activation checkpointing: ``checkpointed``, ``*_checkpointed``;
- a split backward (zero-bubble schedules) and its weight pass:
  ``backward_peak_split``, ``weight_pending`` (what the forward and the
  input-gradient pass leave) and ``weight_peak``; checkpointed (the input pass
  recomputes first): ``backward_peak_split_checkpointed``, ``weight_pending_checkpointed``. Compiled stages
  (:mod:`fxpipe.runtime.execute.compiled`) run no split backward: these are their unsplit backward's sizes.

Parameter gradients exist during the measurement (as after a first step), and
one unmeasured forward and backward comes first, so one-off allocations are not
counted. The last stage's backward starts at ``loss_fn(output, target)`` when
``compile`` is given them; otherwise at gradients of ones, with the loss's
buffers estimated as a softmax cross-entropy's (three model-output sizes: the
saved softmax, its gradient and the output's gradient). Gradients, buffers and
the RNG are left as they were (:func:`fxpipe.runtime.execute.memory_probe.replaying`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fxpipe.runtime.execute.memory_probe import Replay, allocations, replaying

__all__ = ["measure_stage_bytes"]


def measure_stage_bytes(pipe: Any, example_inputs: Any, target: Any = None,
                        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> list[dict[str, float]]:
    """The :class:`solvers.activation_memory.StageBytes` fields of every stage of ``pipe``, measured; see the
    module doc. ``target`` and ``loss_fn`` (both or neither) are a full batch's target and the training loss."""
    if (target is None) != (loss_fn is None):
        raise ValueError("pass both loss_fn and example_target (a full batch's target), or neither")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    micro = pipe.inputs.micro_batches(inputs, {})[:1]
    targets = pipe.inputs.micro_targets(target)[:1] if target is not None else None
    last = len(pipe.specs) - 1
    sizes = []
    with replaying(pipe, micro) as seen:
        def measured(k: int, checkpointed: bool, split: bool, kinds: str) -> list[Any]:
            replay = Replay(pipe, seen, targets, loss_fn, lambda _k, _i: checkpointed, split_backward=split)
            found = []
            for kind in kinds:
                with allocations(pipe.devices[k]) as one:
                    replay.run(kind, k, 0)
                found.append(one)
            return found
        for k in range(len(pipe.specs)):
            measured(k, False, False, "FB")    # one-off allocations (caches, lazy buffers) out of the way
            forward, backward = measured(k, False, False, "FB")
            forward_c, backward_c = measured(k, True, False, "FB")
            if pipe.compiled is None:
                forward_s, backward_s, weight = measured(k, False, True, "FIW")
                forward_sc, backward_sc, _ = measured(k, True, True, "FIW")
            else:   # a compiled stage's backward does not split (fxpipe.runtime.execute.compiled): no zero-bubble
                # schedule
                (forward_s, backward_s), (forward_sc, backward_sc) = (forward, backward), (forward_c, backward_c)
                weight = measured(k, False, False, "F")[0]   # any: the split sizes are never read
            loss = 1.5 * pipe.plan.stages[k].loss_bytes if k == last and loss_fn is None else 0.0
            sizes.append({
                "full": float(forward.net_bytes), "checkpointed": float(forward_c.net_bytes),
                "forward_peak": float(forward.peak_bytes), "forward_peak_checkpointed": float(forward_c.peak_bytes),
                "backward_peak": float(max(backward.peak_bytes, loss)),
                "backward_peak_checkpointed": float(max(backward_c.peak_bytes, loss)),
                "backward_peak_split": float(max(backward_s.peak_bytes, loss)),
                "weight_pending": float(forward_s.net_bytes + backward_s.net_bytes),
                "weight_peak": float(weight.peak_bytes),
                "backward_peak_split_checkpointed": float(max(backward_sc.peak_bytes, loss)),
                "weight_pending_checkpointed": float(forward_sc.net_bytes + backward_sc.net_bytes),
            })
    return sizes
