"""Measured peak memory per pipeline worker, on any device, by replaying its schedule alone.

On a GPU each device has its own allocator and ``torch.cuda.max_memory_allocated``
answers per device. CPU workers share one process and one allocator, and the
profiler records only the thread it runs on, so a multi-threaded step cannot be
split by worker. :func:`measure_worker_memory` therefore replays one worker's
operations, in its schedule's order, on the calling thread, under
``torch.profiler.profile(profile_memory=True)``: every allocation and free the
allocator reports during the replay (forward, loss, backward, recomputation,
weight pass) is summed in time order, and the peak of that running sum is the
worker's peak memory above what existed before. Its inputs arrive as fresh
copies at each forward (as a transfer would deliver them) and are dropped after
its backward; the gradients it receives are tensors of the right shape (memory
does not depend on their values); parameter gradients already exist (a warm-up
backward allocates ``.grad``), so the number is activation memory plus the
transient buffers of forward and backward: what the schedule and checkpointing
change. BatchNorm running statistics are restored after the replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from fxpipe.microbatch import scatter
from fxpipe.split_backward import WeightPass, backward_inputs, full_backward
from solvers.schedules import SPLIT_BACKWARD, worker_orders

__all__ = ["WorkerMemory", "measure_worker_memory"]


@dataclass(frozen=True)
class WorkerMemory:
    worker: int
    stages: list[int]
    peak_bytes: int        # above the memory in use before the replay
    events: int            # allocator events seen (0 means the measurement saw nothing)


def _peak(prof: Any) -> tuple[int, int]:
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, len(events)


def measure_worker_memory(pipe: Any, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                          schedule: str | None = None, worker: int | None = None) -> list[WorkerMemory]:
    """Peak memory of each worker (or only ``worker``) for one :meth:`Pipeline.step` of ``inputs``."""
    schedule = schedule or pipe.schedule
    specs, p = pipe.specs, len(pipe.specs)
    micro = pipe._micro_batches(inputs if isinstance(inputs, tuple) else (inputs,), {})
    targets = [t[0] for t in scatter([target], pipe.chunks)]
    m = len(micro)
    workers = pipe._workers(schedule)
    orders = worker_orders(schedule, p, m, workers)
    output_arg = pipe._output.args[0]
    # every stage's inputs and outputs per micro-batch, from one forward without autograd
    seen: list[dict[str, Any]] = []
    with torch.no_grad():
        for mb in micro:
            env = dict(mb)
            for spec in specs:
                env.update(zip(spec.outputs, spec.module(*[env[n] for n in spec.inputs])))
            seen.append(env)
    created = [q for q in pipe.parameters() if q.requires_grad and q.grad is None]
    for q in created:           # parameter gradients exist before the measurement, as after a first step
        q.grad = torch.zeros_like(q)
    buffers = {name: b.clone() for name, b in pipe.named_buffers()}
    results = []
    try:
        for w in range(workers) if worker is None else [worker]:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                _replay(pipe, orders[w], seen, targets, loss_fn, output_arg, schedule, m)
            peak, count = _peak(prof)
            results.append(WorkerMemory(w, sorted({k for _, k, _ in orders[w]}), peak, count))
    finally:
        with torch.no_grad():
            for name, b in pipe.named_buffers():
                b.copy_(buffers[name])
        for q in created:
            q.grad = None
    return results


def _fresh(value: Any) -> Any:
    return tree_map(lambda t: t.detach().clone().requires_grad_(t.is_floating_point())
                    if isinstance(t, torch.Tensor) else t, value)


def _replay(pipe: Any, order: list[tuple[str, int, int]], seen: list[dict[str, Any]], targets: list[Any],
            loss_fn: Callable, output_arg: Any, schedule: str, m: int) -> None:
    specs, p = pipe.specs, len(pipe.specs)
    produced = {name for spec in specs for name in spec.outputs}
    held: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}
    weights: dict[tuple[int, int], WeightPass] = {}
    for kind, k, i in order:
        spec = specs[k]
        if kind == "F":
            args = [_fresh(seen[i][n]) if n in produced else seen[i][n] for n in spec.inputs]
            if pipe._checkpointed(k, i, m):
                outs = torch_checkpoint(spec.module, *args, use_reentrant=False, preserve_rng_state=False)
            else:
                outs = spec.module(*args)
            held[(k, i)] = (args, list(outs))
        elif kind == "B":
            args, outs = held.pop((k, i))
            roots, grads = [], []
            if k == p - 1:
                by_name = dict(zip(spec.outputs, outs))
                structure = fx.node.map_arg(output_arg, lambda n: by_name[n.name] if n.name in by_name
                                            else seen[i][n.name])
                roots, grads = [loss_fn(structure, targets[i])], [torch.ones(())]
            else:
                for t in tree_flatten(outs)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        roots.append(t)
                        grads.append(torch.ones_like(t))
            if schedule in SPLIT_BACKWARD and not pipe._checkpointed(k, i, m):
                leaves = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
                weights[(k, i)] = backward_inputs(roots, grads, leaves, list(spec.module.parameters()))
            else:
                weights[(k, i)] = full_backward(roots, grads)
            del args, outs, roots, grads
        else:
            weights.pop((k, i)).run()
