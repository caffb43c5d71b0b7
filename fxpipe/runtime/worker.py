"""Worker threads, one per pipeline stage, alive for one pipeline call.

Threads are started on entry and joined on exit of :func:`spawn_workers`,
whatever happens in between, so a failed or interrupted call leaves no thread
behind (the same lifetime torchgpipe's ``spawn_workers`` gives).
"""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["Task", "Workers", "spawn_workers"]

Task = Callable[[], Any]
_STOP = object()


class Workers:
    """Submit ``(key, task)`` to worker ``i``; collect ``(key, ok, value_or_exception)``."""

    def __init__(self, count: int, name: str) -> None:
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in range(count)]
        self.outbox: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=self._loop, args=(box,), name=f"{name}-{i}", daemon=True)
                        for i, box in enumerate(self.inboxes)]
        for t in self.threads:
            t.start()

    def _loop(self, inbox: queue.Queue) -> None:
        while True:
            item = inbox.get()
            if item is _STOP:
                return
            key, task = item
            try:
                self.outbox.put((key, True, task()))
            except BaseException as exc:  # handed to the caller, never swallowed
                self.outbox.put((key, False, exc))

    def submit(self, worker: int, key: Any, task: Task) -> None:
        self.inboxes[worker].put((key, task))

    def collect(self) -> tuple[Any, bool, Any]:
        return self.outbox.get()

    def stop(self) -> None:
        for box in self.inboxes:
            box.put(_STOP)
        for t in self.threads:
            t.join()


@contextmanager
def spawn_workers(count: int, name: str = "fxpipe-stage") -> Iterator[Workers]:
    workers = Workers(count, name)
    try:
        yield workers
    finally:
        workers.stop()
