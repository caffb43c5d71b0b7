"""Per-node costs of a traced graph at the micro-batch size.

Three modes:

* ``"measure"``: times on the target device (warm-up, repeats, median). Every
  node is timed alone (CUDA synchronised around each timing); backward is
  ``torch.autograd.grad`` of the node's outputs with respect to its inputs and
  parameters, which does not touch ``.grad``. With ``timing="node"`` (the default
  on CPU) those are the costs. With ``timing="graph"`` (the default on CUDA, where
  a synchronisation per node counts launch latency a step never pays) the whole
  graph is run as in a step, marked per node by a :mod:`~fxpipe.cost.clock`
  without waiting: forward costs are the gaps between marks, and the whole
  backward is apportioned by the alone-timed backward/forward ratios
  (:mod:`fxpipe.cost.graph_timing`).
* ``"estimate"``: no timing; a node costs ``max(FLOPs / peak, bytes / bandwidth)``
  with FLOPs from ``torch.utils.flop_counter.FlopCounterMode``, and backward
  twice forward. Fast, for sweeps and tests; the ranking is what it is good for.
* ``"analytic"``: the same counts taken under ``FakeTensorMode`` — nothing is
  allocated or computed, the model may live on ``meta`` — turned into time by
  the roofline of a target :class:`fxpipe.cost.devices.DeviceSpec` (plan for GPUs
  this machine does not have). Attention runs as the GPU's fused kernel
  (:mod:`fxpipe.cost.fused_attention`), not the math path that saves its weights.

Every mode records, from one real run of the graph: bytes that autograd saves for
backward (``saved_tensors_hooks``; each storage counted once, at the first node
that saves it; parameters excluded), parameter bytes (each parameter counted
once, at its first user) and output bytes. Buffers, parameters and the RNG are
restored afterwards, so profiling leaves the model as it found it.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.cost.clock import Clock, clock_for
from fxpipe.cost.fused_attention import ATTENTION, fused_attention
from fxpipe.cost.graph_timing import TIMINGS, default_timing, time_graph
from fxpipe.frontend.precision import is_compute_copy

if TYPE_CHECKING:
    from fxpipe.cost.devices import DeviceSpec

__all__ = ["NodeCost", "profile_graph", "PROFILE_MODES", "run_node", "device_sync", "MEASURED_NOISE"]

log = logging.getLogger(__name__)

PROFILE_MODES = ("measure", "estimate", "analytic")
# Nominal rates of the "estimate" mode: only ratios between nodes matter there.
_ESTIMATE_FLOPS = {"cpu": 5e10, "cuda": 1e13}
_ESTIMATE_BANDWIDTH = {"cpu": 1e10, "cuda": 1e12}
ESTIMATE_OVERHEAD_S = 2e-6


@dataclass
class NodeCost:
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    param_bytes: int = 0
    act_bytes: int = 0
    output_bytes: int = 0
    flops: int = 0
    output_saved_by: str = ""   # the node that saves this node's output for backward ("" if none)
    # shape and element bytes of each float output that carries a gradient: what boundary compression encodes
    float_outputs: list[tuple[list[int], int]] = field(default_factory=list)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _detach(value: Any) -> Any:
    """``value`` with every tensor detached, keeping ``requires_grad`` and parameters as they are."""
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            return t.detach().requires_grad_(t.requires_grad)
        return t
    return tree_map(one, value)   # not fx's map_aggregate: it turns torch.return_types (sort's) into tuples


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage, for real, meta and fake tensors alike (data_ptr is 0 on meta)."""
    return t.untyped_storage()._cdata


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes the tensors occupy: each storage once, but no more of it than the views show (a
    micro-batch that is a slice of the batch moves and holds only its own rows)."""
    views: dict[int, int] = {}
    whole: dict[int, int] = {}
    for t in tensors:
        key = storage_key(t)
        views[key] = views.get(key, 0) + t.numel() * t.element_size()
        whole[key] = t.untyped_storage().nbytes()
    return sum(min(views[k], whole[k]) for k in views)


def run_node(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict) -> Any:
    """Execute one fx node on concrete arguments."""
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    raise ValueError(f"run_node cannot execute {node.op} node {node.name}")


def _is_inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether the node writes into an input: its inputs are then cloned before it runs alone (an in-place
    operation on a leaf that requires grad is refused by autograd, and the recorded input must stay as it
    was). An ATen operator (torch.export's graph: ``aten.masked_fill_.Scalar``) says so in its schema."""
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(node.target), "inplace", False))
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return bool(node.kwargs.get("inplace", False)) or (name.endswith("_") and not name.endswith("__"))


class _Recorder(fx.Interpreter):
    """Runs the graph once, keeping every value and attributing saved tensors to nodes."""

    def __init__(self, gm: fx.GraphModule, count_flops: bool, fused: bool = False) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.fused = fused   # attention as the GPU's fused kernel (fxpipe.cost.fused_attention)
        self.current: str | None = None
        self.act_bytes: dict[str, int] = {}
        self.flops: dict[str, int] = {}
        self.count_flops = count_flops
        self._seen: set[int] = {storage_key(t) for t in list(gm.parameters()) + list(gm.buffers())}
        # Storages counted so far stay alive for the run, so that no later tensor can reuse
        # a freed one's identity and go uncounted (storages hold no autograd graph).
        self._alive: list[torch.UntypedStorage] = []
        self.saver: dict[int, str] = {}   # storage -> the node whose run saved it first

    def pack(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage and keep nothing: this run's graph is never backpropagated,
        and keeping ``t`` would tie it (an output's ``grad_fn`` is the very node that saves it)
        into a cycle through C++ autograd nodes that Python's collector cannot free."""
        st = t.untyped_storage()
        key = st._cdata
        if self.current is not None and key not in self._seen and st.nbytes() > 0:
            self._seen.add(key)
            self.saver[key] = self.current
            self._alive.append(st)
            self.act_bytes[self.current] = self.act_bytes.get(self.current, 0) + st.nbytes()
        return None

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if self.fused and target in ATTENTION:
            return fused_attention(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        # the caller's micro-batch (a view of its batch), and bf16-mixed's copy of a parameter (held once a step:
        # the optimizer state's factor counts it): not a micro-batch's activation where a reader saves them
        if n.op == "placeholder" or is_compute_copy(n):
            out = super().run_node(n)
            self._seen |= {storage_key(t) for t in _tensors(out)}
            return out
        if not self.count_flops or n.op not in ("call_module", "call_function", "call_method"):
            return super().run_node(n)
        with FlopCounterMode(display=False) as counter:
            out = super().run_node(n)
        self.flops[n.name] = counter.get_total_flops()
        return out


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("fxpipe's profiling graph is not meant for backward")


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work before a clock is read: CUDA synchronisation, or nothing."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _time_node(gm: fx.GraphModule, node: fx.Node, env: dict[str, Any], device: torch.device,
               warmup: int, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of one node on its recorded inputs."""
    sync = device_sync(device)
    clone = _is_inplace(gm, node)
    params = [p for p in gm.get_submodule(node.target).parameters() if p.requires_grad] \
        if node.op == "call_module" else []
    fwd: list[float] = []
    bwd: list[float] = []
    i = 0
    while i < warmup + repeats or _noisy(fwd, bwd):
        i += 1
        leaves: list[torch.Tensor] = []

        def prepare(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                leaf = v.detach().requires_grad_(v.requires_grad)
                if leaf.requires_grad:
                    leaves.append(leaf)
                return leaf.clone() if clone else leaf
            return v

        args = tree_map(prepare, fx.node.map_arg(node.args, lambda n: env[n.name]))
        kwargs = tree_map(prepare, fx.node.map_arg(node.kwargs, lambda n: env[n.name]))
        sync()
        t0 = time.perf_counter()
        out = run_node(gm, node, args, kwargs)
        sync()
        t1 = time.perf_counter()
        outs = [t for t in _tensors(out) if t.requires_grad]
        wrt = leaves + params
        t2 = t3 = 0.0
        if outs and wrt:
            grads = [torch.ones_like(t) for t in outs]
            sync()
            t2 = time.perf_counter()
            torch.autograd.grad(outs, wrt, grads, allow_unused=True)
            sync()
            t3 = time.perf_counter()
        if i > warmup:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
    return statistics.median(fwd), statistics.median(bwd)


# A node is timed again until its runs add up to MIN_TIMED_S (at most MAX_REPEATS runs): a node of microseconds
# timed once is mostly the noise of one reading (a plan of a tiny model changed from run to run); the median of
# many is not. A node of milliseconds keeps the runs asked for.
MIN_TIMED_S = 1e-3
MAX_REPEATS = 10
# How far apart the predicted iterations of one plan were over fresh measurements on an idle 2-core machine
# (a tiny Qwen2 on two CPU workers: 22.0-24.3 ms); plans of measured costs closer than that are equally fast
# (fxpipe.planning.auto), so that the same model planned twice is planned alike.
MEASURED_NOISE = 0.05


def _noisy(fwd: list[float], bwd: list[float]) -> bool:
    """Whether a node's timings so far are too short in all to take their median as its time."""
    return len(fwd) < MAX_REPEATS and sum(fwd) + sum(bwd) < MIN_TIMED_S


def _time_in_graph(gm: fx.GraphModule, micro_inputs: tuple, costs: dict[str, NodeCost], clock: Clock,
                   warmup: int, repeats: int) -> None:
    """Replace the alone-timed forward and backward of every call node by whole-graph timing's."""
    calls = {n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")}
    alone = {name: (costs[name].fwd_s, costs[name].bwd_s) for name in calls}
    timed = time_graph(gm, micro_inputs, alone, clock, warmup, repeats)
    for name in calls:
        costs[name].fwd_s, costs[name].bwd_s = timed.fwd_s[name], timed.bwd_s[name]
    log.debug("graph timing: forward %.6fs, backward %.6fs", timed.fwd_total_s, timed.bwd_total_s)


def profile_graph(
    gm: fx.GraphModule,
    micro_inputs: tuple,
    device: torch.device,
    mode: str = "measure",
    warmup: int = 1,
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
    spec: "DeviceSpec | None" = None,
    timing: str | None = None,
    clock: Clock | None = None,
) -> dict[str, NodeCost]:
    """Costs of every node of ``gm`` for one micro-batch ``micro_inputs`` on ``device``
    (``analytic``: on a device described by ``spec``; ``device`` is then unused). ``timing`` (``"measure"``
    only): ``"node"`` or ``"graph"``, ``None`` for the device's default (:func:`default_timing`); ``clock``:
    what times ``"graph"`` (:func:`~fxpipe.cost.clock.clock_for` the device unless given)."""
    if mode not in PROFILE_MODES:
        raise ValueError(f"unknown profile mode {mode!r}; expected one of {', '.join(PROFILE_MODES)}")
    if timing is not None and timing not in TIMINGS:
        raise ValueError(f"unknown timing {timing!r}; expected one of {', '.join(TIMINGS)}")
    if mode == "analytic" and spec is None:
        raise ValueError("analytic profiling needs spec=DeviceSpec (e.g. fxpipe.cost.devices.PRESETS['h100'][0])")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"profiling needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    saved_buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    rng = torch.random.get_rng_state()
    try:
        recorder = _Recorder(gm, count_flops=(mode != "measure"), fused=(mode == "analytic"))
        with contextlib.ExitStack() as stack:
            if mode == "analytic":
                fake = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                # The module runs on fake copies of its parameters and buffers (so views of them,
                # like a linear's weight.t(), share their storages and are not counted as
                # activations); the copies are kept alive so that no storage identity is reused.
                state = {name: fake.from_tensor(t) for name, t in
                         list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers())}
                recorder._alive += [t.untyped_storage() for t in state.values()]
                recorder._seen |= {storage_key(t) for t in state.values()}
                stack.enter_context(_reparametrize_module(gm, state, tie_weights=True))
                micro_inputs = tuple(fake.from_tensor(x) if isinstance(x, torch.Tensor) else x
                                     for x in micro_inputs)
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(recorder.pack, _never_unpacked))
            recorder.run(*micro_inputs)
        # Keep detached values only: the recorded graph is not needed past this point.
        env = {n.name: _detach(v) for n, v in recorder.env.items()}
        recorder.env.clear()
        costs: dict[str, NodeCost] = {}
        counted: set[int] = set()
        nodes = list(gm.graph.nodes)
        for i, node in enumerate(nodes):
            cost = costs[node.name] = NodeCost()
            if node.op == "call_module":
                owned = list(gm.get_submodule(node.target).parameters())
            elif node.op == "get_attr" and isinstance(env.get(node.name), torch.nn.Parameter):
                owned = [env[node.name]]
            else:
                owned = []
            for p in owned:
                if id(p) not in counted:
                    counted.add(id(p))
                    cost.param_bytes += p.numel() * p.element_size()
            if node.op != "output":
                cost.output_bytes = _unique_bytes(_tensors(env.get(node.name)))
                cost.float_outputs = [(list(t.shape), t.element_size()) for t in _tensors(env.get(node.name))
                                      if t.is_floating_point() and t.requires_grad]
                cost.output_saved_by = next((recorder.saver[k] for k in map(storage_key, _tensors(env.get(node.name)))
                                             if k in recorder.saver), "")
            cost.act_bytes = recorder.act_bytes.get(node.name, 0)
            if node.op in ("call_module", "call_function", "call_method"):
                if mode == "measure":
                    cost.fwd_s, cost.bwd_s = _time_node(gm, node, env, device, warmup, repeats)
                else:
                    cost.flops = recorder.flops.get(node.name, 0)
                    moved = cost.output_bytes + sum(_unique_bytes(_tensors(env[a.name]))
                                                    for a in node.all_input_nodes)
                    if mode == "analytic":
                        outs = [t for t in _tensors(env.get(node.name)) if t.is_floating_point()]
                        cost.fwd_s = spec.forward_s(cost.flops, moved, outs[0].dtype if outs else torch.float32)
                    else:
                        kind = "cuda" if device.type == "cuda" else "cpu"
                        cost.fwd_s = max(cost.flops / _ESTIMATE_FLOPS[kind],
                                         moved / _ESTIMATE_BANDWIDTH[kind]) + ESTIMATE_OVERHEAD_S
                    cost.bwd_s = 2.0 * cost.fwd_s
            if progress is not None:
                progress(i + 1, len(nodes))
        if mode == "measure" and (timing or default_timing(device)) == "graph":
            env.clear()   # the recorded values: not needed by the whole-graph runs, which make their own
            _time_in_graph(gm, micro_inputs, costs, clock or clock_for(device), warmup, repeats)
    finally:
        with torch.no_grad():
            for name, b in gm.named_buffers():
                b.copy_(saved_buffers[name])
        torch.random.set_rng_state(rng)
    return costs
