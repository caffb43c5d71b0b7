"""Worker threads for the stages: long-lived, lent to one pipeline call or step at a time.

A new thread's first operators are slow: the math libraries set up their per-thread state on first use
(measured on CPU: 3-7 ms for the first ``nn.Linear`` calls of a fresh thread, against 0.01-0.2 ms in a warm
one; on a GPU, each new thread also takes its own cuBLAS handle and workspace). A pipeline that started
threads for every step paid that on every step: 0.91x the plain model with one stage and one micro-batch.
So the threads here outlive the call: :data:`POOL` keeps idle ones, :func:`spawn_workers` borrows ``count``
of them for one call or step and gives them back when every task it submitted has finished, whatever
happened in between (a failed or interrupted call leaves nothing running, as torchgpipe's ``spawn_workers``
promises, though the idle threads stay for the next call). ``concurrent.futures.ThreadPoolExecutor`` hands a
task to any idle thread; a stage needs *its* worker for every task of a call (its operations in order, on
one thread), hence lanes: a thread per lane, a queue per thread.
"""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["Task", "Workers", "spawn_workers", "POOL"]

Task = Callable[[], Any]


class _Lane:
    """One daemon thread running the tasks put in its inbox, in order."""

    def __init__(self, name: str) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.inbox.get()()


class _Pool:
    """The process's idle lanes; new ones are started when more are borrowed than are idle."""

    def __init__(self) -> None:
        self._idle: list[_Lane] = []
        self._lock = threading.Lock()
        self.size = 0

    def borrow(self, count: int) -> list[_Lane]:
        with self._lock:
            lanes = [self._idle.pop() for _ in range(min(count, len(self._idle)))]
            start, self.size = self.size, self.size + count - len(lanes)
        return lanes + [_Lane(f"fxpipe-worker-{start + i}") for i in range(count - len(lanes))]

    def give_back(self, lanes: list[_Lane]) -> None:
        with self._lock:
            self._idle.extend(lanes)

    def busy(self) -> int:
        """Lanes lent out now (0 between calls)."""
        with self._lock:
            return self.size - len(self._idle)


POOL = _Pool()


class Workers:
    """Submit ``(key, task)`` to worker ``i``; collect ``(key, ok, value_or_exception)``."""

    def __init__(self, lanes: list[_Lane]) -> None:
        self.lanes = lanes
        self.outbox: queue.Queue = queue.Queue()

    def submit(self, worker: int, key: Any, task: Task) -> None:
        def run() -> None:
            try:
                self.outbox.put((key, True, task()))
            except BaseException as exc:  # handed to the caller, never swallowed
                self.outbox.put((key, False, exc))
        self.lanes[worker].inbox.put(run)

    def collect(self) -> tuple[Any, bool, Any]:
        return self.outbox.get()

    def finish(self) -> None:
        """Wait until every lane has run everything submitted to it (a marker task at the end of each queue)."""
        done = [threading.Event() for _ in self.lanes]
        for lane, event in zip(self.lanes, done):
            lane.inbox.put(event.set)
        for event in done:
            event.wait()


@contextmanager
def spawn_workers(count: int) -> Iterator[Workers]:
    """``count`` workers for one call or step, given back to :data:`POOL` once all their tasks have finished."""
    workers = Workers(POOL.borrow(count))
    try:
        yield workers
    finally:
        workers.finish()
        POOL.give_back(workers.lanes)
