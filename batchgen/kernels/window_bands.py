"""Sliding-window prefill through torch's flash attention (oneDNN's AMX tile products on a CPU
with AMX-BF16), in bands of query rows, for heads `amx_attention`'s prefill does not take (it
runs windows itself, faster than these bands: docs/performance.md).

A layer with a window W shorter than a chunk's context attends, per query, only its last W
positions. SDPA over the whole chunk with a mask would compute every (query, key) pair and mask
most; the C kernel (`cpu_attention`) starts each row at its window but runs on vector units.
Here a chunk's queries go in bands of `BAND_ROWS`: a band attends the keys from its first row's
window start to its last row's position (at most `BAND_ROWS` + W - 1 of them) in one SDPA call
with the band's causal, windowed mask.

Invariants (`attention_kernel`'s contract):
- Runs prefill chunks with a window and neither soft-cap nor sinks (those it declines: False,
  nothing written); a chunk may have cached context before its queries (read from the pool).
- Every query row of every chunk is written; each row's keys are exactly the positions
  p - W + 1 .. p of its own position p (from 0), as transformers' sliding-window mask.
- K/V are gathered from the pool once per chunk, only the positions some band of it attends.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from batchgen.kernels.attention_kernel import FULL, AttentionVariant, PagedSeqs, check_inputs

BAND_ROWS = 512  # query rows of one SDPA call


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
                            scale: float, out: torch.Tensor, variant: AttentionVariant = FULL) -> bool:
    """Windowed causal prefill of every chunk of `seqs` into `out`, band by band; False (nothing
    written) for decode rows, a variant without a window, one with a soft-cap or sinks, or off
    the CPU."""
    if seqs.is_decode or variant.window == 0 or variant.softcap or variant.sinks is not None or not q.is_cpu:
        return False
    check_inputs(q, k_cache, v_cache, seqs, out)
    block_size, window = k_cache.shape[1], variant.window
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    chunks = zip(seqs.block_tables, seqs.query_starts.tolist(), seqs.query_lens.tolist(), seqs.context_lens.tolist())
    for table, row, num_queries, num_context in chunks:
        first_query = num_context - num_queries
        first_key = max(0, first_query - window + 1)
        positions = torch.arange(first_key, num_context, device=q.device)
        slots = table[positions // block_size].long() * block_size + positions % block_size
        keys, values = (flat[slots].transpose(0, 1).contiguous()[None] for flat in (flat_k, flat_v))  # [1, Hkv, K, D]
        for band in range(0, num_queries, BAND_ROWS):
            band_end = min(num_queries, band + BAND_ROWS)
            key_from = max(first_key, first_query + band - window + 1) - first_key
            key_to = first_query + band_end - first_key
            allowed = band_mask(band_end - band, key_to - key_from, window, q.dtype)
            queries = q[row + band:row + band_end].transpose(0, 1).contiguous()[None]  # [1, H, B, D]
            attended = F.scaled_dot_product_attention(queries, keys[:, :, key_from:key_to],
                                                      values[:, :, key_from:key_to], attn_mask=allowed, scale=scale,
                                                      enable_gqa=True)
            out[row + band:row + band_end] = attended[0].transpose(0, 1)
    return True


@functools.lru_cache(maxsize=64)
def band_mask(num_queries: int, num_keys: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """[Q, K] additive mask (0 or -inf, in `dtype`; shared: never written) of `num_queries` rows
    at the last of `num_keys` positions: each row sees the keys at or before its own and among
    its last `window`. A band's mask depends on these alone: its rows end where its keys end."""
    offsets = torch.arange(num_keys - num_queries, num_keys)[:, None] - torch.arange(num_keys)[None, :]
    allowed = (offsets >= 0) & (offsets < window)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
