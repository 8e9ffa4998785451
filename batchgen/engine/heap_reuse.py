"""glibc's malloc, set to keep a run's large step buffers in the heap between steps.

A step's activations run to tens of MB (a 2,048-token chunk through Qwen2.5-0.5B's gate|up
product: 40 MB). glibc serves an allocation past its mmap threshold (at most 32 MB while it
adapts) with fresh pages and unmaps them on free, and returns the heap's free top to the system
past its trim threshold: each such product then faults its whole output in again, page by page.
`reused_heap` raises both thresholds for a run, so those buffers come from the heap and stay
there for the next step; on exit both go back to glibc's defaults and the heap's free memory is
handed back (`malloc_trim`). Where the C library is not glibc it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
DEFAULT_THRESHOLD = 128 * 1024  # glibc's default for both
RUN_MMAP_THRESHOLD = 256 * 2**20  # allocations below this come from the heap during a run
RUN_TRIM_THRESHOLD = 512 * 2**20  # free heap top kept during a run


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (it has `mallopt` and `malloc_trim`), else None."""
    try:
        library = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return library if hasattr(library, "mallopt") and hasattr(library, "malloc_trim") else None


@contextlib.contextmanager
def reused_heap() -> Iterator[None]:
    library = glibc()
    if library is None:
        yield
        return
    library.mallopt(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
    library.mallopt(M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD)
    try:
        yield
    finally:
        library.mallopt(M_MMAP_THRESHOLD, DEFAULT_THRESHOLD)
        library.mallopt(M_TRIM_THRESHOLD, DEFAULT_THRESHOLD)
        library.malloc_trim(0)
