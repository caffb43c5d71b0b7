"""Steps 4 and 5, codegen and run: a plan becomes stage modules, and micro-batches flow through them.

Grouped by concern, one subpackage each:

- :mod:`~fxpipe.runtime.execute`: executing an order. :mod:`~fxpipe.runtime.execute.codegen` emits one
  ``GraphModule`` per stage; :mod:`~fxpipe.runtime.execute.pipeline` is the
  :class:`~fxpipe.runtime.execute.pipeline.Pipeline` users call; :mod:`~fxpipe.runtime.execute.step` interprets a
  schedule (GPipe, 1F1B, interleaved, ZB-H1, ...) on :mod:`~fxpipe.runtime.execute.worker` threads. What the
  machine adds (CPU workers taking turns) comes in through :mod:`~fxpipe.runtime.execute.host`.
- :mod:`~fxpipe.runtime.backward`: backward, split backward (:mod:`~fxpipe.runtime.backward.split_backward`) and
  recomputation (whole stages, per block, and the random draws it replays: :mod:`~fxpipe.runtime.backward.rng`).
- :mod:`~fxpipe.runtime.losses`: how the micro-batches' losses make the step's, ``reduction="auto"`` included,
  and the model's own loss.
- :mod:`~fxpipe.runtime.boundaries`: what crosses between stages: transport, CUDA streams, compression, aliasing
  and tied weights.
- :mod:`~fxpipe.runtime.checks`: guards and checks: the inputs and parameters at each call, micro-batching at
  compile time, the train/eval mode the graph was traced in.

The subpackages import each other's modules directly (none re-exports). Imports planning and below.
"""
