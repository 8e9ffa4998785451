"""The native backend (batched decode, short prefill chunks padded into one call, long chunks one
by one) against the per-sequence float32 reference, on one mixed step."""

from __future__ import annotations

import torch

from batchgen.kernels import attention
from batchgen.kernels.attention import AttentionMetadata, NativeBackend, ReferenceBackend, gather_decode
from tests.kernels.paged_inputs import shuffled_tables

BLOCK_SIZE = 4


def mixed_step(query_lens: list[int], context_lens: list[int], num_decode: int, seed: int = 0):
    """Random q and pool for sequences with these query and context lengths, each with its own
    shuffled blocks (the first `num_decode` decode one token)."""
    generator = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    tables, num_blocks = shuffled_tables(context_lens, BLOCK_SIZE, generator)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(k_cache.shape, generator=generator)
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for table, num_context in zip(tables, context_lens):
        for position in range(num_context):
            written[table[position // BLOCK_SIZE], position % BLOCK_SIZE] = True
    k_cache[~written] = float("nan")  # what an unwritten slot may hold: no kernel may let it leak
    v_cache[~written] = float("nan")
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    width = max(map(len, tables))
    slots = [tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for s, (num_queries, num_context) in enumerate(zip(query_lens, context_lens))
             for p in range(num_context - num_queries, num_context)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=[0, *torch.tensor(query_lens).cumsum(0).tolist()],
        query_lens=query_lens, context_lens_list=context_lens,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_tables_list=tables, num_decode_seqs=num_decode, block_size=BLOCK_SIZE)
    return q, k_cache, v_cache, meta


def test_short_prefill_chunks_in_one_padded_call_match_the_reference(monkeypatch):
    monkeypatch.setattr(attention, "MAX_BATCHED_PREFILL_LEN", 8)
    query_lens = [1, 1, 3, 8, 1, 5, 20]  # two decodes, four short chunks (one a 1-token chunk), a long one
    context_lens = [9, 14, 3, 30, 7, 13, 20]
    q, k_cache, v_cache, meta = mixed_step(query_lens, context_lens, num_decode=2)
    assert meta.short_prefill.seqs == [2, 3, 4, 5]
    scale = 0.3
    expected = torch.empty_like(q)
    ReferenceBackend().forward(q, None, None, k_cache, v_cache, meta, scale, expected)
    new_k = k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping]  # the new tokens' K/V, already in the pool
    new_v = v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping]
    got = torch.empty_like(q)
    NativeBackend(gather_decode).forward(q, new_k, new_v, k_cache, v_cache, meta, scale, got)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_lone_short_chunk_is_not_batched(monkeypatch):
    monkeypatch.setattr(attention, "MAX_BATCHED_PREFILL_LEN", 8)
    _, _, _, meta = mixed_step([1, 3, 40], [5, 9, 40], num_decode=1)
    assert meta.short_prefill is None
