"""Test helper: run a function on ``world`` real processes joined by a gloo group on 127.0.0.1 (a file
rendezvous), with a deadline.

Each process runs ``fn(rank, world, *args)`` and its return value (or the exception it raised, as text) comes
back to the test, one entry per rank. A process still running at the deadline is killed and the test fails:
a distributed test can fail, never hang.

The processes are forked from a forkserver that has imported torch, fxpipe and the Hugging Face models the tests
use (``PRELOAD``): a spawned process would import them again, 5-10 s of CPU each on the 2-core CI machine, for
every process of every group. Each process takes the test's environment and ``sys.path`` as they are when
``run_ranks`` is called (the forkserver's own are those it started with).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "rank_context"]

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
           "torch.distributed.checkpoint", "fxpipe", "fxpipe.distributed", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3"]


def _entry(rank: int, world: int, out: str, context: tuple[dict[str, str], list[str]], fn: Callable[..., Any],
           args: tuple) -> None:
    env, path = context   # the test's, as a spawned process would take them
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    faulthandler.enable()   # a native abort prints every thread's Python stack
    torch.set_num_threads(1)   # the machine is shared: one thread per rank
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"   # gloo's connections on 127.0.0.1
    # a file rendezvous: no port to choose, so no race with other jobs for a free one
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'rendezvous')}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result: Any = {"ok": fn(rank, world, *args)}
    except BaseException as exc:   # reported to the test, which asserts on it
        result = {"error": type(exc).__name__, "text": str(exc), "trace": traceback.format_exc()}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: after a step that failed on purpose, the receive a rank had
    # posted for data that never came is still being waited for by a daemon thread inside gloo, and tearing
    # the process down under it can abort ("terminate called without an active exception") after the result
    # above was written. A user's job exits non-zero at that point anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_context() -> tuple[dict[str, str], list[str]]:
    """What ``_entry`` gives its process of the test's: the environment and ``sys.path`` now."""
    return dict(os.environ), list(sys.path)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, deadline_s: float = 240.0) -> list[dict[str, Any]]:
    """``[{"ok": value} or {"error": exception type name, "text": message, "trace": traceback}]`` by rank."""
    with tempfile.TemporaryDirectory(prefix="fxpipe-dist-") as out:
        mp.get_context("forkserver").set_forkserver_preload(PRELOAD)   # read when the server first starts
        ctx = mp.start_processes(_entry, args=(world, out, rank_context(), fn, args), nprocs=world, join=False,
                                 start_method="forkserver")
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.1, end - time.monotonic())):
                if time.monotonic() > end:
                    raise AssertionError(f"the {world} processes did not finish within {deadline_s} s (a hang)")
        finally:   # at the deadline, and when the wait itself is ended (pytest-timeout): no rank outlives the test
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]
