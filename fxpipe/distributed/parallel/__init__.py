"""Parallelism inside a pipeline stage, on the dimensions of a ``DeviceMesh`` other than ``pp``
(tensor parallelism: :mod:`fxpipe.distributed.parallel.tp`)."""
