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
does not depend on their values); parameter gradients already exist (fresh
zeros, as after a first step), so the number is activation memory plus the
transient buffers of forward and backward: what the schedule and checkpointing
change. The caller's gradients, BatchNorm statistics and the RNG state are
left as they were (:func:`fxpipe.runtime.execute.no_trace.leaving_no_trace`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.runtime.losses.losses import scalar_of
from fxpipe.runtime.execute.no_trace import leaving_no_trace
from fxpipe.runtime.backward.split_backward import WeightPass, backward_inputs, full_backward
from fxpipe.runtime.backward.recompute import checkpoint_stage, forward_saving_nothing
from solvers.schedules import BACKWARDS, get_schedule, worker_orders

# Kineto, the profiler's backend, writes two lines to stderr ("profiler_start", "profiler_stop") for every
# session, and compile opens hundreds; level 6 is above all its messages. Read once, when the profiler first
# starts, so a user's own KINETO_LOG_LEVEL (or a profiler they started before) wins.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

__all__ = ["WorkerMemory", "measure_worker_memory", "Allocations", "allocations", "Replay", "replaying", "stage_values"]


@dataclass(frozen=True)
class WorkerMemory:
    worker: int
    stages: list[int]
    peak_bytes: int        # above the memory in use before the replay
    events: int            # allocator events seen (0 means the measurement saw nothing)


@dataclass
class Allocations:
    """What the allocator did inside :func:`allocations`: the peak and the net of its running total."""

    peak_bytes: int = 0
    net_bytes: int = 0
    events: int = 0


@contextmanager
def allocations(device: torch.device) -> Iterator[Allocations]:
    """Measure the allocations of the block on ``device`` (CUDA: the caching allocator's counters; CPU:
    ``torch.profiler``'s memory events of the calling thread, summed in time order)."""
    found = Allocations()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield found
        torch.cuda.synchronize(device)
        found.peak_bytes = torch.cuda.max_memory_allocated(device) - base
        found.net_bytes = torch.cuda.memory_allocated(device) - base
        found.events = 1
        return
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield found
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    found.peak_bytes, found.net_bytes, found.events = peak, live, len(events)


def stage_values(pipe: Any, micro: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every stage's inputs and outputs per micro-batch, by name, from one forward without autograd."""
    seen: list[dict[str, Any]] = []
    with torch.no_grad():
        for mb in micro:
            env = dict(mb)
            for spec, device in zip(pipe.specs, pipe.devices):
                env.update(zip(spec.outputs, spec.module(*[_to(env[n], device) for n in spec.inputs])))
            seen.append(env)
    return seen


def _to(value: Any, device: torch.device, copy: bool = False) -> Any:
    """``value`` on ``device``; with ``copy`` fresh leaves that require grad where they can, as a transfer
    delivers them."""
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().to(device, copy=True).requires_grad_(t.is_floating_point()) if copy else t.to(device)
    return tree_map(move, value)


@contextmanager
def replaying(pipe: Any, micro: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Ready ``pipe`` for replays of ``micro``'s operations: yields :func:`stage_values`; parameter gradients
    exist (zeros, as after a first step); the caller's gradients, buffers and RNG come back as they were."""
    with leaving_no_trace(pipe):
        for q in pipe.parameters():
            if q.requires_grad:
                q.grad = torch.zeros_like(q)
        yield stage_values(pipe, micro)


def measure_worker_memory(pipe: Any, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                          schedule: str | None = None, worker: int | None = None,
                          chunks: int | None = None) -> list[WorkerMemory]:
    """Peak memory of each worker (or only ``worker``) for one :meth:`Pipeline.step` of ``inputs`` in ``chunks``
    (default the plan's) micro-batches."""
    schedule = schedule or pipe.schedule
    micro = pipe.inputs.micro_batches(inputs if isinstance(inputs, tuple) else (inputs,), {}, chunks)
    targets = pipe.inputs.micro_targets(target, len(micro))
    m = len(micro)
    workers = pipe._workers(schedule)
    orders = worker_orders(schedule, len(pipe.specs), m, workers)
    results = []
    with replaying(pipe, micro) as seen:
        for w in range(workers) if worker is None else [worker]:
            replay = Replay(pipe, seen, targets, loss_fn, lambda k, i: pipe._checkpointed(k, i, m),
                            split_backward=get_schedule(schedule).split_backward)
            with allocations(torch.device("cpu")) as found:
                for op in orders[w]:
                    replay.run(*op)
            results.append(WorkerMemory(w, sorted({k for _, k, _ in orders[w]}), found.peak_bytes, found.events))
    return results


class Replay:
    """A worker's operations run one by one on the calling thread, as :func:`fxpipe.runtime.execute.step.run_step`
    runs them:
    ``run("F", k, i)`` keeps the stage's inputs (fresh copies, as a transfer delivers them) and outputs until
    ``run("B", k, i)`` (``"I"`` under a split backward); the last stage's backward starts at
    ``loss_fn(output, target)`` (without ``loss_fn``, at gradients of ones like the other stages); with
    ``split_backward`` the weight gradients wait for ``run("W", k, i)``."""

    def __init__(self, pipe: Any, seen: list[dict[str, Any]], targets: list[Any] | None,
                 loss_fn: Callable | None, checkpointed: Callable[[int, int], bool], split_backward: bool) -> None:
        self.pipe, self.seen, self.targets, self.loss_fn = pipe, seen, targets, loss_fn
        self.checkpointed, self.split_backward = checkpointed, split_backward
        self.produced = {name for spec in pipe.specs for name in spec.outputs}
        self.held: dict[tuple[int, int], tuple[list[Any], list[Any], Callable[[], Any] | None]] = {}
        self.weights: dict[tuple[int, int], WeightPass] = {}

    def run(self, kind: str, k: int, i: int) -> None:
        spec = self.pipe.specs[k]
        if kind == "F":
            device = self.pipe.devices[k]
            args = [_to(self.seen[i][n], device, copy=n in self.produced) for n in spec.inputs]
            again = None
            if self.checkpointed(k, i) and self.split_backward:   # recomputed by hand, as run_step does
                outs, again = forward_saving_nothing(spec.module, *args)
            elif self.checkpointed(k, i):
                outs = checkpoint_stage(spec.module, *args, preserve_rng_state=False)
            else:
                outs = spec.module(*args)
            self.held[(k, i)] = (args, list(outs), again)
        elif kind in BACKWARDS:   # a whole backward, or a split one's input-gradient pass
            args, outs, again = self.held.pop((k, i))
            if again is not None:
                outs = list(again())
            roots, grads = [], []
            if k == len(self.pipe.specs) - 1 and self.loss_fn is not None:
                by_name = dict(zip(spec.outputs, outs))
                structure = fx.node.map_arg(self.pipe._output.args[0], lambda n: by_name[n.name]
                                            if n.name in by_name else self.seen[i][n.name])
                target = _to(self.targets[i], self.pipe.devices[k])
                roots, grads = [scalar_of(self.loss_fn(structure, target))], [torch.ones((), device=self.pipe.devices[k])]
            else:
                for t in tree_flatten(outs)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        roots.append(t)
                        grads.append(torch.ones_like(t))
            if kind == "I":
                leaves = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
                self.weights[(k, i)] = backward_inputs(roots, grads, leaves, list(spec.module.parameters()))
            else:
                self.weights[(k, i)] = full_backward(roots, grads)
            del args, outs, roots, grads
        else:
            self.weights.pop((k, i)).run()
