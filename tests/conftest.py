"""Test-session setup: a private profile cache, and freed memory given back to the OS between tests.

Garbage is collected after every test, so a test's model is freed before the
next one builds its own. A full collection walks every object the process
holds: with torch, transformers, torchvision and timm imported that is ~440k
objects and about a second per test, half of the suite's time. Everything that
exists once the tests are collected (the imported libraries and the test
modules) is therefore frozen (:func:`gc.freeze`), and each collection walks
only what the tests made since.

The torchvision sweep builds ~80 models in one process, some of 100-600M
parameters. glibc keeps freed heap memory for reuse; trimming after every test
keeps the process near what the current test needs. (The OOM that prompted
this was a leak in the profiler, fixed there; this is a guard, not the fix.)
"""

import ctypes
import gc
import os
import tempfile

import pytest

# Tests must not read or leave costs in the user's cache: one fresh directory per session.
os.environ["FXPIPE_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxpipe-test-cache-")

try:
    _libc = ctypes.CDLL("libc.so.6")
    _M_MMAP_THRESHOLD = -3
    _libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)  # big tensors in their own mappings, unmapped on free
except (OSError, AttributeError):  # not glibc: nothing to tune
    _libc = None


def pytest_configure(config):
    """Under pytest-xdist, each worker's share of the processors: torch's default intra-op threads (one per core)
    in every worker oversubscribe them (2 workers x 2 threads on the 2-core CI machine, the pipelines' own worker
    threads on top), which made test_torchvision's first 150 s run 7 models instead of 40. The processes a worker
    starts (the CLI, ``torchrun``, ``pytest``) take the same share through ``OMP_NUM_THREADS``: with the default,
    each spins two OpenMP threads on processors the other worker is using."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        import torch
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


def pytest_collection_finish(session):
    """Freeze what collection imported: later collections skip it (it lives as long as the process)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)
