"""Step 1 of the data flow, the front end: a model and its example inputs become a ``torch.fx.GraphModule``.

:mod:`~fxpipe.frontend.trace` captures the graph with fxpipe's leaf-module policy and refuses what it
cannot capture faithfully; :mod:`~fxpipe.frontend.fingerprint` names a graph so that a plan is never run
on another model. Imports nothing of fxpipe but :mod:`fxpipe.errors`.
"""
