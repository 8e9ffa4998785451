"""Shared-prefix groups of a step's rows: decode rows and prefill chunks."""

from __future__ import annotations

from batchgen.kernels.shared_prefixes import prefix_groups

# 6 leading blocks shared by rows 0-1; row 2 shares 4 of them; row 3 shares 2, row 4 none; rows 4-5 share 5
TABLES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8], [1, 2, 3, 4, 9, 10, 11], [1, 2, 12, 13, 14, 15, 16],
          [20, 21, 22, 23, 24, 25, 26], [20, 21, 22, 23, 24, 30, 31]]


def decode_groups(tables, context_lens):
    return prefix_groups(tables, context_lens, [1] * len(tables), 16)


def test_decode_rows_are_cut_where_a_row_shares_too_little():
    # row 2 shares at least MIN_SHARED_BLOCKS and half: the group keeps 4; row 3 shares fewer than
    # MIN_SHARED_BLOCKS
    assert decode_groups(TABLES, [7 * 16] * 6) == [(0, 3, 64), (4, 6, 80)]
    # 11 shared blocks: a row sharing 4 (fewer than half) starts a new run instead of shortening it
    long_tables = [list(range(12)), list(range(11)) + [50], list(range(4)) + list(range(60, 68))]
    assert decode_groups(long_tables, [12 * 16] * 3) == [(0, 2, 176)]
    # a prefix stays shorter than every member's context
    assert decode_groups(TABLES[:2], [5 * 16 + 1, 7 * 16]) == [(0, 2, 80)]
    assert decode_groups(TABLES[:2], [5 * 16, 7 * 16]) == [(0, 2, 64)]


def test_groups_end_before_every_members_first_query():
    # a decode row and prefill chunks, grouped alike
    context_lens, query_lens = [7 * 16] * 6, [1, 16, 10, 3, 5, 16]
    assert prefix_groups(TABLES, context_lens, query_lens, 16) == [(0, 3, 64), (4, 6, 80)]
    # a chunk whose queries start inside the shared blocks limits its group to the blocks before them
    assert prefix_groups(TABLES[:2], [7 * 16] * 2, [2 * 16, 2 * 16 + 1], 16) == [(0, 2, 64)]
    # a chunk that computes the shared blocks itself is in no group
    assert prefix_groups(TABLES[:2], [7 * 16] * 2, [7 * 16, 16], 16) == []
