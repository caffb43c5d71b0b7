"""``pipe(x)``'s forward: GPipe fill-drain over the micro-batches, one worker thread per stage.

At clock ``c`` stage ``k`` processes micro-batch ``c - k``; a clock ends when all its tasks have. Each task
runs inside a turn of the host (:mod:`fxpipe.runtime.execute.host`) on its device's compute stream, its inputs
moved there after their producer's event (:mod:`fxpipe.runtime.boundaries.streams`), in the caller's grad mode
and autocast (:mod:`fxpipe.runtime.execute.caller_state`), holding its device's generator when the stage is
random (:mod:`fxpipe.runtime.backward.rng`), under ``torch.utils.checkpoint`` where the stage's checkpoint mode
says so (:mod:`fxpipe.runtime.backward.recompute`). Backward is left to autograd: the values written back into
each micro-batch's environment are ordinary autograd tensors. Deferred BatchNorm statistics are committed once,
after every micro-batch (:mod:`fxpipe.runtime.execute.batchnorm`), and discarded when a stage failed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fxpipe.runtime.backward.recompute import checkpoint_stage
from fxpipe.runtime.backward.rng import rng_guard
from fxpipe.runtime.boundaries.streams import DeviceStreams, Event
from fxpipe.runtime.execute.batchnorm import commit_statistics, tracking
from fxpipe.runtime.execute.caller_state import CallerState
from fxpipe.runtime.execute.codegen import StageSpec
from fxpipe.runtime.execute.failures import forward_error
from fxpipe.runtime.execute.host import Host, Turns
from fxpipe.runtime.execute.worker import spawn_workers

__all__ = ["fill_drain"]


def fill_drain(owner: nn.Module, specs: list[StageSpec], devices: list[torch.device], micro: list[dict[str, Any]],
               caller: CallerState, checkpointed: Callable[[int, int, int], bool], random: list[bool],
               seed: int | None, host: Host) -> None:
    """Run every stage on every micro-batch, each stage's outputs written into the micro-batch's environment
    (``micro[i]``: value name -> value). ``checkpointed(k, i, m)``: whether stage ``k`` checkpoints micro-batch
    ``i`` of ``m``; ``owner``: the module whose deferred BatchNorm statistics are committed (or, when a stage
    failed, discarded before the first failure, by stage and micro-batch, is raised as a :class:`StageError`)."""
    m, p = len(micro), len(specs)
    streams = DeviceStreams(devices)
    turns = host.turns(devices, p)
    ready: list[dict[str, Event]] = [{} for _ in range(m)]   # micro-batch -> value name -> producer's event
    with spawn_workers(p) as workers:
        for clock in range(m + p - 1):
            tasks = [(k, clock - k) for k in range(p) if 0 <= clock - k < m]
            for k, i in tasks:
                workers.submit(k, (k, i), _task(specs[k], devices[k], k, i, micro[i], caller, checkpointed(k, i, m),
                                                random[k], seed, streams, turns, ready[i]))
            failures = []
            for _ in tasks:
                (k, i), ok, value = workers.collect()
                if not ok:
                    failures.append((k, i, value))
            if failures:
                commit_statistics(owner.modules(), discard=True)
                k, i, exc = min(failures, key=lambda f: (f[0], f[1]))
                raise forward_error(k, i, devices[k], exc) from exc
    commit_statistics(owner.modules())


def _task(spec: StageSpec, device: torch.device, k: int, i: int, env: dict[str, Any], caller: CallerState,
          checkpointed: bool, random: bool, seed: int | None, streams: DeviceStreams, turns: Turns,
          ready: dict[str, Event]) -> Callable[[], None]:
    """Stage ``k``'s forward of micro-batch ``i``, as a worker runs it."""
    use_checkpoint = caller.grad and checkpointed

    def run() -> None:
        with turns.turn(device), streams.computing(device):
            moved = [streams.move(env[name], device, ready.get(name)) for name in spec.inputs]
            streams.wait(device, [event for _, event in moved])
            inputs = [value for value, _ in moved]
            with caller.entered(keep_casts=True), tracking(), rng_guard(device, random, seed, k, i):
                if use_checkpoint:
                    outs = checkpoint_stage(spec.module, *inputs, preserve_rng_state=random)
                else:
                    outs = spec.module(*inputs)
            event = streams.record(device)
        for name, value in zip(spec.outputs, outs):
            env[name] = value
            ready[name] = event
    return run
