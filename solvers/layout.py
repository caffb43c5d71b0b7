"""A run's layout (:class:`Layout`), and the one spelling of a mesh: ``"pp=2,dp=4,dp_mode=shard"`` or
``"dp_shard=4"``, as a string or a dict.

:class:`Layout` is the one record of how a step runs: the degrees (pp, dp_replicate, dp_shard, tp), the data
parallel mode, sequence parallelism, the order, the schedule with its virtual stages per device, and each stage's
recomputation. The mesh search returns its choice as one (:func:`solvers.mesh_search.choice_layout`), a plan
gives the one it runs (:meth:`fxpipe.Plan.layout`: its ``mesh`` record, schedule and stages) and the runtime builds
its ``ParallelDims`` from it (:meth:`fxpipe.distributed.parallel.ParallelDims.of`).

``fxpipe plan --mesh`` / ``fxpipe.plan(mesh=...)`` (:func:`fxpipe.planning.mesh_plan.parse_mesh`) and
``python -m fxpipe.launch --mesh`` (:meth:`fxpipe.distributed.parallel.ParallelDims.from_spec`) both read a
mesh with :func:`parse_layout`, so either spelling means the same layout on both:

* ``dp=N`` with ``dp_mode=shard`` (FSDP) or ``dp_mode=replicate`` (DDP); without ``dp_mode`` the mode is
  unsaid (the planner tries both, launch shards);
* ``dp_shard=N`` (FSDP), ``dp_replicate=N`` (DDP), or both (HSDP: replicas of shard groups);
* ``pp`` and ``tp`` (each 1 when left out; ``pp`` left out is :attr:`Layout.pp` ``None``), ``order``
  (``pp-dp-tp`` or ``dp-pp-tp``);
* ``sp`` (``1``/``0``, ``on``/``off``, ``true``/``false``): whether tensor parallelism also shards the activations
  between its blocks by sequence (Megatron-LM's sequence parallelism; on where left out, as torchtitan runs
  tensor parallelism).

Each consumer then refuses what it cannot run (the planner: HSDP; launch: ``order=dp-pp-tp``).
:func:`unrunnable` says which layouts fxpipe's runtime (``fxpipe.distributed.PipelineRank``) does not run, so the
mesh search (:func:`solvers.mesh.mesh_shapes`) enumerates only the ones it does. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["DP_MODES", "KEYS", "ORDERS", "Layout", "mesh_fields", "parse_layout", "unrunnable"]

DP_MODES = ("replicate", "shard")
ORDERS = ("pp-dp-tp", "dp-pp-tp")

KEYS = ("pp", "dp", "tp", "dp_mode", "order", "dp_shard", "dp_replicate", "sp")
EXAMPLE = "e.g. pp=2,dp=4,dp_mode=shard, or dp_shard=4 (FSDP), dp_replicate=4 (DDP), dp_replicate=2,dp_shard=2 (HSDP)"


@dataclass(frozen=True)
class Layout:
    """A run's layout. From a mesh spelling (:func:`parse_layout`) only the degrees are said: ``pp`` ``None`` where
    it was left out, ``sharded`` ``None`` where the data-parallel mode was, ``sequence_parallel`` ``None`` where
    ``sp`` was (on). A plan's or the search's (module docstring) says everything: ``schedule``,
    ``virtual_stages`` (stages per device) and ``recomputation``, each stage's mode in stage order (``"never"``,
    whole stages ``"always"``/``"except_last"``, or per block ``"blocks"``, ``"blocks:K"``, ``"selective"``)."""

    pp: Optional[int] = None
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sharded: Optional[bool] = None
    order: Optional[str] = None
    sequence_parallel: Optional[bool] = None
    schedule: Optional[str] = None
    virtual_stages: int = 1
    recomputation: tuple[str, ...] = ()

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        """Replicas of shard groups, both more than one."""
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def dp_mode(self) -> str:
        """``"replicate"`` (DDP, or no data parallelism) or ``"shard"`` (FSDP2; HSDP's shards)."""
        return "shard" if self.sharded and self.dp_shard > 1 else "replicate"

    def spec(self) -> dict[str, Any]:
        """The degrees as a mesh spelling :func:`parse_layout` reads back to them (``sp`` where tp > 1)."""
        out: dict[str, Any] = {} if self.pp is None else {"pp": self.pp}
        if self.hsdp:
            out.update(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard)
        else:
            out["dp"] = self.dp
            if self.sharded is not None:
                out["dp_mode"] = "shard" if self.sharded else "replicate"
        out["tp"] = self.tp
        if self.order is not None:
            out["order"] = self.order
        if self.tp > 1 and self.sequence_parallel is not None:
            out["sp"] = int(self.sequence_parallel)
        return out

    def __str__(self) -> str:
        parts = [f"pp={self.pp if self.pp is not None else '?'}"]
        parts += ([f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}"] if self.hsdp else
                  [f"dp={self.dp}" + ("(fsdp)" if self.dp > 1 and self.dp_mode == "shard" else "")])
        parts.append(f"tp={self.tp}" + (" sp" if self.tp > 1 and self.sequence_parallel is not False else ""))
        if self.schedule:
            parts.append(self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.recomputation:
            one = len(set(self.recomputation)) == 1
            parts.append("recompute " + (self.recomputation[0] if one else "/".join(self.recomputation)))
        return " ".join(parts)


def unrunnable(dp: int, tp: int, dp_mode: str, order: str) -> Optional[str]:
    """Why fxpipe's runtime does not run a layout of these degrees, mode and order (``None``: it does): it runs the
    pipeline outermost (``pp-dp-tp``), and shards tensor-parallel stages with FSDP2 rather than replicating them
    with DDP."""
    if order != ORDERS[0] and dp > 1:
        return f"order={order}: the runtime runs the pipeline outermost ({ORDERS[0]})"
    if dp_mode == "replicate" and dp > 1 and tp > 1:
        return "DDP over tensor-parallel stages: the runtime shards them with FSDP2 (dp_mode=shard)"
    return None


def mesh_fields(spec: str) -> dict[str, str]:
    """``"pp=2,dp=4,tp=1"`` -> ``{"pp": "2", "dp": "4", "tp": "1"}``; ``ValueError`` for a part without ``=``."""
    fields = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"mesh {spec!r}: {part!r} is not KEY=VALUE; write e.g. mesh='pp=2,dp=4,tp=1'")
        fields[key.strip()] = value.strip()
    return fields


def parse_layout(spec: Any) -> Layout:
    """The :class:`Layout` a ``KEY=VALUE,...`` string or a dict of the keys :data:`KEYS` names (module
    docstring); ``ValueError`` naming the key, the accepted keys and an example."""
    if not isinstance(spec, (str, dict)):
        raise TypeError(f"mesh must be a string like 'pp=2,dp=4,tp=1' or a dict of it, got {spec!r}")
    fields = dict(mesh_fields(spec) if isinstance(spec, str) else spec)
    unknown = sorted(set(fields) - set(KEYS), key=str)
    if unknown:
        raise ValueError(f"mesh {spec!r}: unknown key(s) {unknown}; the keys are {', '.join(KEYS)} ({EXAMPLE})")
    size = _sizes(spec, fields)
    mode, order = fields.get("dp_mode"), fields.get("order")
    if "dp" in size and ({"dp_shard", "dp_replicate"} & set(size)):
        raise ValueError(f"mesh {spec!r}: give dp (with dp_mode) or dp_shard/dp_replicate, not both ({EXAMPLE})")
    if mode not in (None, "shard", "replicate") or (mode is not None and {"dp_shard", "dp_replicate"} & set(size)):
        raise ValueError(f"mesh {spec!r}: dp_mode is shard (FSDP2) or replicate (DDP), and goes with dp only "
                         "(dp_shard and dp_replicate name their mode)")
    if order is not None and order not in ORDERS:
        raise ValueError(f"mesh {spec!r}: order must be one of {', '.join(ORDERS)}, got {order!r}")
    common = {"pp": size.get("pp"), "tp": size.get("tp", 1), "order": order,
              "sequence_parallel": _switch(spec, fields.get("sp"))}
    if "dp_shard" in size or "dp_replicate" in size:
        return Layout(dp_replicate=size.get("dp_replicate", 1), dp_shard=size.get("dp_shard", 1),
                      sharded="dp_shard" in size, **common)
    dp = size.get("dp", 1)
    if mode == "replicate":
        return Layout(dp_replicate=dp, sharded=False, **common)
    return Layout(dp_shard=dp, sharded=None if mode is None else True, **common)


_ON, _OFF = ("1", "on", "true"), ("0", "off", "false")


def _switch(spec: Any, value: Any) -> Optional[bool]:
    """``sp``'s value as a bool (``None`` where it is left out); ``ValueError`` naming the spellings."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in _ON + _OFF:
        raise ValueError(f"mesh {spec!r}: sp is 1 or 0 (on/off, true/false: sequence parallelism), got {value!r}")
    return text in _ON


def _sizes(spec: Any, fields: dict[str, Any]) -> dict[str, int]:
    """The degrees among ``fields``, as positive ints."""
    names = ("pp", "dp", "tp", "dp_shard", "dp_replicate")
    try:
        size = {k: int(fields[k]) for k in names if k in fields}
    except (TypeError, ValueError):
        raise ValueError(f"mesh {spec!r}: pp, dp, tp, dp_shard and dp_replicate must be integers ({EXAMPLE})") from None
    small = sorted(k for k, v in size.items() if v < 1)
    if small:
        raise ValueError(f"mesh {spec!r}: {', '.join(small)} must be at least 1 ({EXAMPLE})")
    return size
