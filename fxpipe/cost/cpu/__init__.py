"""CPU workers sharing the processors: how much slower they run together, and the turns they take.

Only CPU "devices" (worker threads of one process) need this. The runtime sees none of it: it asks a
host (:class:`fxpipe.runtime.execute.host.Host`) whether an operation may run now, and :class:`CpuHost` is the
host that answers with turns (:mod:`~fxpipe.cost.cpu.turns`) and describes the sharing
(:mod:`~fxpipe.cost.cpu.sharing`) for the report's simulation.
"""

from fxpipe.cost.cpu.host import CpuHost
from fxpipe.cost.cpu.sharing import CpuSharing, cores_per_worker, cpu_sharing, processors
from fxpipe.cost.cpu.turns import CoreTurns

__all__ = ["CoreTurns", "CpuHost", "CpuSharing", "cores_per_worker", "cpu_sharing", "processors"]
