"""Step 3, planning: node costs and devices become a :class:`~fxpipe.planning.plan.Plan`.

:mod:`~fxpipe.planning.lowering` turns the costed graph and the devices' links
(:mod:`~fxpipe.planning.topology`) into a :class:`solvers.Problem`; :mod:`~fxpipe.planning.planner` solves
it with :mod:`solvers` and builds the plan; :mod:`~fxpipe.planning.memory_model` predicts each worker's
memory along the schedule; :mod:`~fxpipe.planning.report` compares a plan with a measured step. Every
optimisation lives in :mod:`solvers`; this package only translates. Imports the front end and the cost model.
"""
