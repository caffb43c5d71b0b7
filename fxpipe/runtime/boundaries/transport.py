"""How values and gradients cross between stages during a step: the executor's only contact with where they live.

:func:`fxpipe.runtime.execute.step.run_step` never reads another stage's value or gradient directly; it asks a
:class:`Transport`. The transport here is the in-process one: every stage runs in this process (one
worker thread per device), a value one stage produced is read from a shared table and copied to the
consumer's device (:meth:`fxpipe.runtime.boundaries.streams.DeviceStreams.move`, ordered by the producer's event),
and a gradient is copied back to the device of the value it belongs to and summed with the other
consumers'. :class:`fxpipe.distributed.transport.P2P` subclasses it for one process per rank: the same
calls for stages of this rank, torch.distributed point-to-point for the others.

The consumer :data:`LOSS` is the loss, computed beside the last stage from the model's outputs.

With ``compression`` (:class:`fxpipe.runtime.boundaries.compression.BoundaryCompression`) a value that crosses from one
stage to another, and its gradient back, is what its codec's receiver decodes; either way :attr:`moved` counts
the bytes that crossed in the step (``raw``: as produced, ``sent``: as encoded), measured on the tensors.
"""

from __future__ import annotations

import functools
import operator
import threading
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.runtime.execute.codegen import StageSpec
from fxpipe.runtime.boundaries.compression import BoundaryCompression
from fxpipe.runtime.losses.losses import Replicas
from fxpipe.runtime.boundaries.streams import DeviceStreams, Event

__all__ = ["LOSS", "Transport", "fresh_leaves"]

LOSS = -1   # the consumer that computes the loss, on the last stage's device


def fresh_leaves(value: Any, device: torch.device, streams: DeviceStreams, ready: Event) -> tuple[Any, Event]:
    """A consumer's copy of a value (tensors inside tuples and lists too): fresh autograd leaves, and the
    copy's event (:meth:`DeviceStreams.move`): autograd is cut at every stage boundary."""
    flat, structure = tree_flatten(value)
    moved, event = streams.move([t.detach() if isinstance(t, torch.Tensor) else t for t in flat], device, ready)
    leaves = [m.requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else m for t, m in zip(flat, moved)]
    return tree_unflatten(leaves, structure), event


class Transport:
    """In-process: every stage is here; values and gradients go through tables shared by the worker threads.

    One object serves one step at a time: :meth:`begin` resets it."""

    compression: BoundaryCompression | None = None   # set by the pipeline (fxpipe.CompileOptions.compression)
    replicas: Replicas | None = None   # dp copies of the pipeline (fxpipe.distributed.mesh): how losses combine
    # called with a stage before its last backward of a step (not under a split backward): FSDP2 reduces each
    # block's gradients from there, as the blocks' backwards end (fxpipe.distributed.parallel.replicas)
    before_last_backward: Callable[[int], None] | None = None
    remote = False   # whether other processes run some of the stages (fxpipe.distributed.transport.P2P)

    def local(self, stage: int) -> bool:
        """Whether ``stage`` (or :data:`LOSS`) runs in this process."""
        return True

    def workers(self, count: int) -> list[int]:
        """The workers (of ``count``) whose operations this process runs."""
        return list(range(count))

    def begin(self, specs: list[StageSpec], devices: list[torch.device], streams: DeviceStreams,
              micro_inputs: list[dict[str, Any]], output_names: list[str]) -> None:
        """Start a step: the stages, their devices, the micro-batches' inputs and the names the loss reads."""
        self.specs, self.devices, self.streams = specs, devices, streams
        self.producer = {name: k for k, spec in enumerate(specs) for name in spec.outputs}
        self.readers: dict[str, list[int]] = {name: [] for name in self.producer}   # consumer stages, LOSS
        for k, spec in enumerate(specs):
            for name in spec.inputs:
                if name in self.producer:
                    self.readers[name].append(k)
        for name in output_names:
            if name in self.producer:
                self.readers[name].append(LOSS)
        self.envs = [dict(mb) for mb in micro_inputs]   # name -> value as produced (attached to its graph)
        self.ready: dict[tuple[str, int], Event] = {}   # (name, mb) -> the producer's event
        self.origin: dict[tuple[str, int], list[Any]] = {}   # (name, mb) -> device of each flat leaf
        # (stage, mb) -> output name -> flat position -> gradients from its consumers, each with its copy's event
        self.grads: dict[tuple[int, int], dict[str, dict[int, list[tuple[torch.Tensor, Event]]]]] = {}
        self.lock = threading.Lock()
        self.moved = {"raw": 0, "sent": 0}   # bytes that crossed between stages this step, both directions
        self.unread = {(i, name): sum(self.local(c) for c in cs)
                       for i in range(len(micro_inputs)) for name, cs in self.readers.items()}

    # ------------------------------------------------------------------ forward: values
    def placeholder(self, name: str, i: int, device: torch.device) -> tuple[Any, Event]:
        """A model input of micro-batch ``i`` on ``device`` (no autograd cut: the caller's leaves stay leaves)."""
        return self.streams.move(self.envs[i][name], device)

    def publish(self, k: int, i: int, outs: dict[str, Any], ready: Event) -> None:
        """Stage ``k``'s outputs of micro-batch ``i``, after its forward (``ready``: its compute event)."""
        for name, value in outs.items():
            self.envs[i][name] = value
            self.ready[(name, i)] = ready
            self.origin[(name, i)] = [t.device if isinstance(t, torch.Tensor) else None
                                      for t in tree_flatten(value)[0]]

    def fetch(self, name: str, consumer: int, i: int, device: torch.device) -> tuple[Any, Event]:
        """The consumer's copy of value ``name`` of micro-batch ``i``, as fresh leaves on ``device``."""
        value = self._cross(self.envs[i][name], self.producer[name], consumer, ("F", name, consumer, i))
        value, event = fresh_leaves(value, device, self.streams, self.ready.get((name, i)))
        with self.lock:   # a value every consumer here has read is dropped (the producer keeps it to its B)
            self.unread[(i, name)] -= 1
            if self.unread[(i, name)] == 0:
                del self.envs[i][name]
        return value, event

    # ------------------------------------------------------------------ backward: gradients
    def send_grads(self, name: str, consumer: int, i: int, value: Any, ready: Event) -> None:
        """The gradients of the consumer's leaves ``value`` (from :meth:`fetch`), back to the producer."""
        devices = self.origin[(name, i)]
        for pos, leaf in enumerate(tree_flatten(value)[0]):
            if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
                grad = self._cross(leaf.grad, self.producer[name], consumer, ("B", name, consumer, i, pos))
                self._add(name, i, pos, *self.streams.move(grad, devices[pos], ready))

    def _cross(self, value: Any, producer: int, consumer: int, key: tuple[Any, ...]) -> Any:
        """``value`` (a pytree) as the consumer receives it across the boundary, counted in :attr:`moved`:
        decoded where it is compressed (float tensors that carry gradients), itself otherwise."""
        if (len(self.specs) - 1 if consumer == LOSS else consumer) == producer:
            return value   # the loss beside its own stage: nothing crosses
        flat, structure = tree_flatten(value)
        raw = sent = 0
        out = []
        for pos, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                size = t.numel() * t.element_size()
                if self.compression is not None and (key[0] == "B" or t.requires_grad):
                    t, size = self.compression.send(producer, key + (pos,), t)
                raw, sent = raw + t.numel() * t.element_size(), sent + size
            out.append(t)
        with self.lock:
            self.moved["raw"] += raw
            self.moved["sent"] += sent
        return tree_unflatten(out, structure)

    def _add(self, name: str, i: int, pos: int, grad: torch.Tensor, event: Event) -> None:
        with self.lock:
            acc = self.grads.setdefault((self.producer[name], i), {}).setdefault(name, {})
            acc.setdefault(pos, []).append((grad, event))

    def received(self, k: int, i: int) -> dict[str, dict[int, torch.Tensor]]:
        """The output gradients of ``(k, i)`` summed over its consumers, after their copies have landed."""
        with self.lock:
            got = self.grads.pop((k, i), {})
        self.streams.wait(self.devices[k], [event for by_pos in got.values() for parts in by_pos.values()
                                            for _, event in parts])
        for name in self.specs[k].outputs:
            self.origin.pop((name, i), None)
        return {name: {pos: functools.reduce(operator.add, [g for g, _ in parts]) for pos, parts in by_pos.items()}
                for name, by_pos in got.items()}

    # ------------------------------------------------------------------ the end of a step
    def end(self, failure: Any, result: Callable[[], dict[str, Any] | None]) -> tuple[Any, dict[str, Any] | None]:
        """After every process has ended the step: its failure (``None``: none) and, for a process without the
        last stage, the result ``result()`` gave where the loss ran (loss and count). In-process the failure is
        this process's and the loss is here (``None``)."""
        return failure, None
