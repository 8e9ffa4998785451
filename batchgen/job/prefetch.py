"""prefetched: iterate in a background thread, one item ahead of the consumer.

The job's plan pass reads and encodes the next batch of rows (the tokenizer's batch call runs
outside the GIL) while the main thread checks, hashes and stores the current one.

Invariants:
- Items come out in order, each once; at most one item waits between the two threads.
- An exception raised by the iteration is raised in the consumer, at the item it stopped at.
- When the consumer stops early (an error, an interrupt, `close()`), the thread ends after the
  item it is computing; no thread outlives the generator.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_POLL_S = 0.1


def prefetched(items: Iterable[T]) -> Iterator[T]:
    """Yield `items` in order while a background thread computes the next one."""
    handoff: queue.Queue = queue.Queue(maxsize=1)
    stopped = threading.Event()
    end = object()

    def put(entry: tuple) -> bool:
        while not stopped.is_set():
            try:
                handoff.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((end, None))
        except BaseException as error:  # handed to the consumer, raised there
            put((end, error))

    thread = threading.Thread(target=produce, name="batchgen-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = handoff.get()
            if item is end:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stopped.set()
        thread.join()
