"""OutputLock: one run at a time on an output.

The lock is an exclusive ``flock`` on a hidden file in the output's shard folder, held from
the moment a writer opens the output until it closes or its process ends (a killed process
releases it too), so two runs of the same job on one output never compute the same rows:
the second is refused at once, saying which process holds the output.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = ".lock"


class OutputLockedError(ValueError):
    """Another process is writing this output."""


class OutputLock:
    def __init__(self, shard_dir: Path, output_path: Path):
        self.path = shard_dir / LOCK_NAME
        self.is_new = not self.path.exists()
        self._file = open(self.path, "a+")  # noqa: SIM115 (held for the writer's lifetime)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise OutputLockedError(
                f"another batchgen run (pid {holder}) is writing {str(output_path)!r}; wait for it to finish "
                "and run again (it resumes), or choose another output path"
            ) from None
        self._file.truncate(0)
        self._file.write(str(os.getpid()))
        self._file.flush()

    def release(self, remove_if_new: bool = False) -> None:
        """Release the lock (closing the file releases the flock); safe to call twice.
        `remove_if_new`: also delete the lock file when this lock created it (a refused run
        leaves nothing behind)."""
        if remove_if_new and self.is_new and not self._file.closed:
            self.path.unlink(missing_ok=True)
        self._file.close()
