"""fxpipe: a pipeline-parallel compiler for PyTorch.

``fxpipe.compile(model, devices, example_inputs=...)`` traces the model with
torch.fx, profiles every node, solves for the optimal contiguous stages with
:mod:`solvers`, emits one stage module per device and returns a
:class:`Pipeline` that runs micro-batches through them.
``fxpipe.plan(model, fxpipe.Devices.preset("h100", 8), example_inputs=...)``
plans for devices this machine does not have, from shapes alone.
"""

__version__ = "0.1.0"

from fxpipe.analytic import plan  # noqa: E402
from fxpipe.compile import compile, parse_devices  # noqa: E402
from fxpipe.devices import Devices, DeviceSpec  # noqa: E402
from fxpipe.errors import (  # noqa: E402
    FxpipeError, InfeasiblePlanError, PlanFormatError, PlanMismatchError, StageError, TraceError,
)
from fxpipe.pipeline import Pipeline  # noqa: E402
from fxpipe.plan import Plan, PlanStage, load_plan  # noqa: E402
from fxpipe.trace import trace  # noqa: E402

__all__ = [
    "DeviceSpec", "Devices", "FxpipeError", "InfeasiblePlanError", "Pipeline", "Plan", "PlanFormatError", "PlanMismatchError",
    "PlanStage", "StageError", "TraceError", "__version__", "compile", "load_plan", "parse_devices", "plan", "trace",
]
