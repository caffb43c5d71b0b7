"""CUDA streams for the executor: a compute stream and a copy stream per device, no-ops on CPU.

Each worker enqueues its stage's kernels on its device's *compute stream* (the
stream current on that device when the step starts, so the caller's own work
before and after the step is ordered with it, as in torchgpipe). A value that
crosses devices is copied on *copy streams* (one per device, made here) with a
non-blocking copy, so the copy of micro-batch ``i`` overlaps the compute of
``i + 1``. Ordering is by events, never by synchronising the host:

1. after each operation the worker records an event on its compute stream
   (:meth:`DeviceStreams.record`);
2. the consumer's copy waits for that event on the source's copy stream, and
   copies under both devices' copy streams (PyTorch runs a GPU-to-GPU copy on
   the source's current stream after syncing the destination's);
3. the copy's own event is what the consumer's compute stream waits for
   (:meth:`DeviceStreams.wait`) before it reads the copy.

``record_stream`` keeps the caching allocator from handing a block to another
use while a stream that did not allocate it still reads it: the source tensor is
recorded on the source copy stream, the copy on the consumer's compute stream.
A copy to the CPU is blocking (the host reads it at once). Where no device is a
GPU every method does nothing and returns ``None``, so the CPU path is the same
code. PyTorch's current stream is per thread: a worker enters
:meth:`DeviceStreams.computing` for its device before it runs anything.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any, ContextManager, Iterable

import torch
from torch.utils._pytree import tree_map

__all__ = ["DeviceStreams", "Event"]

Event = Any   # torch.cuda.Event, or None where nothing needs waiting for


class DeviceStreams:
    """The compute and copy streams of a set of devices, for one step or one call."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        cuda = sorted({d for d in devices if d.type == "cuda"}, key=lambda d: d.index or 0)
        self.compute = {d: torch.cuda.current_stream(d) for d in cuda}
        self.copy = {d: torch.cuda.Stream(d) for d in cuda}

    def computing(self, device: torch.device) -> ContextManager[object]:
        """Make ``device`` current and its compute stream the current stream, in this thread."""
        if device not in self.compute:
            return nullcontext()
        stack = ExitStack()
        stack.enter_context(torch.cuda.device(device))
        stack.enter_context(torch.cuda.stream(self.compute[device]))
        return stack

    def record(self, device: torch.device) -> Event:
        """An event after everything enqueued so far on ``device``'s compute stream."""
        if device not in self.compute:
            return None
        return self.compute[device].record_event()

    def wait(self, device: torch.device, events: Iterable[Event]) -> None:
        """Make ``device``'s compute stream wait for ``events`` (``None`` entries are skipped)."""
        stream = self.compute.get(device)
        for event in events:
            if stream is not None and event is not None:
                stream.wait_event(event)

    def move(self, value: Any, device: torch.device, ready: Event = None) -> tuple[Any, Event]:
        """``value`` with its tensors on ``device`` (also inside tuples, lists, dicts), and the copy's event.

        ``ready`` is the producer's event (:meth:`record`): the copy starts after it. Wait
        for the returned event on ``device`` (:meth:`wait`) before reading the result on
        a GPU; it is ``None`` when nothing was copied to a GPU.
        """
        copied: list[torch.Tensor] = []

        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.device == device:
                return t
            moved = self._copy(t, device, ready)
            copied.append(moved)
            return moved
        moved_value = tree_map(one, value)
        target = self.copy.get(device)
        if target is None or not copied:
            return moved_value, None
        for t in copied:   # read later on the consumer's compute stream, not the copy stream it was made on
            t.record_stream(self.compute[device])
        return moved_value, target.record_event()

    def _copy(self, tensor: torch.Tensor, device: torch.device, ready: Event) -> torch.Tensor:
        source = tensor.device if tensor.device.type == "cuda" else None
        source_copy = self.copy.get(source) if source is not None else None
        target_copy = self.copy.get(device)
        if source is not None and source_copy is None:   # a GPU this step does not run on: its own stream
            source_copy = self.copy.setdefault(source, torch.cuda.Stream(source))
            self.compute.setdefault(source, torch.cuda.current_stream(source))
        if source_copy is None and target_copy is None:
            return tensor.to(device)
        with ExitStack() as stack:
            if source_copy is not None:
                if ready is not None:
                    source_copy.wait_event(ready)
                else:   # no event: everything enqueued on the source so far
                    source_copy.wait_stream(self.compute[source])
                stack.enter_context(torch.cuda.stream(source_copy))
            if target_copy is not None:
                stack.enter_context(torch.cuda.stream(target_copy))
            moved = tensor.to(device, non_blocking=device.type == "cuda")
        if source_copy is not None:   # the producer may drop it before the copy has run
            tensor.record_stream(source_copy)
        return moved
