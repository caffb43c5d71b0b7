"""What a tied weight costs a plan: its gradient summed once per step, not the weight sent every micro-batch.

A parameter that several stages read (a tied embedding and LM head) has a copy on each of them
(:mod:`fxpipe.runtime.boundaries.tied`): nothing of it crosses a boundary per micro-batch; once per step its gradient is
summed over the copies (an all-reduce over the owning ranks, :mod:`fxpipe.distributed.tied`; in one process the
copies' gradients are added into the model's and the copies refreshed after the optimizer steps).

The solvers' problem charges an edge's bytes once per micro-batch each way (value forward, gradient back), so
an edge out of a parameter's read carries the parameter's bytes divided by the micro-batches
(:func:`edge_bytes`): over a step, that is the parameter's bytes each way between the first reading stage and
each other one, what a ring all-reduce over ``n`` owners moves (``2 (n - 1)`` times the bytes over all links).
:func:`tied_weights` lists each tied parameter of a plan with its bytes per step both ways, and
:func:`charge_copies` adds each copy to the memory of the stage that holds it (the parameter, its gradient and,
over torch.distributed where each owner's optimizer steps its copy, the optimizer's state), after the solve: the
solvers' memory model counts a parameter once, in the stage of the node that reads it first.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch.fx as fx

__all__ = ["parameter_reads", "edge_bytes", "tied_weights", "charge_copies"]


def parameter_reads(gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
    """The ``get_attr`` nodes that read a ``Parameter``: node name -> the parameter's id and bytes (its own
    size, not a profile's output bytes, which the auto search scales with the micro-batch)."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                param = gm.get_parameter(str(node.target))
            except AttributeError:   # a buffer, a module or a constant
                continue
            found[node.name] = (id(param), param.numel() * param.element_size())
    return found


def edge_bytes(nbytes: float, micro_batches: int) -> float:
    """What the solver charges per micro-batch for a parameter read in another stage: its bytes once per step."""
    return float(nbytes) / max(int(micro_batches), 1)


def tied_weights(gm: fx.GraphModule, costs: Mapping[str, Any], stage_of: Mapping[str, int],
                 micro_batches: int) -> list[dict[str, Any]]:
    """Per parameter read by more than one stage of ``stage_of``: its name, bytes, the stages reading it, and the
    bytes moved per step across stage boundaries for it as a value per micro-batch (the weight to each other
    stage and its gradient back, every micro-batch) and as copies (one ring all-reduce of its gradient)."""
    reads = parameter_reads(gm)
    by_param: dict[int, dict[str, Any]] = {}
    for node in gm.graph.nodes:
        if node.name not in reads:
            continue
        key, nbytes = reads[node.name]
        row = by_param.setdefault(key, {"name": str(node.target), "bytes": float(nbytes), "stages": set(),
                                        "charged": None})
        cost = costs.get(node.name)
        row["stages"].update(stage_of[u.name] for u in node.users if u.name in stage_of)
        if cost is not None and cost.param_bytes > 0:   # the read the profile counted the parameter at
            row["charged"] = stage_of.get(node.name)
    rows = []
    for row in by_param.values():
        n = len(row["stages"])
        if n < 2:
            continue
        stages = sorted(row["stages"])
        rows.append({"name": row["name"], "bytes": row["bytes"], "stages": stages,
                     "charged_stage": stages[0] if row["charged"] is None else row["charged"],
                     "sent_per_step_bytes": 2.0 * micro_batches * (n - 1) * row["bytes"],
                     "all_reduce_per_step_bytes": 2.0 * (n - 1) * row["bytes"]})
    return sorted(rows, key=lambda r: r["name"])


def charge_copies(plan: Any, rows: list[dict[str, Any]], optimizer_state_factor: float) -> None:
    """Add each tied parameter's bytes to every reading stage of ``plan`` but the one the solver charged it to
    (``param_bytes``, and ``peak_bytes`` with its gradient and optimizer state); where that stage does not read it,
    the parameter lives in the first that does, and leaves it."""
    factor = 1.0 + float(optimizer_state_factor)
    for row in rows:
        holder = row["charged_stage"]
        moves = [(k, 1.0) for k in row["stages"] if k != holder]
        if holder not in row["stages"]:   # every reader holds it (the first the parameter), the holder nothing
            moves.append((holder, -1.0))
        for k, sign in moves:
            st = plan.stages[k]
            st.param_bytes += sign * row["bytes"]
            st.peak_bytes += sign * row["bytes"] * factor
