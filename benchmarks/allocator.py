"""glibc tunables that keep freed memory mapped, for the benchmarks' processes.

glibc hands freed memory back to the OS: a worker thread's arena unmaps each
64 MiB heap as soon as it empties, and the main heap is trimmed above a
threshold, so every training step faults its activations back in, page by
page. On this VM a fault is expensive (GPipe steps of 1.2-2.2 s instead of
1.2 s, a ResNet conv 2.5 ms alone but 4.4-6.4 ms right after its backward).
``MALLOC_TOP_PAD_`` above the heap size stops both the unmapping and the
shrinking of thread arenas, ``MALLOC_TRIM_THRESHOLD_`` the trimming of the main
heap, ``MALLOC_MMAP_THRESHOLD_`` the per-tensor mappings of large tensors, and
``MALLOC_ARENA_MAX=1`` puts the worker threads on the main heap too (a thread
arena's heaps are 64 MiB: a larger tensor, VGG's 400 MB classifier gradient,
is mapped and faulted in afresh every time there). The
same as jemalloc or tcmalloc (PyTorch's CPU tuning guide) give by default.
glibc reads them when a process starts: :func:`keep_freed_memory` re-executes
the running script with them set; child processes inherit them.
"""

from __future__ import annotations

import os
import sys

__all__ = ["KEEP_FREED_MEMORY", "keep_freed_memory"]

KEEP_FREED_MEMORY = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
                     "MALLOC_TOP_PAD_": str(1 << 28)}


def keep_freed_memory() -> None:
    """Re-run this script with :data:`KEEP_FREED_MEMORY` in its environment, unless it already has it."""
    if all(os.environ.get(k) == v for k, v in KEEP_FREED_MEMORY.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **KEEP_FREED_MEMORY})
