"""RowStore: an append-only, unnamed temporary file of pickled records, read back by position.

The job's plan pass keeps every planned row here (its input row and encoded request) instead
of in memory, and the run reads them back in plan order. Memory per record is one offset.

Invariants:
- `get(i)` returns an equal copy of the i-th appended record.
- The file has no name (it vanishes when closed or when the process dies, SIGKILL included)
  and lives in `directory`, next to the job's output.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from array import array
from pathlib import Path
from typing import Any


class RowStore:
    def __init__(self, directory: str | Path):
        self._file = tempfile.TemporaryFile(dir=directory)
        self._offsets = array("Q", [0])
        self._is_flushed = True

    def append(self, record: Any) -> int:
        """Store `record`; returns its position."""
        data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        self._file.write(data)
        self._offsets.append(self._offsets[-1] + len(data))
        self._is_flushed = False
        return len(self._offsets) - 2

    def get(self, position: int) -> Any:
        if not self._is_flushed:
            self._file.flush()
            self._is_flushed = True
        start, end = self._offsets[position], self._offsets[position + 1]
        return pickle.loads(os.pread(self._file.fileno(), end - start, start))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
