"""Waiting for other ranks without hanging: receives waited for off the worker thread, peers' statuses heard at once.

gloo's receive can only be waited for by blocking (its ``is_completed`` stays false until ``wait`` is called,
it has no future, and a ``wait`` with a timeout closes the connection when it expires). So the blocking waits
run on threads of their own: a :class:`Receiver` waits for the worker's receives, one batch at a time, while
the worker waits on an event it can give up on, and a :class:`Statuses` thread per peer waits for that peer's
end-of-step status. A peer that failed is then known the moment its status lands, and the worker stops
waiting for data that will not come; the deadline bounds every wait (the data group's own timeout, the same
number, ends the abandoned blocking wait).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch

from fxpipe.distributed.wire import decode_status

__all__ = ["Receiver", "Statuses", "PeerFailed", "lost"]


class PeerFailed(Exception):
    """Another rank's step failed: its status, which names the rank, stage, micro-batch and pass (or, for a rank
    that is gone, :func:`lost`'s status)."""

    def __init__(self, status: dict[str, Any]) -> None:
        f = status["failure"]
        if f["kind"] == "lost":
            message = (f"rank {status['rank']} is gone: its connection closed during the step (the process was "
                       f"killed or crashed; its own log says why, if it could write one): {f['error']}")
        else:
            message = (f"rank {status['rank']} failed: stage {f['stage']} {f['kind']} of micro-batch "
                       f"{f['micro_batch']}: {f['error']}")
        super().__init__(message)
        self.status = status


def lost(rank: int, exc: BaseException) -> dict[str, Any]:
    """The status of a peer whose connection failed (a process killed with SIGKILL, a crashed host): it sent none,
    so this rank writes one for it, naming it; it is a root failure (``remote`` false), not a relayed one."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return {"rank": rank, "result": None,
            "failure": {"stage": -1, "micro_batch": -1, "kind": "lost", "error": first, "remote": False}}


class Receiver:
    """One thread that blocks on receives for the worker, which waits on an event it may abandon."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="fxpipe-receiver", daemon=True).start()

    def _loop(self) -> None:
        while True:
            works, done, errors = self.jobs.get()
            try:
                for work in works:
                    work.wait()
            except BaseException as exc:   # handed to the waiting worker
                errors.append(exc)
            done.set()

    def wait(self, works: list[Any], what: str, timeout_s: float, failed: Callable[[], Exception | None]) -> None:
        """Return when ``works`` have landed; raise a peer's failure (``failed()``) or a timeout naming ``what``."""
        done, errors = threading.Event(), []
        self.jobs.put((works, done, errors))
        end = time.monotonic() + timeout_s
        while not done.wait(0.05):   # returns at once when set; else looks for a failed peer every 50 ms
            exc = failed()
            if exc is not None:
                raise exc
            if time.monotonic() > end:
                raise TimeoutError(f"waited {timeout_s:g} s for {what}: that rank is stuck or gone "
                                   "(raise timeout_s if its stages are that slow)")
        if errors:
            raise errors[0]


class Statuses:
    """Each peer's status for one step, received by a thread per peer as soon as the peer sends it."""

    def __init__(self, peers: list[int], post: Callable[[int], tuple[Any, torch.Tensor]],
                 name: Callable[[int], int] = int) -> None:
        """``name(peer)`` is the peer's rank in messages (the global rank when ``peers`` are a sub-group's)."""
        self.name = name
        self.got: dict[int, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._listen, args=(peer, post), daemon=True,
                                         name=f"fxpipe-status-{peer}") for peer in peers]
        for t in self.threads:
            t.start()

    def _listen(self, peer: int, post: Callable[[int], tuple[Any, torch.Tensor]]) -> None:
        try:
            work, buf = post(peer)
            work.wait()
            status = decode_status(buf)
        except BaseException as exc:   # the peer is gone: its connection closed
            status = lost(self.name(peer), exc)
        self.hear(peer, status)

    def hear(self, peer: int, status: dict[str, Any]) -> None:
        """Record ``peer``'s status (a lost peer's too, found by a failed send or receive), unless one came."""
        with self.lock:
            self.got.setdefault(peer, status)

    def failure(self) -> PeerFailed | None:
        """The first failure a peer reported (lowest rank), if any."""
        with self.lock:
            failed = [s for _, s in sorted(self.got.items()) if s["failure"] is not None]
        return PeerFailed(failed[0]) if failed else None

    def collect(self, timeout_s: float) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """Every status that came within ``timeout_s``, and the peers that sent none."""
        end = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        with self.lock:
            got = dict(self.got)
        return got, [self.name(int(t.name.rsplit("-", 1)[1])) for t in self.threads if t.is_alive()]
