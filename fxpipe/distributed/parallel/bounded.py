"""A ``DeviceMesh`` whose every process group's waits end after ``timeout_s``: no collective of a mesh dim hangs.

``init_device_mesh`` makes each dim's groups with ``new_group`` and no timeout, so their waits end after torch's
default for the backend (``default_pg_timeout``, 30 minutes for gloo; 10 for NCCL), not after the default process
group's timeout and not after a rank's ``timeout_s`` (seen with torch 2.15: a ``("pp", "tp")`` mesh's groups
report ``0:30:00`` under a default group made with 60 s). torch's own way to give them a timeout is the mesh's
``backend_override`` (per dim, a ``Backend.Options`` whose ``_timeout`` the groups are made with), used here:

- :func:`bounded_mesh` makes a mesh of the given ranks and dim names with it (:meth:`ParallelDims.build_mesh`
  with ``timeout_s``, and :class:`fxpipe.distributed.PipelineRank` for a user's mesh whose groups wait
  longer);
- :func:`mesh_timeout_s` reads the longest timeout of a mesh's groups (``None`` where the backend does not say).

Only a mesh whose dims are sliced from one root needs it: FSDP2 over tensor parallelism (``("pp", "dp_shard",
"tp")``) requires both sub-meshes to come from one root, so their groups are the root's; everywhere else fxpipe
makes groups of its own with ``timeout_s`` (:func:`fxpipe.distributed.parallel.fsdp.dp_mesh`,
:func:`fxpipe.distributed.parallel.tp.tp_mesh_of`, the transport's).
"""

from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["bounded_mesh", "mesh_timeout_s"]


def _options(timeout: datetime.timedelta) -> Any:
    """Backend options that carry ``timeout`` (NCCL's own type where the default group is NCCL: its groups are
    split from it with these options)."""
    backend = dist.get_backend()
    if "nccl" in backend and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    from torch._C._distributed_c10d import Backend as C10dBackend
    return C10dBackend.Options("gloo" if "gloo" in backend else backend, timeout)


def bounded_mesh(device_type: str, ranks: torch.Tensor | Sequence[Any], names: Sequence[str], timeout_s: float) -> Any:
    """The ``DeviceMesh`` of ``ranks`` (an n-D layout of global ranks, every rank of the world in it) with dims
    ``names``, each dim's groups made with ``timeout_s`` as their timeout. Collective: every rank calls it."""
    from torch.distributed.device_mesh import DeviceMesh
    ranks = torch.as_tensor(ranks, dtype=torch.int)
    if ranks.numel() != dist.get_world_size():
        raise ValueError(f"a mesh of {ranks.numel()} ranks in a world of {dist.get_world_size()}: a mesh whose groups "
                         "wait timeout_s is made by every rank of the world; make it over all of them")
    options = _options(datetime.timedelta(seconds=timeout_s))
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names),
                      backend_override=tuple((None, options) for _ in names))


def mesh_timeout_s(mesh: Any) -> float | None:
    """The longest timeout of ``mesh``'s dims' groups, in seconds; ``None`` where a backend does not say."""
    longest = 0.0
    for name in mesh.mesh_dim_names or range(mesh.ndim):
        try:
            backend = mesh.get_group(name)._get_backend(torch.device(mesh.device_type))
            longest = max(longest, backend.options._timeout.total_seconds())
        except (AttributeError, RuntimeError, TypeError):
            return None
    return longest
