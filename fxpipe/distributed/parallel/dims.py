"""The runtime's part of a layout: the named ``DeviceMesh`` of a :class:`solvers.layout.Layout`, and its groups.

:class:`ParallelDims` holds one :class:`~solvers.layout.Layout` (the degrees ``pp``, ``dp_replicate``,
``dp_shard``, ``tp``, the data-parallel mode, sequence parallelism: the record the planner chose and the plan
stores) and adds only what the runtime needs: :meth:`ParallelDims.build_mesh` makes the ``DeviceMesh``,
:meth:`ParallelDims.from_mesh` reads the layout back from a mesh the user made, :meth:`ParallelDims.dp_ranks`
reads the data-parallel groups. The rules (world size, the plan's workers, the order, DDP over tensor
parallelism) are :func:`solvers.layout.refusal`'s, asked by :meth:`ParallelDims.of` and
:meth:`ParallelDims.validate`.

Mesh dims, in this order: ``("pp", "dp_replicate", "dp_shard", "tp")``. ``build_mesh`` always keeps ``pp`` and,
for a sharded mesh, ``dp_shard`` (so a mesh of ``dp_shard=1`` still says "FSDP2", and one code path runs at
every degree), and drops ``dp_replicate`` and ``tp`` where they are 1. The replicated form, a dim named
``"dp"`` (``DistributedDataParallel``), is ``dp_mode="replicate"``: its mesh is ``("pp", "dp")``.
Data parallelism is read from the names: ``dp`` or ``dp_replicate`` alone: replicate (DDP); ``dp_shard``:
FSDP2; ``dp_replicate`` and ``dp_shard``: HSDP (``fully_shard`` over the 2-D sub-mesh). A mesh ``("pp", "tp")``
has no data parallelism (``dp == 1``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from fxpipe.errors import PlanMismatchError
from solvers.layout import Layout, LayoutError, check_layout, parse_layout

__all__ = ["DATA_PARALLEL", "MESH_DIMS", "ParallelDims"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
DATA_PARALLEL = ("replicate", "shard", "hsdp")
_FORMS = ("('pp', 'dp') (DistributedDataParallel), ('pp', 'dp_shard') (FSDP2), ('pp', 'dp_replicate', "
          "'dp_shard') (HSDP), each optionally with 'tp' last, or ('pp', 'tp')")


@dataclass(frozen=True, init=False)
class ParallelDims:
    """A :class:`~solvers.layout.Layout` as the runtime runs it: ``ParallelDims(layout)``, or of degrees as
    torchtitan spells them, ``ParallelDims(pp=2, dp_shard=2, tp=2)`` (``dp_mode="shard"``, FSDP2, unless
    ``dp_mode="replicate"``: DDP replicas of ``dp_replicate``). Its degrees are the layout's."""

    layout: Layout

    def __init__(self, layout: Optional[Layout] = None, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1,
                 tp: int = 1, dp_mode: str = "shard", sequence_parallel: bool = True) -> None:
        if layout is None:
            layout = Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, dp_mode=dp_mode,
                            sequence_parallel=sequence_parallel)
        if layout.pp is None:
            raise LayoutError(f"ParallelDims of {layout}: pp is unsaid; pass the plan's (ParallelDims.of(layout, "
                              "pp))", "degree")
        runs = {"dp_mode": layout.dp_mode or "shard",   # unsaid: FSDP2, as launch runs it
                "sequence_parallel": layout.sequence_parallel is not False}
        object.__setattr__(self, "layout", dataclasses.replace(layout.degrees(), **runs))

    pp = property(lambda self: self.layout.pp, doc="Pipeline degree: the plan's workers.")
    dp_replicate = property(lambda self: self.layout.dp_replicate, doc="DDP replicas (HSDP: of shard groups).")
    dp_shard = property(lambda self: self.layout.dp_shard, doc="FSDP2 shards.")
    tp = property(lambda self: self.layout.tp, doc="Tensor-parallel degree.")
    dp_mode = property(lambda self: self.layout.dp_mode, doc='``"shard"`` (FSDP2, HSDP) or ``"replicate"`` (DDP).')
    sequence_parallel = property(lambda self: bool(self.layout.sequence_parallel),
                                 doc="With ``tp`` > 1: the activations between the tensor-parallel blocks sharded "
                                     "by sequence (:mod:`fxpipe.distributed.parallel.sequence`).")

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many shares of the batch (replicas times shards)."""
        return self.layout.dp

    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def data_parallel(self) -> str:
        """``"replicate"`` (DDP), ``"shard"`` (FSDP2) or ``"hsdp"`` (FSDP2 shards, replicated)."""
        return self.layout.data_parallel

    def dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh's (name, size) dims, as :meth:`build_mesh` makes them (see the module docstring)."""
        if self.dp_mode == "replicate":
            out = [("pp", self.pp), ("dp", self.dp_replicate)]
        else:
            out = [("pp", self.pp)] + ([("dp_replicate", self.dp_replicate)] if self.dp_replicate > 1 else [])
            out.append(("dp_shard", self.dp_shard))
        return tuple(out + ([("tp", self.tp)] if self.tp > 1 else []))

    def validate(self, world: int, workers: int | None = None) -> None:
        """Refuse degrees that do not multiply to ``world`` processes, or a ``pp`` other than the plan's
        ``workers``, naming the fix (:func:`solvers.layout.refusal`; ``PlanMismatchError`` for the workers)."""
        try:
            check_layout(self.layout, world=world, workers=workers, runtime=False)
        except LayoutError as exc:
            raise (PlanMismatchError(str(exc)) if exc.rule == "workers" else exc) from None

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
        a pipeline of ``pp`` workers, checked by :func:`solvers.layout.refusal` as the runtime runs it:
        ``ValueError`` for an order or a DDP over tensor parallelism it does not run, ``PlanMismatchError`` for a
        ``pp`` that is not the plan's."""
        spec = spec if spec is not None else layout.spec()
        try:
            check_layout(layout, workers=pp)
        except LayoutError as exc:
            raise (PlanMismatchError if exc.rule == "workers" else ValueError)(f"mesh {spec!r}: {exc}") from None
        return cls(dataclasses.replace(layout, pp=pp))

    @classmethod
    def planned(cls, plan: Any) -> ParallelDims | None:
        """The degrees of the layout ``plan`` was made for (``plan.layout``), ``None`` for a plan of one pipeline
        (dp and tp 1). A ``ValueError`` names what the runtime cannot run of it."""
        layout = plan.layout
        return None if layout.dp == 1 and layout.tp == 1 else cls.of(layout, plan.workers)

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
                   dp_shard=size.get("dp_shard", 1), tp=size.get("tp", 1),
                   dp_mode="shard" if "dp_shard" in names else "replicate")

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
