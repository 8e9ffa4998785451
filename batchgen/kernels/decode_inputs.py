"""The argument contract shared by the paged decode kernels (CPU and CUDA)."""

from __future__ import annotations

import torch

DECODE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens) -> None:
    """Cheap shape and dtype checks of a paged decode call; raise ValueError naming the problem.

    q: [num_seqs, num_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim], one float dtype with q; num_heads a multiple of num_kv_heads; block_tables:
    int32 [num_seqs, max_blocks]; context_lens: int32 [num_seqs].
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be 3-D and k_cache/v_cache 4-D of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in DECODE_DTYPES:
        raise ValueError(f"q, k_cache, v_cache must share a float32/bfloat16/float16 dtype, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_seqs, num_heads, head_dim = q.shape
    if k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)} "
                         "(head_dim must match and num_heads be a multiple of num_kv_heads)")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks], "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if context_lens.dtype != torch.int32 or context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be int32 [{num_seqs}], got {context_lens.dtype} {tuple(context_lens.shape)}")
