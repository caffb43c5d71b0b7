"""The cost model's one call: every node's costs, from the profile cache or the profiler, with progress."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import torch
import torch.fx as fx

from fxpipe.cost.profile import profile_graph
from fxpipe.cost.profile_cache import ProfileCache, profile_key
from fxpipe.frontend.trace import run_failure
from fxpipe.options import ProfileOptions

__all__ = ["node_costs"]


def _progress(enabled: bool) -> Callable[[int, int], None] | None:
    if not enabled:
        return None
    start = time.perf_counter()
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        if done == total or (tty and done % max(1, total // 20) == 0):
            width = 30
            bar = "#" * (width * done // total)
            sys.stderr.write(f"\rprofiling [{bar:<{width}}] {done}/{total} nodes "
                             f"{time.perf_counter() - start:5.1f}s")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
    return report


def node_costs(gm: fx.GraphModule, fingerprint: str, first_micro_batch: tuple, device: torch.device,
               options: ProfileOptions) -> tuple[dict[str, Any], bool]:
    """Costs of every node of ``gm`` at the micro-batch size, and whether they came from the cache.

    A failure of the model on its example inputs is reported as a ``ValueError`` that says so."""
    cache = None if options.cache is False else ProfileCache(None if options.cache is True else options.cache)
    key = profile_key(fingerprint, device, first_micro_batch, options.mode, options.warmup, options.repeats)
    try:
        costs = cache.load(key, gm) if cache is not None else None
        cached = costs is not None
        if costs is None:
            costs = profile_graph(gm, first_micro_batch, device, mode=options.mode, warmup=options.warmup,
                                  repeats=options.repeats, progress=_progress(options.progress))
    except Exception as exc:
        raise run_failure(exc, gm, len(first_micro_batch)) from exc
    if cache is not None and not cached:
        cache.store(key, costs)
    return costs, cached
