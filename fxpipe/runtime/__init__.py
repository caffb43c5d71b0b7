"""Steps 4 and 5, codegen and run: a plan becomes stage modules, and micro-batches flow through them.

:mod:`~fxpipe.runtime.codegen` emits one ``GraphModule`` per stage; :mod:`~fxpipe.runtime.pipeline` is the
:class:`~fxpipe.runtime.pipeline.Pipeline` users call; :mod:`~fxpipe.runtime.step` interprets a schedule
(GPipe, 1F1B, interleaved, ZB-H1) on :mod:`~fxpipe.runtime.worker` threads with
:mod:`~fxpipe.runtime.streams`, :mod:`~fxpipe.runtime.split_backward`, :mod:`~fxpipe.runtime.batchnorm` and
:mod:`~fxpipe.runtime.rng`. What the machine adds (CPU workers taking turns) comes in through
:mod:`~fxpipe.runtime.host`. Imports planning and below.
"""
