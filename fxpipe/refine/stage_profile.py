"""Profiling per fused group: every stage of a plan timed as a whole, alone, at the micro-batch size.

A per-node profile times each node by itself, its inputs and weights hot in
cache, with no Python between nodes and no gradient accumulation; summed over a
stage it is off by 10-30 % on a CPU (more for models of many small operations,
such as MobileNet). The planner needs per-node costs to place cuts, but once
the cuts are placed the stage itself can be timed: :func:`stage_factors` runs
micro-batch 0 through the stages in order to get each stage's real inputs, then
times each stage's forward (inputs from earlier stages as leaves that require
grad, as in :mod:`fxpipe.runtime.execute.step`) and its backward into ``.grad`` (ones as output
gradients; accumulation included, as in training), with warm-up, repeats and
their lower quartile (:func:`_typical`), alone on its device, on a worker
thread like the executor's; the last stage's backward starts at the training
loss when ``compile`` has ``loss_fn``, as it does in a step. The ratios to the
node sums scale the node costs (:func:`fxpipe.refine.calibrate.scale_costs`) and the
planner solves again; the compiler repeats until the cuts stop moving, so the
plan's stage times are the measured ones. How much slower a stage runs beside the others when CPU workers
share the processors is measured afterwards, on the final plan, in steps of its
schedule (:mod:`fxpipe.refine.contention`). A compiled stage (:mod:`fxpipe.runtime.execute.compiled`) compiles in
its first forward and backward: the warm-up, kept out of its times, and what it took beyond a typical run is
its compile time (``compile_seconds``, :func:`stage_compile_seconds`). Nothing is left behind: gradients, buffers
(BatchNorm statistics) and the RNG state are restored. ``calibrate=True``
covers what only a real step shows.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.runtime.execute.no_trace import leaving_no_trace
from fxpipe.cost.profile import device_sync
from fxpipe.runtime.execute.worker import spawn_workers

__all__ = ["stage_compile_seconds", "stage_factors"]

MIN_REPEATS = 5       # a stage's time is the lower quartile of at least this many runs (see _typical)


def _args(inputs: list[tuple[Any, bool]]) -> list[Any]:
    """Fresh leaves of a stage's inputs: those from earlier stages require grad, as in
    :mod:`fxpipe.runtime.execute.step`."""
    return [tree_map(lambda t, g=grad: t.detach().requires_grad_(g and t.is_floating_point())
                     if isinstance(t, torch.Tensor) else t, value) for value, grad in inputs]


Loss = Optional[Callable[[Any], torch.Tensor]]   # the last stage's outputs -> the training loss


def _once(module: torch.nn.Module, inputs: list[tuple[Any, bool]], sync: Callable[[], None],
          loss: Loss = None) -> tuple[float, float]:
    """One forward and one backward into ``.grad`` (from ``loss(outputs)`` when given, as the last stage's
    backward in a step; else ones as output gradients): their seconds."""
    args = _args(inputs)
    sync()
    t0 = time.perf_counter()
    out = module(*args)
    sync()
    t1 = time.perf_counter()
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        return t1 - t0, 0.0
    grads = None if loss is not None else [torch.ones_like(t) for t in outs]
    sync()
    t2 = time.perf_counter()
    if loss is not None:
        loss(out).backward()
    else:
        torch.autograd.backward(outs, grads)
    sync()
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def _typical(seconds: list[float]) -> float:
    """The lower quartile of a stage's runs. Slow runs come in bursts that a median does not reject: VGG-11's
    classifier backward (a 400 MB weight gradient) took 77, 1586, 1605, 1606, 91 ms in five runs in a row on
    this project's 2-core VM, each slow run the allocator growing the heap and faulting the gradient in afresh
    (steady state in a step: 135 ms with contention). Interference only ever adds time."""
    return sorted(seconds)[len(seconds) // 4]


def _loss(pipe: Any, spec: Any, env: dict[str, tuple[Any, bool]], device: torch.device, target: Any,
          loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Loss:
    """The training loss of micro-batch 0 from the last stage's outputs (None without ``loss_fn``)."""
    if loss_fn is None:
        return None
    mine = pipe.inputs.micro_targets(target)[0]
    mine = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, mine)

    def loss(out: Any) -> torch.Tensor:
        by_name = dict(zip(spec.outputs, out))
        return loss_fn(fx.node.map_arg(pipe._output.args[0], lambda n: by_name[n.name] if n.name in by_name
                                       else env[n.name][0]), mine)
    return loss


def _on_a_worker_thread(run: Callable[[], Any]) -> Any:
    """``run()`` on a worker thread, as the executor runs stages: glibc gives threads their own arenas, which
    map a tensor above 64 MiB afresh every time where the main thread's heap reuses it."""
    with spawn_workers(1) as worker:
        worker.submit(0, None, run)
        _, ok, value = worker.collect()
    if not ok:
        raise value
    return value


def stage_factors(pipe: Any, example_inputs: tuple, warmup: int = 1, repeats: int = 3, target: Any = None,
                  loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                  compile_seconds: list[float] | None = None) -> list[list[float]]:
    """Each stage's ``[forward, backward]`` time alone over its planned time; with ``loss_fn`` and a full
    batch's ``target`` the last stage's backward starts at the loss, as in a step. See the module doc.
    ``compile_seconds``, if given, receives per stage the seconds its first forward and backward took beyond
    its typical ones: the compile time of a compiled stage (:mod:`fxpipe.runtime.execute.compiled`)."""
    times = _measure(pipe, example_inputs, warmup, max(repeats, MIN_REPEATS), target, loss_fn, compile_seconds)
    return [[fwd / st.fwd_s if st.fwd_s > 0 else 1.0, bwd / st.bwd_s if st.bwd_s > 0 else 1.0]
            for (fwd, bwd), st in zip(times, pipe.plan.stages)]


def stage_compile_seconds(pipe: Any, example_inputs: tuple, target: Any = None,
                          loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> list[float]:
    """Compile every stage now, on micro-batch 0 as :func:`stage_factors` runs it (one forward and backward
    more, timed): per stage, the seconds its first forward and backward took beyond the second's."""
    seconds: list[float] = []
    _measure(pipe, example_inputs, 1, 1, target, loss_fn, seconds)
    return seconds


def _measure(pipe: Any, example_inputs: tuple, warmup: int, repeats: int, target: Any,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None,
             compile_seconds: list[float] | None) -> list[tuple[float, float]]:
    """Each stage's typical forward and backward seconds (``warmup`` untimed runs, the lower quartile of
    ``repeats``), and into ``compile_seconds`` how much longer its first forward and backward took."""
    micro = pipe.inputs.micro_batches(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,), {})[0]
    env: dict[str, tuple[Any, bool]] = {name: (value, False) for name, value in micro.items()}
    times = []
    last = len(pipe.specs) - 1
    with leaving_no_trace(pipe):
        for spec, device in zip(pipe.specs, pipe.devices):
            inputs = [(tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, env[name][0]),
                       env[name][1]) for name in spec.inputs]
            sync = device_sync(device)
            sync()
            started = time.perf_counter()
            with torch.enable_grad():   # which outputs require grad, as in training (and what a compiled stage
                outs = spec.module(*_args(inputs))   # guards on: inputs from earlier stages require grad)
            sync()
            first_forward = time.perf_counter() - started
            for name, value in zip(spec.outputs, outs):
                flat = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
                env[name] = (tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value),
                             any(t.requires_grad for t in flat))
            del outs
            loss = _loss(pipe, spec, env, device, target, loss_fn) if spec is pipe.specs[last] else None
            runs = _on_a_worker_thread(lambda: [_once(spec.module, inputs, sync, loss=loss)
                                                for _ in range(warmup + repeats)])
            fwd, bwd = _typical([f for f, _ in runs[warmup:]]), _typical([b for _, b in runs[warmup:]])
            times.append((fwd, bwd))
            if compile_seconds is not None:   # the forward compiled in the first call, the backward in the first run
                compile_seconds.append(max(0.0, first_forward - fwd) + max(0.0, runs[0][1] - bwd))
        return times
