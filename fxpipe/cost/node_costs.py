"""The cost model's one call: every node's costs, from the profile cache or the profiler, with progress."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable

import torch
import torch.fx as fx
from tqdm import tqdm

from fxpipe.cost.graph_timing import default_timing
from fxpipe.cost.profile import profile_graph
from fxpipe.cost.profile_cache import ProfileCache, profile_key
from fxpipe.frontend.failures import run_failure
from fxpipe.options import ProfileOptions

__all__ = ["node_costs"]

log = logging.getLogger(__name__)   # under the "fxpipe" logger


def _progress(enabled: bool) -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    """A progress callback for the profiler and what closes it: a tqdm bar on a terminal (stderr), nothing
    where stderr is not one (a log file, CI), so that logs are not filled with carriage returns."""
    if not enabled or not sys.stderr.isatty():
        return None, lambda: None
    bars: list[tqdm] = []   # made at the first report, when the number of nodes is known

    def report(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, desc="profiling", unit="node", file=sys.stderr))
        bars[0].update(done - bars[0].n)
    return report, lambda: [bar.close() for bar in bars]


def node_costs(gm: fx.GraphModule, fingerprint: str, first_micro_batch: tuple, device: torch.device,
               options: ProfileOptions, compiled: dict[str, Any] | None = None) -> tuple[dict[str, Any], bool]:
    """Costs of every node of ``gm`` at the micro-batch size, and whether they came from the cache.
    ``compiled``: the stages' ``torch.compile`` arguments (``None`` when eager), part of the cache key.

    A failure of the model on its example inputs is reported as a ``ValueError`` that says so."""
    timing = options.timing or default_timing(device)   # "graph" on CUDA, "node" elsewhere
    cache = None if options.cache is False else ProfileCache(None if options.cache is True else options.cache)
    key = profile_key(fingerprint, device, first_micro_batch, options.mode, options.warmup, options.repeats,
                      compiled=compiled, timing=timing)
    try:
        costs = cache.load(key, gm) if cache is not None else None
        cached = costs is not None
        if costs is None:
            started = time.perf_counter()
            progress, close = _progress(options.progress)
            try:
                costs = profile_graph(gm, first_micro_batch, device, mode=options.mode, warmup=options.warmup,
                                      repeats=options.repeats, progress=progress, timing=timing)
            finally:
                close()
            log.info("profiled %d nodes (%s, effort %s) in %.1fs", len(costs), options.mode, options.effort,
                     time.perf_counter() - started)
    except Exception as exc:
        raise run_failure(exc, gm, len(first_micro_batch)) from exc
    if cached:
        log.info("read the costs of %d nodes from the profile cache (%s)", len(costs), cache.directory)
    if cache is not None and not cached:
        cache.store(key, costs)
    return costs, cached
