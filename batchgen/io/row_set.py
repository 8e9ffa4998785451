"""RowSet: a set of input row indices held as one flag byte per row (a million rows: 1 MB).

The writer's record of committed rows; a Python set of a million ints would take ~60 MB.

Invariants: holds non-negative ints only; `len` is the number of distinct indices added.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class RowSet:
    def __init__(self) -> None:
        self._flags = np.zeros(0, bool)
        self._count = 0

    def add(self, indices: Iterable[int]) -> None:
        indices = np.fromiter(indices, np.int64) if not isinstance(indices, np.ndarray) else indices.astype(np.int64)
        if not indices.size:
            return
        if indices.min() < 0:
            raise ValueError(f"row indices are non-negative, got {int(indices.min())}")
        end = int(indices.max()) + 1
        if end > len(self._flags):
            grown = np.zeros(max(end, 2 * len(self._flags)), bool)
            grown[: len(self._flags)] = self._flags
            self._flags = grown
        indices = np.unique(indices)
        self._count += int(np.count_nonzero(~self._flags[indices]))
        self._flags[indices] = True

    def __contains__(self, index: int) -> bool:
        return 0 <= index < len(self._flags) and bool(self._flags[index])

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self._flags).tolist())

    def count_below(self, end: int) -> int:
        """How many indices are < `end`."""
        return int(np.count_nonzero(self._flags[:end]))
