"""Node costs at another micro-batch size: what the auto search plans with for chunk counts it did not profile.

A first-order model, the one :func:`solvers.joint.rescale` uses on problems:
compute time and activation and output bytes are proportional to the
micro-batch's samples, except a fixed per-node overhead (the operator's dispatch
and launch, :data:`NODE_OVERHEAD_S`, twice that in the backward, as the
``"estimate"`` profile models it) that is not; parameters do not scale. For that
profile the scaling is its own model (exact where a node's bytes and FLOPs are
proportional to the samples); for measured costs it is an estimate: the plan the
search picks is costed this way until a step or calibration measures it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fxpipe.cost.profile import ESTIMATE_OVERHEAD_S

__all__ = ["NODE_OVERHEAD_S", "scaled_costs"]

# per node forward (the backward twice that): the "estimate" profile's per-node term, about what the
# dispatch of one small CPU operator costs
NODE_OVERHEAD_S = ESTIMATE_OVERHEAD_S


def scaled_costs(costs: dict[str, Any], from_chunks: int, to_chunks: int,
                 overhead_s: float = NODE_OVERHEAD_S) -> dict[str, Any]:
    """``costs`` (node name -> :class:`fxpipe.cost.profile.NodeCost`) measured on micro-batches of a batch cut
    in ``from_chunks``, as they would be for the batch cut in ``to_chunks``."""
    if from_chunks == to_chunks:
        return costs
    f = from_chunks / to_chunks

    def time_of(t: float, overhead: float) -> float:
        o = min(t, overhead)
        return o + (t - o) * f
    return {name: dataclasses.replace(c, fwd_s=time_of(c.fwd_s, overhead_s), bwd_s=time_of(c.bwd_s, 2 * overhead_s),
                                      act_bytes=int(c.act_bytes * f), output_bytes=int(c.output_bytes * f),
                                      flops=int(c.flops * f))
            for name, c in costs.items()}
