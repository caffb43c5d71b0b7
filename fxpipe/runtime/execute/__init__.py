"""Executing an order: the stages built from a plan, and the operations of a call or step run on their workers.

:mod:`~fxpipe.runtime.execute.assemble` and :mod:`~fxpipe.runtime.execute.codegen` turn a graph and a plan into
stage modules (:mod:`~fxpipe.runtime.execute.compiled`: each ``torch.compile``'d in place);
:mod:`~fxpipe.runtime.execute.pipeline` is the :class:`~fxpipe.runtime.execute.pipeline.Pipeline` users call, its
``pipe(x)`` a fill-drain forward (:mod:`~fxpipe.runtime.execute.fill_drain`) and its ``pipe.step`` the schedule
interpreter of :mod:`~fxpipe.runtime.execute.step` (:mod:`~fxpipe.runtime.execute.step_board`: what its workers
share) on :mod:`~fxpipe.runtime.execute.worker` threads; :mod:`~fxpipe.runtime.execute.asynchronous` runs the same
interpreter without a flush. Around them: a call bound to the graph and split into micro-batches
(:mod:`~fxpipe.runtime.execute.call_inputs`, :mod:`~fxpipe.runtime.execute.microbatch`), the model's own output
containers (:mod:`~fxpipe.runtime.execute.structure`), the caller's grad mode and autocast in the workers
(:mod:`~fxpipe.runtime.execute.caller_state`), BatchNorm statistics once per mini-batch
(:mod:`~fxpipe.runtime.execute.batchnorm`), what the caller is told when a stage fails
(:mod:`~fxpipe.runtime.execute.failures`), what the machine adds (:mod:`~fxpipe.runtime.execute.host`), and
measurements that replay a worker's order (:mod:`~fxpipe.runtime.execute.memory_probe`) leaving no trace
(:mod:`~fxpipe.runtime.execute.no_trace`).
"""
