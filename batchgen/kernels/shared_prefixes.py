"""Runs of a step's sequences that hold the same leading blocks of the paged pool: the decode
kernel's shared-prefix groups (decode rows), and the AMX kernel's (decode rows and prefill chunks).
A group's prefix is attended once for all its members (cascade attention); the result is the
same attention.

Invariants:
- A group is adjacent rows (at least two) holding the same first `shared` blocks, at least
  MIN_SHARED_BLOCKS of them, none holding a query of its row: every member's queries come
  after the prefix.
- A run is cut where the next row shares fewer than half the run's blocks, so a long common
  prefix is not shortened to a short one.
"""

from __future__ import annotations

MIN_SHARED_BLOCKS = 4  # a shorter shared prefix is not worth a separate pass


def shared_block_runs(block_tables: list[list[int]], max_shared_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Runs of adjacent rows holding the same leading blocks: (first, end, shared blocks); row i
    shares at most `max_shared_blocks[i]`."""
    runs, first = [], 0
    while first < len(block_tables):
        shared, end = max_shared_blocks[first], first + 1
        while end < len(block_tables):
            limit = min(shared, max_shared_blocks[end])
            common = common_prefix_len(block_tables[first], block_tables[end], limit)
            if common < max(MIN_SHARED_BLOCKS, shared // 2):
                break
            shared, end = common, end + 1
        if end - first > 1 and shared >= MIN_SHARED_BLOCKS:
            runs.append((first, end, shared))
        first = end
    return runs


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """How many leading entries (at most `limit`) `a` and `b` share. Members of a group share the
    whole limit after the first comparison: one slice comparison then decides it."""
    if a[:limit] == b[:limit]:
        return limit
    length = 0
    while a[length] == b[length]:  # a mismatch lies before `limit`
        length += 1
    return length


def prefix_groups(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                  block_size: int) -> list[tuple[int, int, int]]:
    """Groups among these rows (each a sequence's block table, context length and query count):
    (first, end, prefix_tokens), prefix_tokens at or before every member's first query (for a
    decode row, one query: fewer than its context)."""
    limits = [(context_len - query_len) // block_size for context_len, query_len in zip(context_lens, query_lens)]
    return [(first, end, shared * block_size) for first, end, shared in shared_block_runs(block_tables, limits)]
