"""Commit primitives: atomic file replacement, and commits that an interrupt cannot split.

Invariants:
- ``atomic_write`` leaves ``path`` either as it was or holding the complete new content
  (temp file in the same folder, fsync, ``os.replace``, fsync of the folder); the temp
  file never outlives the call.
- Inside ``deferred_interrupts()`` a SIGINT (Ctrl-C, or ``kill -INT``) does not raise where
  it lands: it is held and raised as ``KeyboardInterrupt`` when the block ends, so a commit
  and the in-memory record of it happen together or not at all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, prefix: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write via a temp file in the same folder, fsync, then os.replace onto `path`.

    The file gets the usual permissions (0666 less the umask), not mkstemp's private 0600.
    """
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=prefix)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT until the block ends, then raise it (outside the main thread: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
