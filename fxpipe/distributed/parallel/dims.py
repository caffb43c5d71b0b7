"""The degrees of a pipeline composed with data (and later tensor) parallelism, and the named ``DeviceMesh`` of them.

:class:`ParallelDims` is torchtitan's ``ParallelDims`` in small: ``pp`` (the plan's workers), ``dp_replicate``
and ``dp_shard`` (data parallelism: replicas, FSDP2 shards, both = HSDP) and ``tp`` (tensor parallelism).
:meth:`ParallelDims.validate` checks them against the world and the plan before anything is built, with the fix
in the error; :meth:`ParallelDims.build_mesh` makes the ``DeviceMesh``; :meth:`ParallelDims.from_mesh` reads the
degrees (and which data parallelism) back from a mesh the user made.

Mesh dims, in this order: ``("pp", "dp_replicate", "dp_shard", "tp")``. ``build_mesh`` always keeps ``pp`` and,
for a sharded mesh, ``dp_shard`` (so a mesh of ``dp_shard=1`` still says "FSDP2", and one code path runs at
every degree), and drops ``dp_replicate`` and ``tp`` where they are 1. The older replicated form, a dim named
``"dp"`` (``DistributedDataParallel``), is ``ParallelDims(..., sharded=False)``: its mesh is ``("pp", "dp")``.
Data parallelism is read from the names: ``dp`` or ``dp_replicate`` alone: replicate (DDP); ``dp_shard``:
FSDP2; ``dp_replicate`` and ``dp_shard``: HSDP (``fully_shard`` over the 2-D sub-mesh). A mesh ``("pp", "tp")``
has no data parallelism (``dp == 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fxpipe.errors import PlanMismatchError
from solvers.layout import Layout, parse_layout

__all__ = ["DATA_PARALLEL", "MESH_DIMS", "ParallelDims"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
DATA_PARALLEL = ("replicate", "shard", "hsdp")
_FORMS = ("('pp', 'dp') (DistributedDataParallel), ('pp', 'dp_shard') (FSDP2), ('pp', 'dp_replicate', "
          "'dp_shard') (HSDP), each optionally with 'tp' last, or ('pp', 'tp')")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallelism; ``sharded`` says whether data parallelism is FSDP2 (``dp_shard``, HSDP with
    ``dp_replicate``) or DDP replicas (``dp_replicate`` only, the mesh dim named ``"dp"``)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sharded: bool = True
    #: with ``tp`` > 1: the activations between the tensor-parallel blocks sharded by sequence
    #: (:mod:`fxpipe.distributed.parallel.sequence`), as torchtitan and Megatron-LM run tensor parallelism
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be a positive int, got {value!r}")
        if not self.sharded and self.dp_shard != 1:
            raise ValueError(f"dp_shard={self.dp_shard} with sharded=False: replicas (DDP) do not shard; pass "
                             "sharded=True for FSDP2, or put the degree in dp_replicate")

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many shares of the batch (replicas times shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def data_parallel(self) -> str:
        """``"replicate"`` (DDP), ``"shard"`` (FSDP2) or ``"hsdp"`` (FSDP2 shards, replicated)."""
        if not self.sharded:
            return "replicate"
        return "hsdp" if self.dp_replicate > 1 else "shard"

    def dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh's (name, size) dims, as :meth:`build_mesh` makes them (see the module docstring)."""
        if not self.sharded:
            out = [("pp", self.pp), ("dp", self.dp_replicate)]
        else:
            out = [("pp", self.pp)] + ([("dp_replicate", self.dp_replicate)] if self.dp_replicate > 1 else [])
            out.append(("dp_shard", self.dp_shard))
        return tuple(out + ([("tp", self.tp)] if self.tp > 1 else []))

    def validate(self, world: int, workers: int | None = None) -> None:
        """Refuse degrees that do not multiply to ``world`` processes, or a ``pp`` other than the plan's
        ``workers``, naming the fix."""
        if self.world_size != world:
            shown = " x ".join(f"{n}={getattr(self, n)}" for n in MESH_DIMS)
            raise ValueError(f"the degrees {shown} need {self.world_size} processes but the world has {world}: start "
                             f"{self.world_size} (torchrun --nproc-per-node {self.world_size} on one node), or choose "
                             f"degrees whose product is {world}")
        if workers is not None and self.pp != workers:
            fix = (f"pp={workers}, dp={world // (workers * self.tp)}" if world % (workers * self.tp) == 0 else
                   f"a world that is a multiple of {workers * self.tp}")
            raise PlanMismatchError(f"the plan runs on {workers} workers but pp={self.pp}: use {fix}, or plan for "
                                    f"{self.pp} devices")

    def build_mesh(self, device_type: str = "cpu", timeout_s: float | None = None) -> Any:
        """The named ``DeviceMesh`` of these degrees (``torch.distributed`` initialised, world checked). With
        ``timeout_s`` every dim's groups wait at most that long (:mod:`fxpipe.distributed.parallel.bounded`);
        without it, torch's default for the backend (30 minutes for gloo)."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        self.validate(dist.get_world_size())
        names, shape = zip(*self.dims())
        if timeout_s is None:
            return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        from fxpipe.distributed.parallel.bounded import bounded_mesh
        return bounded_mesh(device_type, torch.arange(math.prod(shape)).view(shape), names, timeout_s)

    @classmethod
    def from_spec(cls, spec: str | dict[str, Any], pp: int) -> ParallelDims:
        """The degrees a ``KEY=VALUE,...`` string (or a dict of it, as ``plan.mesh`` holds) names, around a
        pipeline of ``pp`` workers, read by :func:`solvers.layout.parse_layout` as ``fxpipe plan --mesh`` reads it:
        ``pp`` (optional; the plan's), ``dp``, ``tp``, ``dp_mode`` (``shard``: FSDP2, the default;
        ``replicate``: DDP) and ``order`` (``pp-dp-tp`` only), or :class:`ParallelDims`' own ``dp_shard`` and
        ``dp_replicate`` (both: HSDP; ``dp_replicate`` alone: DDP), ``sp`` (sequence parallelism, on where left
        out). ``"dp_shard=2,tp=2"`` on a 2-stage plan is
        ``ParallelDims(pp=2, dp_shard=2, tp=2)``. Raises ``ValueError`` naming the key and the fix."""
        return cls.of(parse_layout(spec), pp, spec)

    @classmethod
    def of(cls, layout: Layout, pp: int, spec: Any = None) -> ParallelDims:
        """The degrees of ``layout`` (:class:`solvers.layout.Layout`: a mesh spelling's, ``spec``, or a plan's) around
        a pipeline of ``pp`` workers; ``ValueError`` for an order the runtime does not run, or a ``pp`` that is
        not the plan's."""
        spec = spec if spec is not None else layout.spec()
        if (layout.order or "pp-dp-tp") != "pp-dp-tp" and layout.dp > 1:
            raise ValueError(f"mesh {spec!r}: order={layout.order}: fxpipe runs the pipeline outermost (pp-dp-tp: "
                             "each pipeline's ranks apart, each tp group's ranks adjacent); pass order=pp-dp-tp")
        if layout.pp is not None and layout.pp != pp:
            raise PlanMismatchError(f"mesh {spec!r}: pp={layout.pp} but the plan runs on {pp} workers: leave pp out "
                                    f"(it is the plan's) or plan for {layout.pp} devices")
        sp = layout.sequence_parallel is not False
        if layout.sharded is False:
            return cls(pp=pp, dp_replicate=layout.dp_replicate, tp=layout.tp, sharded=False, sequence_parallel=sp)
        return cls(pp=pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp,
                   sequence_parallel=sp)

    @classmethod
    def planned(cls, plan: Any) -> ParallelDims | None:
        """The degrees of the mesh ``plan`` was made for (``plan.mesh``: ``fxpipe.plan(mesh=...)``), ``None`` for a
        plan of one pipeline. A ``ValueError`` names what the runtime cannot run of it."""
        return cls.of(plan.layout(), plan.workers) if plan.mesh else None

    @classmethod
    def from_mesh(cls, mesh: Any) -> ParallelDims:
        """The degrees of a mesh named as :meth:`build_mesh` names them (or the DDP form ``("pp", "dp")``)."""
        names = tuple(mesh.mesh_dim_names or ())
        known = {"pp", "dp", *MESH_DIMS}
        dp_names = [n for n in names if n in ("dp", "dp_replicate", "dp_shard")]
        if (len(set(names)) != len(names) or not set(names) <= known or "pp" not in names
                or not (dp_names or "tp" in names) or ("dp" in names and len(dp_names) > 1)):
            raise ValueError(f"mesh must be a DeviceMesh with mesh_dim_names ('pp', 'dp') or another of {_FORMS}, "
                             f"got {mesh.ndim} dimensions named {names}: use init_device_mesh(device, (pp, dp), "
                             "mesh_dim_names=('pp', 'dp')) or ParallelDims(pp=..., dp_shard=...).build_mesh()")
        size = {n: mesh.size(names.index(n)) for n in names}
        return cls(pp=size["pp"], dp_replicate=size.get("dp", size.get("dp_replicate", 1)),
                   dp_shard=size.get("dp_shard", 1), tp=size.get("tp", 1), sharded="dp_shard" in names)

    @staticmethod
    def dp_names(mesh: Any) -> tuple[str, ...]:
        """The mesh's data-parallel dims, outer first."""
        return tuple(n for n in mesh.mesh_dim_names if n in ("dp", "dp_replicate", "dp_shard"))

    @staticmethod
    def dp_ranks(mesh: Any) -> list[list[int]]:
        """This rank's data-parallel ranks (global), as a grid: one row per replica (one row outside HSDP), each
        row the ranks of one shard group; replica-major order is the order of the batch's shares."""
        names = tuple(mesh.mesh_dim_names)
        coordinate = mesh.get_coordinate()
        index = tuple(slice(None) if n in ParallelDims.dp_names(mesh) else coordinate[i] for i, n in enumerate(names))
        grid = mesh.mesh[index]
        grid = grid if grid.ndim == 2 else grid.reshape(1, -1)   # 2-D only for HSDP (replicate, shard)
        return [[int(r) for r in row] for row in grid]

    def __str__(self) -> str:
        parts = [f"{n}={s}" for n, s in self.dims()]
        return f"{' x '.join(parts)} ({self.data_parallel}, {math.prod(s for _, s in self.dims())} processes)"
