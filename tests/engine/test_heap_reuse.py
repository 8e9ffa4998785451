"""`reused_heap`: during a run a large buffer comes from the heap, not from pages mapped for it
alone; after the run glibc maps such buffers again."""

import ctypes

import pytest
import torch

from batchgen.engine.heap_reuse import glibc, reused_heap

BUFFER_BYTES = 48 * 2**20  # past glibc's largest adaptive mmap threshold (32 MB)


class MallocInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mapped_bytes_while_holding_a_buffer() -> int:
    """glibc's bytes in mmapped blocks while a fresh BUFFER_BYTES tensor is alive."""
    info = glibc().mallinfo2
    info.restype = MallocInfo
    buffer = torch.empty(BUFFER_BYTES, dtype=torch.uint8)
    mapped = info().hblkhd
    del buffer
    return mapped - info().hblkhd


@pytest.mark.skipif(glibc() is None or not hasattr(glibc(), "mallinfo2"), reason="not glibc >= 2.33")
def test_a_runs_large_buffers_come_from_the_heap_and_are_mapped_again_after():
    assert mapped_bytes_while_holding_a_buffer() >= BUFFER_BYTES
    with reused_heap():
        assert mapped_bytes_while_holding_a_buffer() == 0
    assert mapped_bytes_while_holding_a_buffer() >= BUFFER_BYTES
