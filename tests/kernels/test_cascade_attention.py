"""Cascade prefill: short chunks sharing cached prefix blocks, against the per-sequence float32
reference, in one step with decode rows and chunks outside any group."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cascade_attention
from batchgen.kernels.attention import AttentionMetadata, NativeBackend, ReferenceBackend, gather_decode

BLOCK_SIZE = 4
PREFIX_BLOCKS = 6


def shared_prefix_step(own_lens: list[int], query_lens: list[int], num_decode: int, dtype: torch.dtype,
                       num_private: int = 0, num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 16):
    """Sequences whose blocks begin with the same PREFIX_BLOCKS blocks (the first `num_private` with
    blocks of their own), then `own_lens[s]` tokens of their own, the last `query_lens[s]` of them
    this step's queries; unwritten slots hold NaN."""
    generator = torch.Generator().manual_seed(7)
    context_lens = [PREFIX_BLOCKS * BLOCK_SIZE + own for own in own_lens]
    next_block, tables = PREFIX_BLOCKS, []
    for s, own in enumerate(own_lens):
        num_own = -(-own // BLOCK_SIZE) + (PREFIX_BLOCKS if s < num_private else 0)
        prefix = [] if s < num_private else list(range(PREFIX_BLOCKS))
        tables.append(prefix + list(range(next_block, next_block + num_own)))
        next_block += num_own
    shape = (next_block + 1, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    written = torch.zeros(shape[:2], dtype=torch.bool)
    for table, context in zip(tables, context_lens):
        for position in range(context):
            written[table[position // BLOCK_SIZE], position % BLOCK_SIZE] = True
    k_cache[~written], v_cache[~written] = float("nan"), float("nan")
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    slots = [tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for s, (num_queries, context) in enumerate(zip(query_lens, context_lens))
             for p in range(context - num_queries, context)]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=[0, *torch.tensor(query_lens).cumsum(0).tolist()],
        query_lens=query_lens, context_lens_list=context_lens,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_tables_list=tables, num_decode_seqs=num_decode, block_size=BLOCK_SIZE, is_cascading=True)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cascade_groups_match_the_reference(dtype, tolerance):
    # two decode rows (the decode kernel's), the first with blocks of its own; four short chunks
    # after the shared prefix (one a single token, one after 7 cached tokens of its own, one
    # crossing block boundaries); a short chunk that starts inside the prefix (it cannot share all
    # of it); a long chunk
    own_lens = [7, 5, 3, 9, 1, 12, 10, 90]
    query_lens = [1, 1, 3, 2, 1, 12, 26, 90]
    q, k_cache, v_cache, meta = shared_prefix_step(own_lens, query_lens, num_decode=2, dtype=dtype, num_private=1)
    (group,) = meta.cascade_groups
    assert group.seqs == [2, 3, 4, 5] and len(group.prefix_slots) == PREFIX_BLOCKS * BLOCK_SIZE
    assert meta.short_prefill is None  # the one other short chunk is not batched alone
    expected = torch.empty_like(q)
    ReferenceBackend().forward(q, None, None, k_cache, v_cache, meta, 0.25, expected)
    new_k = k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping]
    new_v = v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping]
    got = torch.full_like(q, float("nan"))
    NativeBackend(gather_decode, cascades=True).forward(q, new_k, new_v, k_cache, v_cache, meta, 0.25, got)
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_chunks_longer_than_the_member_limit_or_sharing_too_little_attend_alone(monkeypatch):
    monkeypatch.setattr(cascade_attention, "MAX_MEMBER_QUERIES", 4)
    _, _, _, meta = shared_prefix_step([5, 3, 9], [5, 3, 2], num_decode=0, dtype=torch.float32)
    assert [group.seqs for group in meta.cascade_groups] == [[1, 2]]  # 5 queries: alone
    monkeypatch.setattr(cascade_attention, "MIN_SHARED_BLOCKS", PREFIX_BLOCKS + 1)
    _, _, _, meta = shared_prefix_step([5, 3, 9], [2, 3, 2], num_decode=0, dtype=torch.float32)
    assert meta.cascade_groups == []


def test_merge_of_two_partial_softmaxes_is_the_softmax_over_both():
    generator = torch.Generator().manual_seed(3)
    scores, values = torch.randn(5, 12, generator=generator), torch.randn(12, 4, generator=generator)
    whole = torch.softmax(scores, -1) @ values
    parts = [(torch.softmax(scores[:, part], -1) @ values[part], torch.logsumexp(scores[:, part], -1))
             for part in (slice(0, 7), slice(7, 12))]
    torch.testing.assert_close(cascade_attention.merge(*parts[0], *parts[1]), whole)
