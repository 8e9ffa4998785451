"""`reused_heap`: during a run a large buffer comes from the heap, not from pages mapped for it
alone; after the run glibc maps such buffers again. Measured in a fresh process: a heap that
earlier runs left with large free chunks serves a buffer from them whatever the thresholds."""

import json
import subprocess
import sys

import pytest

from batchgen.engine.heap_reuse import glibc

MAPPED_BYTES = """
import ctypes, json
import torch
from batchgen.engine.heap_reuse import glibc, reused_heap

BUFFER_BYTES = 48 * 2**20  # past glibc's largest adaptive mmap threshold (32 MB)


class MallocInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mapped_bytes_while_holding_a_buffer():
    info = glibc().mallinfo2
    info.restype = MallocInfo
    buffer = torch.empty(BUFFER_BYTES, dtype=torch.uint8)
    mapped = info().hblkhd
    del buffer
    return mapped - info().hblkhd


before = mapped_bytes_while_holding_a_buffer()
with reused_heap():
    during = mapped_bytes_while_holding_a_buffer()
print(json.dumps([before, during, mapped_bytes_while_holding_a_buffer(), BUFFER_BYTES]))
"""


@pytest.mark.skipif(glibc() is None or not hasattr(glibc(), "mallinfo2"), reason="not glibc >= 2.33")
def test_a_runs_large_buffers_come_from_the_heap_and_are_mapped_again_after():
    result = subprocess.run([sys.executable, "-c", MAPPED_BYTES], capture_output=True, text=True, check=True)
    before, during, after, buffer_bytes = json.loads(result.stdout.splitlines()[-1])
    assert before >= buffer_bytes
    assert during == 0
    assert after >= buffer_bytes
