"""Per-node times from runs of the whole graph as in a training step, without a synchronisation per node.

Timing every node alone, synchronised before and after (``timing="node"``), counts each node's launch and
wait latency again; on a GPU, where a step's kernels queue back to back, that predicted stages 2.5-5x
slower than they ran. ``timing="graph"`` (the default on CUDA) runs the graph instead:

1. **Forward**: the graph's nodes in order (an :class:`torch.fx.Interpreter`, as a stage runs them) with a
   :mod:`clock <fxpipe.cost.clock>` mark before the first node and after every call node, and one wait at
   the end. A node's time is the gap between its mark and the one before (the GPU's timeline on CUDA: the
   node's kernels, plus any time the GPU waited for them to be launched, which a real step waits too).
2. **Backward**: one ``torch.autograd.grad`` of the outputs with respect to the inputs and parameters
   (``.grad`` is not touched), between two marks, one wait.
3. After ``warmup`` untimed runs, ``repeats`` timed ones: each node's median gap, scaled so the nodes sum
   to the median forward total; the median backward total **apportioned** to the nodes.

Autograd runs a graph's backward as one call, so backward has no per-node marks. Node ``i`` gets the share
``fwd_i * bwd_alone_i / fwd_alone_i``: its forward in the graph run times its backward/forward ratio when
timed alone (``_time_node``, which ``"node"`` timing also runs). The alone ratio is where a synchronised
per-node measurement is still sound: launch and wait latency sits in both terms, and a node without a
backward (integer work, nothing that needs a gradient) has ratio 0. Apportioning by alone backward times
would hand every small node the same latency (hundreds of views and elementwise nodes would take the
backward from the matmuls); by FLOP counts, the memory-bound nodes (norms, softmax, activations) that
FlopCounterMode counts as 0 would get none. Where every share is 0 the alone backward times are used, and
equal parts where those are 0 too, so the nodes' backward always sums to the measured total.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.cost.clock import Clock
from fxpipe.options import TIMINGS

__all__ = ["TIMINGS", "GraphTiming", "default_timing", "time_graph", "apportion", "backward_weights"]

CALLS = ("call_module", "call_function", "call_method")


def default_timing(device: torch.device) -> str:
    """``"graph"`` on CUDA, where per-node synchronisation inflates the costs; ``"node"`` elsewhere (on a
    CPU operators run when called, and per-node timing is the accuracy the CPU plans were tuned on)."""
    return "graph" if device.type == "cuda" else "node"


@dataclass
class GraphTiming:
    """Each call node's forward and backward seconds, and the measured whole-graph totals they sum to."""
    fwd_s: dict[str, float]
    bwd_s: dict[str, float]
    fwd_total_s: float
    bwd_total_s: float


@dataclass
class _Run:
    gaps: list[float]   # per call node, in graph order
    fwd_s: float
    bwd_s: float


class _MarkedRun(fx.Interpreter):
    """Runs the graph, marking the clock before the first non-input node and after every call node."""

    def __init__(self, gm: fx.GraphModule, clock: Clock) -> None:
        super().__init__(gm)
        self.clock = clock
        self.marks: list[Any] = []

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "placeholder" and not self.marks:
            self.marks.append(self.clock.mark())
        out = super().run_node(n)
        if n.op in CALLS:
            self.marks.append(self.clock.mark())
        return out


def _leaves(inputs: tuple) -> tuple[tuple, list[torch.Tensor]]:
    """Fresh copies of the inputs (the graph may write into them), and those that require grad."""
    leaves: list[torch.Tensor] = []

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            v = v.detach().clone().requires_grad_(v.requires_grad)
        if isinstance(v, torch.Tensor) and v.requires_grad:
            leaves.append(v)
        return v
    return tree_map(one, inputs), leaves


def _timed_run(gm: fx.GraphModule, inputs: tuple, clock: Clock) -> _Run:
    """One forward with a mark per call node and one wait, then one backward between two marks and one wait."""
    args, leaves = _leaves(inputs)
    runner = _MarkedRun(gm, clock)
    out = runner.run(*args)
    clock.wait()
    gaps = [clock.seconds(a, b) for a, b in zip(runner.marks, runner.marks[1:])]
    fwd = clock.seconds(runner.marks[0], runner.marks[-1]) if runner.marks else 0.0
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = leaves + [p for p in gm.parameters() if p.requires_grad]
    if not outs or not wrt:
        return _Run(gaps, fwd, 0.0)
    grads = [torch.ones_like(t) for t in outs]
    start = clock.mark()
    torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    end = clock.mark()
    clock.wait()
    return _Run(gaps, fwd, clock.seconds(start, end))


def apportion(total: float, weights: dict[str, float]) -> dict[str, float]:
    """``total`` split in proportion to ``weights`` (negative ones count as 0; equal parts where all are 0),
    so that the parts sum to ``total``."""
    clipped = {k: max(w, 0.0) for k, w in weights.items()}
    whole = sum(clipped.values())
    if whole <= 0:
        return {k: total / len(weights) for k in weights} if weights else {}
    return {k: total * w / whole for k, w in clipped.items()}


def backward_weights(fwd_s: dict[str, float], alone: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Each node's share of the graph's backward: its forward in the graph run times its backward/forward
    ratio timed alone (``alone``: node -> (forward, backward) seconds); the alone backward times where those
    shares are all 0 (see the module's docstring)."""
    shares = {n: f * (alone[n][1] / alone[n][0] if alone[n][0] > 0 else 0.0) for n, f in fwd_s.items()}
    return shares if sum(shares.values()) > 0 else {n: alone[n][1] for n in fwd_s}


def time_graph(gm: fx.GraphModule, inputs: tuple, alone: dict[str, tuple[float, float]], clock: Clock,
               warmup: int = 1, repeats: int = 3) -> GraphTiming:
    """Forward and backward seconds of every call node of ``gm`` on ``inputs`` from whole-graph runs timed by
    ``clock`` (``alone``: each call node's forward and backward timed alone, for the backward's shares). The
    nodes' forward sums to ``fwd_total_s``, their backward to ``bwd_total_s``. Buffers and the RNG advance as
    in a step: the caller restores them."""
    names = [n.name for n in gm.graph.nodes if n.op in CALLS]
    with torch.enable_grad():
        runs = [_timed_run(gm, inputs, clock) for _ in range(warmup + repeats)][warmup:]
    gaps = {name: statistics.median(run.gaps[i] for run in runs) for i, name in enumerate(names)}
    fwd_total = statistics.median(run.fwd_s for run in runs)
    bwd_total = statistics.median(run.bwd_s for run in runs)
    fwd = apportion(fwd_total, gaps)
    return GraphTiming(fwd, apportion(bwd_total, backward_weights(fwd, alone)), fwd_total, bwd_total)
