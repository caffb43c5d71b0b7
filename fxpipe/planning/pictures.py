"""Pictures of a plan (matplotlib, drawn off-screen): stage bars, the simulated timeline, the links, the graph.

Every function returns a :class:`matplotlib.figure.Figure` made without pyplot's global state (no display
is needed, nothing is shown; ``fig.savefig("plan.png")`` writes it, a notebook shows it). The numbers are
the plan's own: the timeline is :func:`solvers.simulate.simulate` on the plan's stage times, as the planner
predicted it; a measured step (``pipe.last_step["timings"]``) can be drawn beside it.
:class:`fxpipe.planning.plan.Plan` has ``plot()``, ``timeline()`` and ``graph_plot()`` that call these.
"""

from __future__ import annotations

from typing import Any, Sequence

import networkx as nx
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from fxpipe.planning.plan_view import PlanView
from solvers.schedules import KINDS, get_schedule, stage_worker
from solvers.simulate import simulate

__all__ = ["plot_stages", "plot_timeline", "plot_topology", "plot_graph", "KIND_COLOURS"]

KIND_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868", "send": "#8C8C8C"}
CLASS_ORDER = ["X", "NV", "PIX", "PXB", "PHB", "NODE", "SYS", "NET", "HOST"]   # fastest link first


def plot_stages(plan: PlanView) -> Figure:
    """Per stage: compute (forward and backward of all micro-batches) and transfer seconds, and peak memory
    against the memory its device gives it."""
    fig = Figure(figsize=(8, 3.5), layout="constrained")
    time_ax, memory_ax = fig.subplots(1, 2)
    index = [st.index for st in plan.stages]
    m = plan.chunks
    forward = [st.fwd_s * m for st in plan.stages]
    backward = [st.bwd_s * m for st in plan.stages]
    transfer = [st.comm_s * m for st in plan.stages]
    time_ax.bar(index, forward, color=KIND_COLOURS["F"], label="forward")
    time_ax.bar(index, backward, bottom=forward, color=KIND_COLOURS["B"], label="backward")
    time_ax.bar(index, transfer, bottom=[f + b for f, b in zip(forward, backward)], color=KIND_COLOURS["send"],
                label="transfer")
    time_ax.set(title=f"time per step ({m} micro-batches)", xlabel="stage", ylabel="seconds", xticks=index)
    time_ax.legend(fontsize="small")
    peak = [st.peak_bytes / 2**30 for st in plan.stages]
    memory_ax.bar(index, peak, color="#8172B2", label="predicted peak")
    capacity = [st.memory_bytes / 2**30 for st in plan.stages]
    if any(capacity):
        memory_ax.scatter(index, capacity, marker="_", s=600, color="black", label="device memory")
    memory_ax.set(title="memory", xlabel="stage", ylabel="GiB", xticks=index)
    memory_ax.legend(fontsize="small")
    fig.suptitle(f"{plan.model}: {len(plan.stages)} stages on {', '.join(plan.devices)}")
    return fig


def _lanes(ax: Any, events: Sequence[tuple[int, str, int, float, float]], workers: int, label: str) -> None:
    """Draw ``(worker, kind, micro_batch, start, end)`` operations as bars, one lane per worker."""
    for worker, kind, micro_batch, start, end in events:
        ax.barh(worker, end - start, left=start, height=0.8, color=KIND_COLOURS[kind], edgecolor="white",
                linewidth=0.5)
        if end - start > 0:
            ax.text((start + end) / 2, worker, str(micro_batch), ha="center", va="center", fontsize=7, color="white")
    ax.set(yticks=range(workers), yticklabels=[f"worker {w}" for w in range(workers)], xlabel="seconds",
           title=label)
    ax.set_facecolor("#F2F2F2")    # what shows between the bars is the bubble: the worker waits
    ax.invert_yaxis()


def plot_timeline(plan: PlanView, measured: Sequence[Any] | None = None) -> Figure:
    """The plan's schedule as the simulator predicts it, a Gantt chart per worker (F/B/W coloured, bubbles
    grey, the predicted iteration marked); with ``measured`` (``pipe.last_step["timings"]``: objects with
    ``kind``, ``stage``, ``micro_batch``, ``start_s``, ``end_s``), the measured step below it."""
    workers = get_schedule(plan.schedule).workers(len(plan.stages), plan.workers)
    p = len(plan.stages)
    sim = simulate([st.fwd_s for st in plan.stages], [st.bwd_s for st in plan.stages], plan.chunks, plan.schedule,
                   sends={(s, s + 1): plan.stages[s].comm_s for s in range(p - 1)}, workers=workers)
    fig = Figure(figsize=(10, 1.2 + 0.6 * workers * (2 if measured else 1)), layout="constrained")
    axes = fig.subplots(2 if measured else 1, 1, sharex=True, squeeze=False)[:, 0]
    predicted = [(stage_worker(plan.schedule, e.stage, workers), e.kind, e.micro_batch, e.start, e.end)
                 for e in sim.timeline if e.kind in KINDS]
    _lanes(axes[0], predicted, workers, f"predicted: {plan.schedule}, {plan.chunks} micro-batches")
    axes[0].axvline(sim.iteration_s, color="black", linestyle="--")
    axes[0].annotate(f"iteration {sim.iteration_s * 1e3:.1f} ms", (sim.iteration_s, -0.5), ha="right",
                     va="bottom", fontsize=8)
    if measured:
        ops = [(stage_worker(plan.schedule, t.stage, workers), t.kind, t.micro_batch, t.start_s, t.end_s)
               for t in measured]
        _lanes(axes[1], ops, workers, "measured (last step)")
        end = max(e for *_, e in ops)
        axes[1].axvline(end, color="black", linestyle="--")
    fig.legend(handles=[Patch(color=KIND_COLOURS[k], label=name) for k, name in
                        (("F", "forward"), ("B", "backward"), ("W", "weight"))], loc="outside right upper",
               fontsize="small")
    return fig


def _class_rank(cls: str) -> int:
    base = "NV" if cls.startswith("NV") else cls
    return CLASS_ORDER.index(base) if base in CLASS_ORDER else len(CLASS_ORDER)


def plot_topology(classes: Sequence[Sequence[str]], plan: PlanView | None = None) -> Figure:
    """The device-to-device link matrix (``nvidia-smi topo -m`` classes: NV#, PIX, PXB, PHB, NODE, SYS, ...) as
    a heat map, fastest class lightest; with ``plan``, the stages' path over its devices drawn on it."""
    n = len(classes)
    ranks = [[_class_rank(c) for c in row] for row in classes]
    fig = Figure(figsize=(1.5 + 0.55 * n, 1.2 + 0.5 * n), layout="constrained")
    ax = fig.subplots()
    ax.imshow(ranks, cmap="viridis_r", vmin=0, vmax=len(CLASS_ORDER))
    for i, row in enumerate(classes):
        for j, cls in enumerate(row):
            ax.text(j, i, cls, ha="center", va="center", fontsize=8, color="black" if ranks[i][j] < 5 else "white")
    ax.set(xticks=range(n), yticks=range(n), xticklabels=[f"GPU{i}" for i in range(n)],
           yticklabels=[f"GPU{i}" for i in range(n)], title="links (lighter: faster)")
    if plan is not None:
        path = [_device_index(st.device) for st in plan.stages]
        hops = [(a, b) for a, b in zip(path, path[1:]) if a is not None and b is not None]
        for a, b in hops:   # a hand-over from a stage on device a to the next on device b: cell (a, b)
            ax.annotate("", xy=(b, a), xytext=(a, a), arrowprops={"arrowstyle": "->", "color": "red", "lw": 2})
        ax.scatter([b for _, b in hops], [a for a, _ in hops], s=200, facecolors="none", edgecolors="red", lw=2)
        ax.set_title(f"links (lighter: faster); stage path {' -> '.join(str(d) for d in path)}")
    return fig


def _device_index(device: str) -> int | None:
    tail = device.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def plot_graph(plan: PlanView) -> Figure:
    """The traced graph (the plan's problem: nodes and the edges that carry values), each node coloured by its
    stage, laid out in topological layers from left to right."""
    if not plan.problem:
        raise ValueError("this plan has no graph (plan.problem is empty): plans from fxpipe.compile and "
                         "fxpipe.plan carry it; re-plan the model to draw it")
    graph = nx.DiGraph()
    graph.add_nodes_from(n["id"] for n in plan.problem["nodes"])
    graph.add_edges_from((e["src"], e["dst"]) for e in plan.problem["edges"])
    for layer, names in enumerate(nx.topological_generations(graph)):
        for name in names:
            graph.nodes[name]["layer"] = layer
    position = nx.multipartite_layout(graph, subset_key="layer")
    stage_of = plan.stage_of()
    colours = [f"C{stage_of[n] % 10}" if n in stage_of else "lightgrey" for n in graph.nodes]
    fig = Figure(figsize=(12, 4), layout="constrained")
    ax = fig.subplots()
    nx.draw_networkx_edges(graph, position, ax=ax, alpha=0.3, arrows=False)
    nx.draw_networkx_nodes(graph, position, ax=ax, node_color=colours, node_size=30)
    ax.legend(handles=[Patch(color=f"C{st.index % 10}", label=f"stage {st.index} ({st.device})")
                       for st in plan.stages], fontsize="small", loc="upper right")
    ax.set_title(f"{plan.model}: {graph.number_of_nodes()} nodes in {len(plan.stages)} stages")
    ax.set_axis_off()
    return fig
