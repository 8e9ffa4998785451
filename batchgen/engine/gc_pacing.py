"""Python's cyclic garbage collector, paced for a long run of engine steps.

A run allocates millions of short-lived objects (token lists, step layouts, outputs), few of
them in cycles, and the collector's default (a young-generation pass every 700 allocations,
each older pass scanning the model, tokenizer and everything loaded) cost 16% of a tiny model's
job. `paced_collection` freezes what exists when the run starts (never scanned again) and
collects the young generation every `RUN_GC_THRESHOLD` allocations; both are restored after.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

RUN_GC_THRESHOLD = 50_000  # allocations between young-generation collections (Python's default: 700)


@contextlib.contextmanager
def paced_collection() -> Iterator[None]:
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(RUN_GC_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
