"""What expert parallelism (``Layout.ep``) costs a piece holding mixture-of-experts layers: torch-free formulas.

A mixture-of-experts layer routes each token to ``top_k`` of its ``E`` experts. Its figures (:class:`Experts`, one
record per piece, the sum of the piece's layers) are what the mesh search (:mod:`solvers.mesh`) and the node-level
costing (:func:`fxpipe.planning.mesh_plan.mesh_costs`) charge:

* compute: the **active** experts only, ``tokens × top_k × 2 × (one expert's parameters)`` FLOPs forward (twice
  that backward), already inside the piece's ``fwd_s`` and ``bwd_s`` (:mod:`fxpipe.cost.expert_costs` put it
  there in place of what a meta trace of the experts region counts). With ``ep > 1`` the ranks wait for the
  busiest: the experts' time is multiplied by :data:`EXPERT_IMBALANCE`, the busiest expert rank's tokens over the
  mean (router load balancing keeps it near one; 1.25 is a stated assumption, not a measurement);
* all-to-all (:func:`a2a_bytes`, :func:`a2a_s`): per layer and micro-batch the dispatch and the combine each send
  ``tokens × top_k × hidden × bytes × (ep - 1) / ep`` from every rank (the share of its routed tokens whose expert
  lies on another rank, uniform routing), forward and backward: four all-to-alls (:data:`A2A_PER_LAYER`), at the
  link the ``ep`` ranks span (the mesh's data-parallel link: ``ep`` borrows data-parallel ranks), not overlapped;
* memory (:func:`held_bytes`, :func:`sharded_optimizer_bytes`): each rank holds ``1 / ep`` of the experts, their
  gradients and optimizer state; FSDP2 (``dp_mode="shard"``) shards them further over the ``dp / ep`` ranks
  left, so their optimizer state is ``1 / dp`` of the whole, as the dense parameters' is.

Left out: the all-to-all's overlap with compute (Megatron-Core's combined 1F1B), routing imbalance that varies
by layer and step, tokens dropped by a capacity factor, and the expert gradients' data-parallel reduction over
``dp / ep`` ranks in place of ``dp`` (charged as over ``dp``, of ``1 / ep`` of the bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

__all__ = ["A2A_PER_LAYER", "EXPERT_IMBALANCE", "Experts", "a2a_bytes", "a2a_s", "expert_degrees", "expert_extra_s",
           "held_bytes", "sharded_optimizer_bytes"]

#: the busiest expert rank's tokens over the mean, when the experts are spread over ``ep > 1`` ranks
EXPERT_IMBALANCE = 1.25
#: all-to-alls per mixture-of-experts layer and micro-batch: dispatch and combine, forward and backward
A2A_PER_LAYER = 4


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts layers of one piece: the experts per layer (``counts``), the bytes of all their
    experts' parameters (``param_bytes``), and per sample the active experts' forward and backward seconds (inside
    the piece's own) and the bytes one dispatch moves before the ``(ep - 1) / ep`` share (``token_bytes``: tokens
    × top_k × hidden × element bytes, summed over the layers)."""

    counts: tuple[int, ...]
    param_bytes: float
    fwd_s: float
    bwd_s: float
    token_bytes: float

    @property
    def layers(self) -> int:
        return len(self.counts)


def a2a_bytes(tokens: float, top_k: int, hidden: int, itemsize: int, ep: int) -> float:
    """Bytes each rank sends in one dispatch (or combine) of ``tokens`` tokens to ``top_k`` experts each, spread
    over ``ep`` ranks: the share whose expert lies elsewhere."""
    return tokens * top_k * hidden * itemsize * (ep - 1) / ep if ep > 1 else 0.0


def a2a_s(nbytes: float, ep: int, bandwidth_Bps: float, latency_s: float = 0.0) -> float:
    """One all-to-all in which each of ``ep`` ranks sends ``nbytes`` (:func:`a2a_bytes`) over a link of
    ``bandwidth_Bps``: its bytes at the link's speed and one latency per peer."""
    return 0.0 if ep < 2 else nbytes / bandwidth_Bps + (ep - 1) * latency_s


def expert_extra_s(experts: Optional[Experts], samples: float, ep: int, bandwidth_Bps: float,
                   latency_s: float = 0.0, speed: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds a micro-batch of ``samples`` samples adds to its piece under ``ep``: the
    imbalance's share of the experts' compute, and each layer's all-to-alls (half of :data:`A2A_PER_LAYER` each
    way) of its share of ``token_bytes``."""
    if experts is None or ep < 2 or not experts.layers:
        return 0.0, 0.0
    wait = EXPERT_IMBALANCE - 1.0
    one = a2a_s(experts.token_bytes * samples / experts.layers * (ep - 1) / ep, ep, bandwidth_Bps, latency_s)
    moved = A2A_PER_LAYER // 2 * experts.layers * one
    return wait * experts.fwd_s * samples / speed + moved, wait * experts.bwd_s * samples / speed + moved


def held_bytes(param_bytes: float, experts: Optional[Experts], ep: int) -> float:
    """A piece's parameter bytes one rank holds: the dense whole, the experts' ``1 / ep``."""
    if experts is None or ep < 2:
        return param_bytes
    return param_bytes - experts.param_bytes * (1.0 - 1.0 / ep)


def sharded_optimizer_bytes(experts: Optional[Experts], ep: int, dp: int) -> float:
    """Under FSDP2 over ``dp`` ranks, the optimizer-state bytes per optimizer byte factor that :func:`held_bytes`
    / ``dp`` leaves out: the experts' state is ``1 / (ep × dp / ep) = 1 / dp`` of the whole, not ``1 / (ep × dp)``."""
    if experts is None or ep < 2:
        return 0.0
    return experts.param_bytes * (1.0 / dp - 1.0 / (ep * dp))


def expert_degrees(counts: Iterable[int], dp: int, tp: int = 1) -> list[int]:
    """The ``ep`` degrees a mesh of ``dp`` data-parallel ranks can hold: 1, and each divisor of ``dp`` above one
    that divides every layer's experts (none beside tensor parallelism: the runtime refuses ``ep`` with ``tp``)."""
    counts = list(counts)
    if not counts or tp > 1:
        return [1]
    return [1] + [e for e in range(2, dp + 1) if dp % e == 0 and all(n % e == 0 for n in counts)]
