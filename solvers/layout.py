"""A run's layout (:class:`Layout`), the rules a layout must keep (:func:`refusal`), and the one spelling of a
mesh: ``"pp=2,dp=4,dp_mode=shard"`` or ``"dp_shard=4"``, as a string or a dict.

:class:`Layout` is the one record of how a step runs, from the search to the ranks: the degrees (pp,
dp_replicate, dp_shard, tp), the data-parallel mode, the order, sequence parallelism, the schedule with its
virtual stages per device, each stage's recomputation, and the precision (:data:`PRECISIONS`: the dtype the
parameters and the optimizer's state are kept in and the one the forward and backward compute in). The mesh search enumerates layouts
(:func:`solvers.mesh.mesh_shapes`: :meth:`Layout.of` each shape) and returns its choice as one
(:func:`solvers.mesh_search.choice_layout`); a plan stores the one it runs whole (``plan.layout``, the plan
JSON's ``layout``: :meth:`Layout.to_dict`); the ranks build their ``DeviceMesh`` from it
(:class:`fxpipe.distributed.parallel.ParallelDims`, which holds a Layout and nothing else of the degrees).

One spelling for each field: the data-parallel mode is :attr:`Layout.dp_mode` (``"shard"``: FSDP2, HSDP
with ``dp_replicate`` > 1; ``"replicate"``: DDP; ``None``: not said, which only a mesh spelling leaves);
recomputation is one of :data:`RECOMPUTATION` per stage (``"always"``: the whole stage, every micro-batch);
precision is one of :data:`PRECISIONS` (``"bf16-mixed"``: float32 parameters, gradients and optimizer state,
bfloat16 compute, :mod:`fxpipe.frontend.precision`; ``None``: not said, the model's own dtype).

``fxpipe plan --mesh`` / ``fxpipe.plan(mesh=...)`` and ``python -m fxpipe.launch --mesh`` /
``PipelineRank(mesh=...)`` all read a mesh with :func:`parse_layout`, so either spelling means the same layout:

* ``dp=N`` with ``dp_mode=shard`` (FSDP) or ``dp_mode=replicate`` (DDP); without ``dp_mode`` the mode is
  unsaid (the planner tries both, launch shards);
* ``dp_shard=N`` (FSDP), ``dp_replicate=N`` (DDP), or both (HSDP: replicas of shard groups);
* ``pp`` and ``tp`` (each 1 when left out; ``pp`` left out is :attr:`Layout.pp` ``None``), ``order``
  (``pp-dp-tp`` or ``dp-pp-tp``);
* ``sp`` (``1``/``0``, ``on``/``off``, ``true``/``false``): whether tensor parallelism also shards the activations
  between its blocks by sequence (Megatron-LM's sequence parallelism; on where left out, as torchtitan runs
  tensor parallelism);
* ``ep`` (expert parallelism): the experts of each mixture-of-experts layer sharded over ``ep`` ranks that exchange
  their tokens (all-to-all). As in torchtitan and Megatron-Core, ``ep`` borrows data-parallel ranks rather than
  multiplying the world: it divides ``dp`` (``dp`` left out is ``ep``, sharded), each of the ``ep`` ranks computes
  its own share of the batch, and the expert parameters are replicated or sharded over the ``dp / ep`` ranks left.

The rules (:func:`refusal`, one function: every entry point asks it and raises its own error type) are the
world size (the degrees multiply to the processes or devices), the plan's workers (``pp`` is the plan's),
the batch (it splits evenly over ``dp``), the experts (``ep`` divides ``dp`` and every MoE layer's experts), and, for the runtime (``fxpipe.distributed.PipelineRank``), the
order (the pipeline outermost) and no DDP over tensor parallelism; the mesh search enumerates only what the
runtime runs. A new mesh dimension is a degree field here, its rule in :func:`refusal`, its key in
:func:`parse_layout`, and one apply function in :mod:`fxpipe.distributed.parallel` (``docs/architecture.md``).
Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["DP_MODES", "KEYS", "ORDERS", "PRECISIONS", "RECOMPUTATION", "Layout", "LayoutError", "Refusal", "check_layout",
           "ep_message", "is_recomputation", "mesh_fields", "parse_layout", "refusal"]

DP_MODES = ("replicate", "shard")
ORDERS = ("pp-dp-tp", "dp-pp-tp")
#: a stage's recomputation: none, the whole stage (every micro-batch), each block, every other block, the
#: cheap parts of each block (:func:`fxpipe.planning.memory_model.block_mode`)
RECOMPUTATION = ("never", "always", "except_last", "blocks", "blocks:2", "selective")
#: what the parameters (with their gradients and the optimizer's state) are kept in and what the step computes
#: in: one dtype for both (the model as it is built), or float32 kept and bfloat16 computed (``"bf16-mixed"``)
PRECISIONS = ("fp32", "bf16", "fp16", "fp64", "bf16-mixed")


def is_recomputation(mode: Any) -> bool:
    """One of :data:`RECOMPUTATION`, or ``"blocks:K"`` (every K-th block) for a K of at least one."""
    if mode in RECOMPUTATION:
        return True
    head, _, k = str(mode).partition(":")
    return head == "blocks" and k.isdigit() and int(k) >= 1


KEYS = ("pp", "dp", "tp", "dp_mode", "order", "dp_shard", "dp_replicate", "sp", "ep")
EXAMPLE = ("e.g. pp=2,dp=4,dp_mode=shard, or dp_shard=4 (FSDP), dp_replicate=4 (DDP), dp_replicate=2,dp_shard=2 (HSDP), "
           "pp=2,ep=2 (experts over 2 data-parallel ranks)")
DEGREES = ("pp", "dp_replicate", "dp_shard", "tp", "ep")


class LayoutError(ValueError):
    """A layout breaks one of the rules (:func:`refusal`); ``rule`` names which."""

    def __init__(self, message: str, rule: str = "") -> None:
        super().__init__(message)
        self.rule = rule


@dataclass(frozen=True)
class Layout:
    """A run's layout (module docstring). From a mesh spelling (:func:`parse_layout`) only the degrees are said:
    ``pp`` ``None`` where it was left out, ``dp_mode`` ``None`` where the mode was, ``sequence_parallel`` ``None``
    where ``sp`` was (on). A plan's or the search's says everything: ``schedule``, ``virtual_stages`` (stages per
    device), ``recomputation``, each stage's mode (:data:`RECOMPUTATION`) in stage order, and ``precision``
    (:data:`PRECISIONS`; ``None`` in a plan of an older format: the model's own dtype). ``ep`` (expert
    parallelism) is a degree that borrows data-parallel ranks: it does not count in :attr:`world`."""

    pp: Optional[int] = None
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    dp_mode: Optional[str] = None
    order: str = ORDERS[0]
    sequence_parallel: Optional[bool] = None
    schedule: Optional[str] = None
    virtual_stages: int = 1
    recomputation: tuple[str, ...] = ()
    precision: Optional[str] = None
    ep: int = 1

    def __post_init__(self) -> None:
        for name in DEGREES:
            value = getattr(self, name)
            if value is None and name == "pp":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"Layout.{name} must be a positive int, got {value!r}", "degree")
        if self.dp_mode not in (None, *DP_MODES):
            raise LayoutError(f"Layout.dp_mode is one of {DP_MODES} (or None: unsaid), got {self.dp_mode!r}", "mode")
        if self.dp_mode != "shard" and self.dp_replicate > 1 and self.dp_shard > 1:
            raise LayoutError(f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} is HSDP, whose mode is "
                              "shard (FSDP2 shards, replicated)", "mode")
        if self.dp_mode == "replicate" and self.dp_shard != 1:
            raise LayoutError(f"dp_shard={self.dp_shard} with dp_mode='replicate': replicas (DDP) do not shard; use "
                              "dp_mode='shard' for FSDP2, or put the degree in dp_replicate", "mode")
        if self.dp_mode is None and self.dp_replicate != 1:
            raise LayoutError(f"dp_replicate={self.dp_replicate} names its mode: pass dp_mode='replicate' (DDP) or "
                              "'shard' (HSDP)", "mode")
        if self.order not in ORDERS:
            raise LayoutError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}", "order")
        bad = [m for m in self.recomputation if not is_recomputation(m)]
        if bad:
            raise LayoutError(f"recomputation {bad[0]!r} is not one of {RECOMPUTATION} (blocks:K for every K-th "
                              "block)", "recomputation")
        object.__setattr__(self, "recomputation", tuple(self.recomputation))
        if self.precision not in (None, *PRECISIONS):
            raise LayoutError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}", "precision")
        if self.dp % self.ep:
            raise LayoutError(ep_message(self.ep, self.dp, self.pp, self.tp), "ep")

    @classmethod
    def of(cls, pp: int, dp: int, tp: int, dp_mode: str = "replicate", order: str = ORDERS[0],
           ep: int = 1) -> "Layout":
        """The layout of a mesh shape of the search: ``dp`` ranks replicated (DDP) or sharded (FSDP2), ``ep`` of
        them holding each its share of the experts."""
        shard = dp_mode == "shard"
        return cls(pp=pp, dp_replicate=1 if shard else dp, dp_shard=dp if shard else 1, tp=tp, dp_mode=dp_mode,
                   order=order, ep=ep)

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        """Replicas of shard groups, both more than one."""
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def world(self) -> int:
        """The processes (devices) it runs on: the product of the degrees (``pp`` left out counts 1)."""
        return (self.pp or 1) * self.dp * self.tp

    @property
    def data_parallel(self) -> str:
        """``"replicate"`` (DDP, or none), ``"shard"`` (FSDP2) or ``"hsdp"`` (FSDP2 shards, replicated)."""
        if self.dp_mode != "shard":
            return "replicate"
        return "hsdp" if self.dp_replicate > 1 else "shard"

    def degrees(self) -> "Layout":
        """The degrees, mode, order, sequence parallelism and precision alone (what a layout says beyond a plan's
        schedule, stages and recomputation)."""
        return Layout(self.pp, self.dp_replicate, self.dp_shard, self.tp, self.dp_mode, self.order,
                      self.sequence_parallel, precision=self.precision, ep=self.ep)

    def label(self) -> str:
        """``pp=2 dp=4(fsdp) tp=1`` (``dp-outer`` for that order): the shape, as the mesh tables show it."""
        dp = f"dp={self.dp}" + ("(fsdp)" if self.dp_mode == "shard" and self.dp > 1 else "")
        return (f"pp={self.pp} {dp} tp={self.tp}" + (f" ep={self.ep}" if self.ep > 1 else "")
                + (" dp-outer" if self.order == "dp-pp-tp" else ""))

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON (the plan's ``layout``); :meth:`from_dict` reads it back."""
        doc = asdict(self)
        doc["recomputation"] = list(self.recomputation)
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "Layout":
        """The record :meth:`to_dict` wrote; ``LayoutError`` for an unknown field."""
        unknown = sorted(set(doc) - set(cls.__dataclass_fields__))
        if unknown:
            raise LayoutError(f"layout field(s) {unknown} unknown; the fields are {', '.join(cls.__dataclass_fields__)}",
                              "field")
        return cls(**{**doc, "recomputation": tuple(doc.get("recomputation", ()))})

    def spec(self) -> dict[str, Any]:
        """The degrees as a mesh spelling :func:`parse_layout` reads back to them (``sp`` where tp > 1)."""
        out: dict[str, Any] = {} if self.pp is None else {"pp": self.pp}
        if self.hsdp:
            out.update(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard)
        else:
            out["dp"] = self.dp
            if self.dp_mode is not None:
                out["dp_mode"] = self.dp_mode
        out["tp"] = self.tp
        if self.order != ORDERS[0]:
            out["order"] = self.order
        if self.tp > 1 and self.sequence_parallel is not None:
            out["sp"] = int(self.sequence_parallel)
        if self.ep > 1:
            out["ep"] = self.ep
        return out

    def __str__(self) -> str:
        parts = [f"pp={self.pp if self.pp is not None else '?'}"]
        parts += ([f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}"] if self.hsdp else
                  [f"dp={self.dp}" + ("(fsdp)" if self.dp > 1 and self.dp_mode == "shard" else "")])
        parts.append(f"tp={self.tp}" + (" sp" if self.tp > 1 and self.sequence_parallel is not False else ""))
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.schedule:
            parts.append(self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.recomputation:
            one = len(set(self.recomputation)) == 1
            parts.append("recompute " + (self.recomputation[0] if one else "/".join(self.recomputation)))
        return " ".join(parts)


@dataclass(frozen=True)
class Refusal:
    """Why a layout cannot run: ``rule`` (``"world"``, ``"workers"``, ``"batch"``, ``"order"``, ``"ddp_tp"``,
    ``"experts"``) and the message, which names the fix."""

    rule: str
    message: str

    def error(self) -> LayoutError:
        return LayoutError(self.message, self.rule)


def refusal(layout: Layout, *, world: Optional[int] = None, workers: Optional[int] = None,
            batch: Optional[int] = None, runtime: bool = True,
            experts: Optional[dict[str, int]] = None) -> Optional[Refusal]:
    """The first rule ``layout`` breaks, or ``None``: its degrees multiply to ``world`` processes; its ``pp`` (where
    said) is the plan's ``workers``; ``batch`` samples split evenly over its ``dp``; its ``ep`` divides each
    mixture-of-experts layer's expert count (``experts``: the layer's path -> its experts); and with ``runtime``
    (what fxpipe's ranks run) the pipeline is outermost and tensor-parallel stages are not replicated with DDP."""
    if layout.ep > 1:
        found = _experts_refusal(layout, experts, runtime)
        if found is not None:
            return found
    if runtime and layout.order != ORDERS[0] and layout.dp > 1:
        return Refusal("order", f"order={layout.order}: fxpipe runs the pipeline outermost ({ORDERS[0]}: each "
                                f"pipeline's ranks apart, each tp group's ranks adjacent); pass order={ORDERS[0]}")
    if runtime and layout.dp_mode == "replicate" and layout.dp > 1 and layout.tp > 1:
        return Refusal("ddp_tp", "DDP over tensor-parallel stages (dp_mode=replicate with tp > 1), which fxpipe does "
                                 "not run: shard them with FSDP2 instead (dp_mode=shard, or dp_shard=N)")
    if workers is not None and layout.pp is not None and layout.pp != workers:
        rest = layout.tp * workers
        fix = (f"use pp={workers}, dp={world // rest}" if world and world % rest == 0 else "leave pp out (it is "
               "the plan's)")
        return Refusal("workers", f"the plan runs on {workers} workers but pp={layout.pp}: {fix}, or plan for "
                                  f"{layout.pp} devices")
    if world is not None and layout.world != world:
        pp = layout.pp if layout.pp is not None else workers
        shown = " x ".join(f"{n}={getattr(layout, n) if n != 'pp' else pp}" for n in DEGREES if n != "ep")
        need = (pp or 1) * layout.dp * layout.tp
        return Refusal("world", f"the degrees {shown} multiply to {need} but there are {world} devices "
                                f"(processes): choose degrees whose product is {world}, or start {need} (torchrun "
                                f"--nproc-per-node {need} on one node)")
    if batch is not None and batch % layout.dp:
        return Refusal("batch", f"the batch of {batch} samples does not split evenly over dp={layout.dp} replicas; "
                                f"pass a batch that is a multiple of {layout.dp}")
    return None


def ep_message(ep: int, dp: int, pp: Optional[int], tp: int) -> str:
    """Why ``ep`` cannot borrow ranks of ``dp``, with the degrees that would hold it."""
    return (f"ep={ep} borrows {ep} data-parallel ranks (each computes its own share of the batch and they exchange "
            f"tokens), but dp={dp}: use a dp that ep divides (dp={ep} or a multiple of it, e.g. "
            f"pp={pp or 1},dp={ep},ep={ep}: {(pp or 1) * ep * tp} devices), or an ep that divides dp={dp}")


def _experts_refusal(layout: Layout, experts: Optional[dict[str, int]], runtime: bool) -> Optional[Refusal]:
    """``ep`` with no mixture-of-experts layer to shard, an expert count it does not divide, or tensor parallelism."""
    if experts is not None and not experts:
        return Refusal("experts", f"ep={layout.ep} shards the experts of mixture-of-experts layers, and this model "
                                  "has none that fxpipe can shard (fxpipe.frontend.experts): leave ep out")
    bad = {path: n for path, n in (experts or {}).items() if n % layout.ep}
    if bad:
        path, n = next(iter(bad.items()))
        fits = [d for d in range(1, n + 1) if n % d == 0 and layout.dp % d == 0 and d > 1]
        return Refusal("experts", f"ep={layout.ep} does not divide the {n} experts of {path}: use an ep that "
                                  f"divides both {n} and dp={layout.dp} ({', '.join(map(str, fits)) or 'none > 1'})")
    if runtime and layout.tp > 1:
        return Refusal("experts", f"ep={layout.ep} with tp={layout.tp}: fxpipe's ranks do not yet shard experts "
                                  "beside tensor parallelism; use tp=1 with ep, or ep=1 with tp")
    return None


def check_layout(layout: Layout, **rules: Any) -> Layout:
    """``layout``, or :class:`LayoutError` for the first rule it breaks (:func:`refusal`, same keywords)."""
    found = refusal(layout, **rules)
    if found is not None:
        raise found.error()
    return layout


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
    if isinstance(spec, Layout):
        return spec
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
    if mode not in (None, *DP_MODES) or (mode is not None and {"dp_shard", "dp_replicate"} & set(size)):
        raise ValueError(f"mesh {spec!r}: dp_mode is shard (FSDP2) or replicate (DDP), and goes with dp only "
                         "(dp_shard and dp_replicate name their mode)")
    if order is not None and order not in ORDERS:
        raise ValueError(f"mesh {spec!r}: order must be one of {', '.join(ORDERS)}, got {order!r}")
    ep = size.get("ep", 1)
    common = {"pp": size.get("pp"), "tp": size.get("tp", 1), "order": order or ORDERS[0],
              "sequence_parallel": _switch(spec, fields.get("sp")), "ep": ep}
    if ep > 1 and not {"dp", "dp_shard", "dp_replicate"} & set(size):
        size["dp"] = ep   # ep borrows data-parallel ranks: dp left out is the ep ranks, sharded or replicated
    if "dp_shard" in size or "dp_replicate" in size:
        return Layout(dp_replicate=size.get("dp_replicate", 1), dp_shard=size.get("dp_shard", 1),
                      dp_mode="shard" if "dp_shard" in size else "replicate", **common)
    dp = size.get("dp", 1)
    if mode == "replicate":
        return Layout(dp_replicate=dp, dp_mode="replicate", **common)
    return Layout(dp_shard=dp, dp_mode=mode, **common)


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
    names = ("pp", "dp", "tp", "dp_shard", "dp_replicate", "ep")
    try:
        size = {k: int(fields[k]) for k in names if k in fields}
    except (TypeError, ValueError):
        raise ValueError(f"mesh {spec!r}: pp, dp, tp, dp_shard, dp_replicate and ep must be integers ({EXAMPLE})") from None
    small = sorted(k for k, v in size.items() if v < 1)
    if small:
        raise ValueError(f"mesh {spec!r}: {', '.join(small)} must be at least 1 ({EXAMPLE})")
    return size
