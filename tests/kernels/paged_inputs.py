"""Random paged-KV inputs and the float64 references the decode and prefill kernels are tested against."""

from __future__ import annotations

import math

import torch

BLOCK_SIZE = 16


def variant_softmax(scores, variant, positions, query_pos):
    """Causal softmax over the last dim of float64 `scores` [H, Q, K] as `variant` changes it
    (window, soft-cap, sinks; query_pos [Q, 1] against key positions [K])."""
    if variant is not None and variant.softcap:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.masked_fill(positions[None] > query_pos, float("-inf"))
    if variant is not None and variant.window:
        scores = scores.masked_fill(positions[None] <= query_pos - variant.window, float("-inf"))
    if variant is None or variant.sinks is None:
        return torch.softmax(scores, -1)
    sinks = variant.sinks.double().view(-1, 1, 1).expand(*scores.shape[:2], 1)
    return torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]


def reference_attention(q, k_cache, v_cache, block_tables, context_lens, scale, variant=None):
    """Gather each sequence's K/V through its block table; softmax in float64 (as `variant` changes it)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim).double()
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim).double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for s in range(num_seqs):
        positions = torch.arange(int(context_lens[s]), device=q.device)
        slots = block_tables[s, positions // block_size].long() * block_size + positions % block_size
        keys = flat_k[slots].repeat_interleave(group, dim=1)  # [len, num_heads, head_dim]
        values = flat_v[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s].double(), keys) * scale
        weights = variant_softmax(scores[:, None], variant, positions, positions[-1:, None])[:, 0]
        out[s] = torch.einsum("hl,lhd->hd", weights, values)
    return out


def reference_prefill(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, variant=None):
    """Causal attention of each sequence's last query_lens[s] positions over its context, float64
    (as `variant` changes it)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim).double()
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim).double()
    outputs = []
    for s, (context, num_queries) in enumerate(zip(context_lens.tolist(), query_lens)):
        positions = torch.arange(context)
        slots = block_tables[s, positions // block_size].long() * block_size + positions % block_size
        keys = flat_k[slots].repeat_interleave(group, dim=1)  # [context, H, D]
        values = flat_v[slots].repeat_interleave(group, dim=1)
        queries = q[sum(query_lens[:s]):sum(query_lens[:s + 1])].double()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_pos = torch.arange(context - num_queries, context)[:, None]
        outputs.append(torch.einsum("hqk,khd->qhd", variant_softmax(scores, variant, positions, query_pos), values))
    return torch.cat(outputs)


def make_inputs(context_lens, num_heads, num_kv_heads, head_dim, dtype, seed, device="cpu", pad=0,
                block_size=BLOCK_SIZE):
    """Random q and caches, each sequence's blocks scattered over a shuffled pool; block tables
    padded with `pad` past each sequence's blocks (a kernel must never read the padding)."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    block_tables = torch.full((len(context_lens), max(blocks_per_seq) + 1), pad, dtype=torch.int32)
    offset = 0
    for s, count in enumerate(blocks_per_seq):
        block_tables[s, :count] = block_ids[offset:offset + count]
        offset += count
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    q = torch.randn((len(context_lens), num_heads, head_dim), generator=generator).to(dtype)
    tensors = (q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32))
    return tuple(t.to(device) for t in tensors)


def shuffled_tables(context_lens, block_size, generator) -> tuple[list[list[int]], int]:
    """Each sequence's block table, its blocks at random places in a pool of the returned size
    (two blocks more than the sequences hold)."""
    counts = [-(-n // block_size) for n in context_lens]
    order = torch.randperm(sum(counts) + 2, generator=generator).tolist()
    tables, used = [], 0
    for count in counts:
        tables.append(order[used:used + count])
        used += count
    return tables, len(order)


def shared_prefix_inputs(dtype, seed, num_heads=9, num_kv_heads=3, head_dim=64, block_size=BLOCK_SIZE, device="cpu"):
    """23 sequences: 0-19 hold the same first 6 blocks, 20-21 the same first block, 22 its own."""
    context_lens = [6 * block_size + 1 + 7 * i % 50 for i in range(20)] + [block_size + 3, 2 * block_size + 5, 40]
    q, k_cache, v_cache, block_tables, contexts = make_inputs(context_lens, num_heads, num_kv_heads, head_dim, dtype,
                                                              seed, pad=-1, block_size=block_size)
    block_tables[1:20, :6] = block_tables[0, :6]
    block_tables[21, :1] = block_tables[20, :1]
    return tuple(t.to(device) for t in (q, k_cache, v_cache, block_tables, contexts))
