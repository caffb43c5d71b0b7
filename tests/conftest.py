"""Test-session setup: give freed memory back to the OS between tests.

The torchvision sweep builds ~80 models in one process, some of 100-600M
parameters. glibc keeps freed heap memory for reuse, so the process would grow
towards the machine's 24 GiB; trimming after every test keeps it at what the
current test needs.
"""

import ctypes
import gc

import pytest

try:
    _libc = ctypes.CDLL("libc.so.6")
    _M_MMAP_THRESHOLD = -3
    _libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)  # big tensors in their own mappings, unmapped on free
except (OSError, AttributeError):  # not glibc: nothing to tune
    _libc = None


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)
