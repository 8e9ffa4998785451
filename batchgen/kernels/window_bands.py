"""Sliding-window prefill through torch's flash attention (oneDNN's AMX tile products on a CPU
with AMX-BF16), in bands of query rows.

A layer with a window W shorter than a chunk's context attends, per query, only its last W
positions. SDPA over the whole chunk with a mask would compute every (query, key) pair and mask
most; the C kernel (`cpu_attention`) starts each row at its window but runs on vector units.

A chunk of at least W - 1 query rows goes in bands of exactly W - 1 rows (the last band
overlapping the one before it). A band's rows see two key ranges, each in one unmasked causal
flash call that skips the blocks it masks:
- its own positions, causally (a square: flash's causal mask as it is);
- the W - 1 positions before its first row: row i sees those from its own i-th on, which is
  flash's causal mask with both the rows and the keys in reverse order.
The two partial softmaxes are merged through their log-sum-exps. Every row sees at least one
key of each range, so each weight is finite. A shorter chunk attends its window's keys in one
call with the causal, windowed mask.

Invariants (`attention_kernel`'s contract):
- Runs prefill chunks with a window and neither soft-cap nor sinks (those it declines: False,
  nothing written); a chunk may have cached context before its queries (read from the pool).
- Every query row of every chunk is written; each row's keys are exactly the positions
  p - W + 1 .. p of its own position p (from 0), as transformers' sliding-window mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.kernels.attention_kernel import FULL, AttentionVariant, PagedSeqs, check_inputs

MIN_BAND_ROWS = 64  # a window of fewer rows a band attends through the mask (a band a call: too short)
# SDPA's CPU flash kernel, which also returns each row's log-sum-exp ([1, H, Q], float32, natural log)
flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
                            scale: float, out: torch.Tensor, variant: AttentionVariant = FULL) -> bool:
    """Windowed causal prefill of every chunk of `seqs` into `out`; False (nothing written) for
    decode rows, a variant without a window, one with a soft-cap or sinks, or off the CPU."""
    if seqs.is_decode or variant.window == 0 or variant.softcap or variant.sinks is not None or not q.is_cpu:
        return False
    check_inputs(q, k_cache, v_cache, seqs, out)
    block_size, window = k_cache.shape[1], variant.window
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    chunks = zip(seqs.block_tables, seqs.query_starts.tolist(), seqs.query_lens.tolist(), seqs.context_lens.tolist())
    for table, row, num_queries, num_context in chunks:
        first_key = max(0, num_context - num_queries - window + 1)
        positions = torch.arange(first_key, num_context, device=q.device)
        slots = table[positions // block_size].long() * block_size + positions % block_size
        keys, values = (flat[slots].transpose(0, 1).contiguous() for flat in (flat_k, flat_v))  # [Hkv, K, D]
        queries = q[row:row + num_queries].transpose(0, 1)  # [H, Q, D]
        if MIN_BAND_ROWS <= window - 1 <= num_queries:
            attended = attend_in_bands(queries, keys, values, window, scale)
        else:
            attended = attend_masked(queries, keys, values, window, scale)
        out[row:row + num_queries] = attended.transpose(0, 1)
    return True


def attend_in_bands(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int,
                    scale: float) -> torch.Tensor:
    """[H, Q, D] windowed attention of `queries` (at least `window` - 1 of them) at the last Q
    of the positions of `keys`/`values` ([Hkv, K, D]), in bands of `window` - 1 rows."""
    num_queries, rows = queries.shape[1], window - 1
    first_query = keys.shape[1] - num_queries
    out = torch.empty_like(queries)
    for start in range(0, num_queries, rows):
        start = min(start, num_queries - rows)  # the last band overlaps the one before: `rows` rows
        band, own = queries[None, :, start:start + rows], first_query + start
        attended, lse = flash_with_lse(band, keys[None, :, own:own + rows], values[None, :, own:own + rows],
                                       is_causal=True, scale=scale)
        if own > 0:
            older = slice(max(0, own - rows), own)
            before, before_lse = flash_with_lse(band.flip(2), keys[None, :, older].flip(2),
                                                values[None, :, older].flip(2), is_causal=True, scale=scale)
            attended = merged(attended, lse, before.flip(2), before_lse.flip(2))
        out[:, start:start + rows] = attended[0]
    return out


def merged(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """The softmax-weighted mean of two partial attentions ([1, H, Q, D]) over disjoint keys,
    from their rows' log-sum-exps ([1, H, Q], both finite), in `a`'s dtype."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = (lse_a - top).exp_()[..., None], (lse_b - top).exp_()[..., None]
    return ((a.float() * weight_a + b.float() * weight_b) / (weight_a + weight_b)).to(a.dtype)


def attend_masked(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int,
                  scale: float) -> torch.Tensor:
    """`attend_in_bands`' result for any number of queries, in one call with the window's mask."""
    num_queries, num_keys = queries.shape[1], keys.shape[1]
    offsets = torch.arange(num_keys - num_queries, num_keys)[:, None] - torch.arange(num_keys)[None, :]
    allowed = (offsets >= 0) & (offsets < window)
    return F.scaled_dot_product_attention(queries[None], keys[None], values[None], attn_mask=allowed, scale=scale,
                                          enable_gqa=True)[0]
