"""The mesh in :meth:`fxpipe.Plan.summary`: the chosen pp × dp × tp and the best plan of every shape tried."""

from __future__ import annotations

from typing import Any, Callable

from solvers.layout import ORDERS, Layout

__all__ = ["mesh_head", "mesh_table"]


def _label(row: dict[str, Any]) -> str:
    """``pp=2 dp=4(fsdp) tp=1`` of a row of the mesh search's table."""
    return Layout.of(row["pp"], row["dp"], row["tp"], row.get("dp_mode", "replicate"),
                     row.get("order", ORDERS[0]), row.get("ep", 1)).label()


def mesh_head(plan: Any) -> list[str]:
    """Lines before the stage table: the mesh, what each dimension crosses, and what the table below is."""
    layout, links = plan.layout, plan.mesh.get("links", {})
    crossing = ", ".join(f"{d} over {links[d]}" for d in ("tp", "dp", "pp") if links.get(d))
    p = plan.predicted
    step = (f"; predicted step {p['iteration_s'] * 1e3:.1f} ms = pipeline {p['pipeline_iteration_s'] * 1e3:.1f} ms + "
            f"exposed data-parallel sync" if "pipeline_iteration_s" in p else "")
    because = ([f"meshes searched by default: {plan.solver['mesh_because']} (mesh=None plans one pipeline)"]
               if plan.solver.get("mesh_because") else [])
    return because + [
        f"mesh {layout.label()} on {layout.world} devices ({crossing or 'one device'}; "
        f"{'sequence parallel' if layout.sequence_parallel else 'no sequence parallelism'}){step}",
        f"the pipeline below is one of {layout.dp * layout.tp} (dp x tp); each stage's figures are one device's"]


def mesh_table(plan: Any, table: Callable[[list[str], list[list[str]]], list[str]]) -> list[str]:
    """The best plan of every mesh shape tried (simulated step; * chosen), then the shapes where nothing fits;
    ``table`` lays out the rows (:func:`fxpipe.planning.plan.aligned_table`)."""
    rows = plan.solver["mesh_search"]
    fits = [r for r in rows if r["feasible"]]
    out = [f"mesh search ({plan.solver.get('mesh_candidates', '?')} candidates in "
           f"{plan.solver.get('mesh_search_s', float('nan')):.2f} s; the best of each shape, simulated, or ~ the "
           "closed form's step; * chosen):"]
    out += table(["mesh", "schedule", "chunks", "recompute", "step ms", "bubble", "peak GiB"], [
        [("* " if r["chosen"] else "  ") + _label(r), r["schedule"], str(r["chunks"]),
         r.get("recomputation") or ("yes" if r["recompute"] else "no"),
         ("" if r.get("simulated", True) else "~") + f"{r['iteration_s'] * 1e3:.1f}", f"{r['bubble']:.1%}", f"{r['peak_bytes'] / 2**30:.1f}"] for r in fits])
    for r in fits:
        if r["chosen"] and "searched_s" in r:
            out.append(f"* as costed node by node (the plan above); the search's own estimate of it: "
                       f"{r['searched_s'] * 1e3:.1f} ms, {r['searched_peak_bytes'] / 2**30:.1f} GiB")
    costed = [r for r in plan.solver.get("mesh_costed", []) if "iteration_s" in r]
    if costed:
        step = [r["iteration_s"] / r["searched_s"] for r in costed]
        memory = [r["peak_bytes"] / r["searched_peak_bytes"] for r in costed]
        out.append(f"{len(plan.solver['mesh_costed'])} choices of the search costed node by node ("
                   f"{len(plan.solver['mesh_costed']) - len(costed)} refused); node level over search: step "
                   f"{min(step):.2f}-{max(step):.2f}x, peak memory {min(memory):.2f}-{max(memory):.2f}x")
    refused = [_label(r) for r in rows if not r["feasible"]]
    if refused:
        out.append(f"no plan fits memory on: {', '.join(refused)}")
    if plan.solver.get("mesh_refused"):
        out.append("faster shapes refused by the node-level memory model: " + "; ".join(plan.solver["mesh_refused"]))
    return out
