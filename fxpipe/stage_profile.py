"""Profiling per fused group: every stage of a plan timed as a whole, alone, at the micro-batch size.

A per-node profile times each node by itself, its inputs and weights hot in
cache, with no Python between nodes and no gradient accumulation; summed over a
stage it is off by 10-30 % on a CPU (more for models of many small operations,
such as MobileNet). The planner needs per-node costs to place cuts, but once
the cuts are placed the stage itself can be timed: :func:`stage_factors` runs
micro-batch 0 through the stages in order to get each stage's real inputs, then
times each stage's forward (inputs from earlier stages as leaves that require
grad, as in :mod:`fxpipe.step`) and its backward into ``.grad`` (ones as output
gradients; accumulation included, as in training), with warm-up, repeats and
median, alone on its device, on a worker thread like the executor's; the last
stage's backward starts at the training loss when ``compile`` has ``loss_fn``,
as it does in a step. The ratios to the node sums scale the node costs
(:func:`fxpipe.calibrate.scale_costs`) and the planner solves again; the
compiler repeats until the cuts stop moving, so the plan's stage times are the
measured ones. On CPU workers it also runs all stages at once, each on its own
thread, taking turns on the cores as the executor does (:mod:`fxpipe.core_turns`),
three times, and records how much slower each stage's forward and backward go
together (``stage_efficiency``: alone over together; ``parallel_efficiency``:
the median over the stages). That is the contention for caches and memory
bandwidth of *this* model, stage by stage (a bandwidth-bound layer suffers more
than a compute-bound one), which ``pipe.report()`` then uses in place of
:mod:`fxpipe.cpu_sharing`'s synthetic mix. Nothing is left behind: gradients, buffers (BatchNorm statistics) and the
RNG state are restored. ``calibrate=True`` covers what only a real step shows.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.core_turns import CoreTurns
from fxpipe.cpu_sharing import cores_per_worker
from fxpipe.microbatch import scatter
from fxpipe.no_trace import leaving_no_trace
from fxpipe.profile import device_sync
from fxpipe.worker import spawn_workers

__all__ = ["stage_factors", "StageProfile"]

_CPU = torch.device("cpu")
MIN_REPEATS = 5       # a stage's time is a median of at least this many runs: a shared machine has slow moments
TOGETHER_ROUNDS = 3


def _args(inputs: list[tuple[Any, bool]]) -> list[Any]:
    """Fresh leaves of a stage's inputs: those from earlier stages require grad, as in :mod:`fxpipe.step`."""
    return [tree_map(lambda t, g=grad: t.detach().requires_grad_(g and t.is_floating_point())
                     if isinstance(t, torch.Tensor) else t, value) for value, grad in inputs]


Loss = Optional[Callable[[Any], torch.Tensor]]   # the last stage's outputs -> the training loss


def _once(module: torch.nn.Module, inputs: list[tuple[Any, bool]], sync: Callable[[], None],
          turn: Callable[[], ContextManager[Any]] = nullcontext, loss: Loss = None) -> tuple[float, float]:
    """One forward and one backward into ``.grad`` (from ``loss(outputs)`` when given, as the last stage's
    backward in a step; else ones as output gradients), each in a ``turn()``: their seconds."""
    args = _args(inputs)
    with turn():
        sync()
        t0 = time.perf_counter()
        out = module(*args)
        sync()
        t1 = time.perf_counter()
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        return t1 - t0, 0.0
    grads = None if loss is not None else [torch.ones_like(t) for t in outs]
    with turn():
        sync()
        t2 = time.perf_counter()
        if loss is not None:
            loss(out).backward()
        else:
            torch.autograd.backward(outs, grads)
        sync()
        t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def _stage_times(module: torch.nn.Module, inputs: list[tuple[Any, bool]], device: torch.device, warmup: int,
                 repeats: int, loss: Loss = None) -> tuple[float, float]:
    """Median forward and backward seconds of one stage on ``inputs`` (``(value, requires_grad)`` pairs)."""
    sync = device_sync(device)
    runs = [_once(module, inputs, sync, loss=loss) for _ in range(warmup + repeats)][warmup:]
    return statistics.median(f for f, _ in runs), statistics.median(b for _, b in runs)


def _together(modules: list[torch.nn.Module], inputs: list[list[tuple[Any, bool]]], warmup: int,
              repeats: int, losses: list[Loss]) -> list[tuple[float, float]]:
    """Median forward and backward seconds of each CPU stage while all of them run at once, one thread each,
    taking turns on the cores as the executor's workers do (:mod:`fxpipe.core_turns`).

    Every thread goes on until all have done ``warmup + repeats`` runs; a thread's runs
    that end after the first thread's last one started are dropped (it was no longer shared)."""
    k = len(modules)
    turns = CoreTurns(k)
    barrier = threading.Barrier(k)
    runs: list[list[tuple[float, float, float, float]]] = [[] for _ in range(k)]
    done = [False] * k
    failure: list[BaseException] = []

    def loop(j: int) -> None:
        try:
            barrier.wait()
            while not all(done) and not failure:
                start = time.perf_counter()
                fwd, bwd = _once(modules[j], inputs[j], lambda: None, lambda: turns.turn(_CPU), losses[j])
                runs[j].append((start, time.perf_counter(), fwd, bwd))
                done[j] = done[j] or len(runs[j]) >= warmup + repeats
        except BaseException as exc:   # re-raised on the caller's thread
            failure.append(exc)
            barrier.abort()
    threads = [threading.Thread(target=loop, args=(j,), name=f"fxpipe-stage-profile-{j}") for j in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failure:
        raise failure[0]
    shared_until = min(r[-1][0] for r in runs)
    medians = []
    for r in runs:
        inside = [run for run in r[warmup:] if run[1] <= shared_until] or r[warmup:]
        medians.append((statistics.median(run[2] for run in inside), statistics.median(run[3] for run in inside)))
    return medians


def _loss(pipe: Any, spec: Any, env: dict[str, tuple[Any, bool]], device: torch.device, target: Any,
          loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Loss:
    """The training loss of micro-batch 0 from the last stage's outputs (None without ``loss_fn``)."""
    if loss_fn is None:
        return None
    mine = scatter([target], pipe.chunks)[0][0]
    mine = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, mine)

    def loss(out: Any) -> torch.Tensor:
        by_name = dict(zip(spec.outputs, out))
        return loss_fn(fx.node.map_arg(pipe._output.args[0], lambda n: by_name[n.name] if n.name in by_name
                                       else env[n.name][0]), mine)
    return loss


def _on_a_worker_thread(run: Callable[[], Any]) -> Any:
    """``run()`` on a worker thread, as the executor runs stages: glibc gives threads their own arenas, which
    map a tensor above 64 MiB afresh every time where the main thread's heap reuses it."""
    with spawn_workers(1, "fxpipe-stage-profile") as worker:
        worker.submit(0, None, run)
        _, ok, value = worker.collect()
    if not ok:
        raise value
    return value


@dataclass
class StageProfile:
    """Each stage's measured/planned ``[forward, backward]`` ratio, and on CPU how fast stages run together."""

    factors: list[list[float]]
    parallel_efficiency: float | None = None   # alone / together, median over the stages run at once
    stage_efficiency: list[list[float]] | None = None   # per stage, [forward, backward] alone / together


def stage_factors(pipe: Any, example_inputs: tuple, warmup: int = 1, repeats: int = 3,
                  together: bool = True, target: Any = None,
                  loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> StageProfile:
    """Time every stage of ``pipe`` alone, and (CPU workers, ``together``) all at once taking turns on the
    cores; with ``loss_fn`` and a full batch's ``target`` the last stage's backward starts at the loss, as in a
    step. See the module doc."""
    micro = pipe._micro_batches(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,), {})[0]
    env: dict[str, tuple[Any, bool]] = {name: (value, False) for name, value in micro.items()}
    factors, stage_inputs, alone, losses = [], [], [], []
    last = len(pipe.specs) - 1
    with leaving_no_trace(pipe):
        for spec, device, st in zip(pipe.specs, pipe.devices, pipe.plan.stages):
            inputs = [(tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, env[name][0]),
                       env[name][1]) for name in spec.inputs]
            with torch.enable_grad():   # which outputs require grad, as in training
                outs = spec.module(*[value for value, _ in inputs])
            for name, value in zip(spec.outputs, outs):
                flat = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
                env[name] = (tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value),
                             any(t.requires_grad for t in flat))
            del outs
            loss = _loss(pipe, spec, env, device, target, loss_fn) if spec is pipe.specs[last] else None
            fwd, bwd = _on_a_worker_thread(lambda: _stage_times(spec.module, inputs, device, warmup,
                                                                 max(repeats, MIN_REPEATS), loss))
            factors.append([fwd / st.fwd_s if st.fwd_s > 0 else 1.0, bwd / st.bwd_s if st.bwd_s > 0 else 1.0])
            stage_inputs.append(inputs)
            losses.append(loss)
            alone.append((fwd, bwd))
        efficiency = stages = None
        if together and len(pipe.specs) >= 2 and int(cores_per_worker()) >= 2 and \
                all(d.type == "cpu" for d in pipe.devices):
            # three rounds, each stage's median time: one round the machine was busy must not set the contention
            rounds = [_together([s.module for s in pipe.specs], stage_inputs, warmup, repeats, losses)
                      for _ in range(TOGETHER_ROUNDS)]

            def ratio(alone_s: float, together_s: list[float]) -> float:
                return min(1.0, alone_s / statistics.median(together_s)) if alone_s > 0 else 1.0
            stages = [[ratio(a[j], [got[k][j] for got in rounds]) for j in (0, 1)] for k, a in enumerate(alone)]
            efficiency = statistics.median(ratio(sum(a), [sum(got[k]) for got in rounds]) for k, a in enumerate(alone))
        return StageProfile(factors, efficiency, stages)

