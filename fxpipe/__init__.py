"""fxpipe: a pipeline-parallel compiler for PyTorch.

``fxpipe.compile(model, devices, example_inputs=...)`` traces the model (:mod:`fxpipe.frontend`), costs
every node (:mod:`fxpipe.cost`), solves for the stages with :mod:`solvers` (:mod:`fxpipe.planning`), emits
one stage module per device and returns a :class:`Pipeline` that runs micro-batches through them
(:mod:`fxpipe.runtime`), after refining the plan on measurements of its own stages (:mod:`fxpipe.refine`).
``fxpipe.plan(model, fxpipe.Devices.preset("h100", 8), example_inputs=...)`` plans for devices this
machine does not have, from shapes alone. ``docs/architecture.md`` walks through the packages.
"""

from fxpipe._version import __version__
from fxpipe.analytic import plan
from fxpipe.compile import compile, parse_devices
from fxpipe.cost.devices import Devices, DeviceSpec
from fxpipe.errors import (
    FxpipeError, InfeasiblePlanError, LossReductionError, PlanFormatError, PlanMismatchError, StageError, TraceError,
)
from fxpipe.frontend.trace import trace
from fxpipe.options import CompileOptions, ProfileOptions
from fxpipe.planning.plan import Plan, PlanStage, load_plan
from fxpipe.runtime.execute.asynchronous import AsyncTrainer
from fxpipe.runtime.execute.pipeline import Pipeline

import fxpipe.distributed.torch_pipelining  # noqa: E402,F401  registers Plan.to_torch_pipelining

__all__ = [
    "AsyncTrainer", "CompileOptions", "DeviceSpec", "Devices", "FxpipeError", "InfeasiblePlanError",
    "LossReductionError", "Pipeline", "Plan",
    "PlanFormatError", "PlanMismatchError", "PlanStage", "ProfileOptions", "StageError", "TraceError",
    "__version__", "compile", "load_plan", "parse_devices", "plan", "trace",
]
