"""Boundaries, transport and streams: what crosses between stages, how, and what must not be written there.

:mod:`~fxpipe.runtime.boundaries.transport` moves values and gradients between stages (the executor's only
contact with where they live) on :mod:`~fxpipe.runtime.boundaries.streams` (a compute and a copy stream per
device), optionally compressed (:mod:`~fxpipe.runtime.boundaries.compression`);
:mod:`~fxpipe.runtime.boundaries.aliasing` says which values share memory and which nodes write into a value
(a stage writes nothing it received); :mod:`~fxpipe.runtime.boundaries.tied` gives a parameter several stages
read a copy on each, its gradients summed once per step.
"""
