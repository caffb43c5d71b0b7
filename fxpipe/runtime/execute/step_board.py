"""What a step's workers share: the board of finished operations (any failure wakes every worker), the failure
of an operation, each operation's timing, and running the workers on their threads (:mod:`fxpipe.runtime.execute.step`
runs a step on them)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from fxpipe.runtime.execute.worker import spawn_workers

__all__ = ["Board", "OpTiming", "StepFailure", "run_workers"]


@dataclass(frozen=True)
class OpTiming:
    """When one operation ran, in seconds from the start of the step."""

    kind: str         # "F", "B", or a split backward's "I" and "W" (a backward includes the recomputation of a
                      # checkpointed forward)
    stage: int
    micro_batch: int
    start_s: float
    end_s: float
    checkpointed: bool


class StepFailure(Exception):
    """An operation failed: which stage, micro-batch and pass, with the original exception."""

    def __init__(self, stage: int, micro_batch: int, kind: str, exc: BaseException) -> None:
        super().__init__(f"stage {stage} {kind} of micro-batch {micro_batch}: {exc}")
        self.stage, self.micro_batch, self.kind, self.exc = stage, micro_batch, kind, exc


class Board:
    """What has finished, shared by the workers; any failure wakes everyone."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done: set[tuple[str, int, int]] = set()
        self.failure: StepFailure | None = None

    def wait(self, needs: list[tuple[str, int, int]]) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.failure is not None or all(n in self.done for n in needs))
            return self.failure is None

    def finish(self, op: tuple[str, int, int]) -> None:
        with self.cond:
            self.done.add(op)
            self.cond.notify_all()

    def fail(self, failure: StepFailure) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = failure
            self.cond.notify_all()


def run_workers(work: Callable[[int], None], ids: list[int], board: Board, inline: bool = False) -> None:
    """``work(w)`` for every worker ``w`` of ``ids``, each on a thread of its own
    (:mod:`fxpipe.runtime.execute.worker`),
    until all have returned; ``inline`` with one worker: on the calling thread (what a profiler started there
    sees). Ctrl-C while they run stops every worker at its next operation before it is raised."""
    if inline and len(ids) == 1:
        try:
            work(ids[0])
        except Exception as exc:   # outside any operation (its own failures are the board's)
            board.fail(StepFailure(-1, -1, f"worker {ids[0]}", exc))
        return
    with spawn_workers(len(ids)) as pool:
        for lane, w in enumerate(ids):
            pool.submit(lane, w, lambda w=w: work(w))
        try:
            for _ in ids:
                w, ok, exc = pool.collect()
                if not ok:   # outside any operation (its own failures are the board's): stop the others too
                    board.fail(StepFailure(-1, -1, f"worker {w}", exc))
        except BaseException as interrupt:
            board.fail(StepFailure(-1, -1, "step", interrupt))
            raise   # spawn_workers waits for the workers before it returns
