"""Guards and checks: a pipeline refuses to compute something other than the model it was compiled from.

:mod:`~fxpipe.runtime.checks.guards` checks every call's inputs and the model's parameters;
:mod:`~fxpipe.runtime.checks.batch_check` checks once per compile that splitting the batch computes the model;
:mod:`~fxpipe.runtime.checks.traced_mode` refuses (or warns about) a graph run in another train/eval mode than it
was traced in.
"""
