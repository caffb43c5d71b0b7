"""Step 2, the cost model: what every node of a traced graph costs on a device.

:mod:`~fxpipe.cost.profile` measures (or estimates from FLOPs and a roofline) each node's forward and
backward time and its bytes (on CUDA from whole-graph runs: :mod:`~fxpipe.cost.graph_timing`);
:mod:`~fxpipe.cost.profile_cache` keeps them on disk; :mod:`~fxpipe.cost.devices` describes devices by
numbers (presets). :mod:`fxpipe.cost.cpu` models CPU
workers that share this machine's processors, which GPU users never need. Imports only the front end.
"""
