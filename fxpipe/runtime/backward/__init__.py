"""Backward, split backward and recomputation: how a stage's gradients are computed, and its forward replayed.

:mod:`~fxpipe.runtime.backward.split_backward` splits a stage's backward into input gradients now and weight
gradients later (the zero-bubble schedules); :mod:`~fxpipe.runtime.backward.input_grads` hands the gradients of
inputs that carry the caller's graph on, once. Recomputation: :mod:`~fxpipe.runtime.backward.recompute` (a
checkpointed stage whose replay sees the forward's buffers and changes none),
:mod:`~fxpipe.runtime.backward.block_recompute` (per-block and selective recomputation),
:mod:`~fxpipe.runtime.backward.block_units` (each block a module of its own, FSDP2's units, recomputing inside
them) and :mod:`~fxpipe.runtime.backward.rng` (random stages whose recomputation replays the same draws).
"""
