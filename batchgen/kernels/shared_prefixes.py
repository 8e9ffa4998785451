"""Runs of a step's sequences that hold the same leading blocks of the paged pool: the decode
kernel's shared-prefix groups, and the AMX prefill kernel's. A group's prefix is attended once
for all its members (cascade attention); the result is the same attention.

Invariants:
- A group is adjacent rows (at least two) holding the same first `shared` blocks, at least
  MIN_SHARED_BLOCKS of them; row i shares at most its limit: for decode rows, fewer tokens than
  its context; for prefill chunks, no query of the chunk (every query comes after the prefix).
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
    length = 0
    while length < limit and a[length] == b[length]:
        length += 1
    return length


def decode_groups(block_tables: list[list[int]], context_lens: list[int], num_decode: int,
                  block_size: int) -> list[tuple[int, int, int]]:
    """Groups of the decode rows (the first `num_decode`): (first, end, prefix_tokens),
    prefix_tokens < every member's context length."""
    limits = [(context_len - 1) // block_size for context_len in context_lens[:num_decode]]
    return [(first, end, shared * block_size)
            for first, end, shared in shared_block_runs(block_tables[:num_decode], limits)]


def prefill_groups(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int], num_decode: int,
                   block_size: int) -> list[tuple[int, int, int]]:
    """Groups of the prefill chunks (the rows after the first `num_decode`), numbered from the
    first chunk: (first, end, prefix_tokens), prefix_tokens at or before every member's first query."""
    limits = [(context_len - query_len) // block_size
              for context_len, query_len in zip(context_lens[num_decode:], query_lens[num_decode:])]
    return [(first, end, shared * block_size)
            for first, end, shared in shared_block_runs(block_tables[num_decode:], limits)]
