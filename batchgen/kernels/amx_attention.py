"""Attention on AMX tiles (``csrc/amx_attention.c``): causal attention of a step's prefill
chunks and decode rows over the paged pool, in bfloat16 with head_dim 64, on a CPU with
AMX-BF16; and `prefill_seqs`, a step's prefill chunks as the kernel takes them.

Invariants:
- ``supports()`` never raises: without a compiler, AMX-BF16 or the kernel's permission to use
  the tile registers it is False, and the engine uses its other paths.
- Chunks (or decode rows) given as one group share their cached prefix blocks: the prefix's K/V
  are read once for all the group's queries (of a work item) that attend them together
  (cascade attention); the result is the same attention, up to float rounding.
- Every query row of the given chunks or decode rows in ``out`` is written, or a ValueError
  names what was refused.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from batchgen.kernels.c_library import load_library
from batchgen.kernels.cpu_attention import check_status
from batchgen.kernels.shared_prefixes import prefix_groups

HEAD_DIM = 64
UNSUPPORTED = 3  # the kernel's STATUS_UNSUPPORTED
_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_DECODE_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]


@functools.cache
def _load_kernel():
    """The kernel's library (its prefill and decode entry points typed), or None where it cannot run."""
    library = load_library("amx_attention.c")
    if library is None or not library.bg_amx_attention_available():
        return None
    library.bg_amx_prefill_attention.argtypes = _ARGTYPES
    library.bg_amx_decode_attention.argtypes = _DECODE_ARGTYPES
    for entry in (library.bg_amx_prefill_attention, library.bg_amx_decode_attention):
        entry.restype = ctypes.c_int
    return library


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `paged_prefill_attention` runs this dtype and head size here."""
    return dtype == torch.bfloat16 and head_dim == HEAD_DIM and _load_kernel() is not None


def _runs_on(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: `supports` q, the pool in q's dtype, all contiguous."""
    return (supports(q.dtype, q.shape[-1]) and k_cache.dtype == q.dtype and q.is_contiguous()
            and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                            scale: float, out: torch.Tensor, groups: torch.Tensor | None = None) -> bool:
    """Causal attention of chunks over the paged pool, written into `out` ([rows, H, D] like `q`),
    as `cpu_attention.paged_prefill_attention`: chunk s's queries are rows query_starts[s] .. +
    query_lens[s] (other rows are left alone). `groups`: optional contiguous int32 [G, 3] rows
    (first, end, prefix_tokens), in order and disjoint: chunks first..end-1 (at least two) hold
    the same blocks for their first prefix_tokens positions and every query comes after them.
    Returns False, writing nothing, where it does not apply (`supports` refuses q's dtype or head
    size, or q, out or the pool is not contiguous)."""
    if not _runs_on(q, k_cache, v_cache, out):
        return False
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_groups = 0 if groups is None else len(groups)
    status = _load_kernel().bg_amx_prefill_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), query_starts.data_ptr(), query_lens.data_ptr(), len(query_lens), q.shape[1],
        num_kv_heads, head_dim, num_blocks, block_size, block_tables.shape[1], scale, torch.get_num_threads(),
        None if groups is None else groups.data_ptr(), num_groups,
    )
    check_status("amx paged_prefill_attention", status)
    return True


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                           groups: torch.Tensor | None = None) -> bool:
    """Decode attention (one query row per sequence) over the paged pool into `out`, as
    `cpu_attention.paged_decode_attention` computes it: q, out [S, H, D]. `groups`: optional
    contiguous int32 [G, 3] rows (first, end, prefix_tokens), in order and disjoint: sequences
    first..end-1 (at least two) hold the same blocks for their first prefix_tokens positions,
    fewer than each one's context; that prefix is read once for up to 64 query heads of them per
    kv head (four column sets of 16).
    No K/V is copied: the pool's rows are the tiles' operands. Returns False, writing nothing,
    where it does not apply (`supports` refuses q, a block size not a multiple of 16, more than
    16 query heads per kv head, or q, out or the pool not contiguous)."""
    if not _runs_on(q, k_cache, v_cache, out):
        return False
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    status = _load_kernel().bg_amx_decode_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), len(q), q.shape[1], num_kv_heads, head_dim, num_blocks, block_size,
        block_tables.shape[1], scale, torch.get_num_threads(),
        None if groups is None else groups.data_ptr(), 0 if groups is None else len(groups),
    )
    if status == UNSUPPORTED:
        return False
    check_status("amx paged_decode_attention", status)
    return True


@dataclass(frozen=True)
class KernelSeqs:
    """Sequences of a step as this kernel takes them."""

    block_tables: torch.Tensor  # int32 [S, max_blocks]
    context_lens: torch.Tensor  # int32 [S]
    query_starts: torch.Tensor  # int32 [S]: packed rows of q
    query_lens: torch.Tensor  # int32 [S]
    groups: torch.Tensor  # int32 [G, 3] (first, end, prefix_tokens), numbered among these sequences


def prefill_seqs(meta) -> KernelSeqs | None:
    """The prefill chunks of the step `meta` (an `AttentionMetadata`) as the prefill kernel takes
    them, chunks sharing cached prefix blocks in groups; None for none."""
    num_decode = meta.num_decode_seqs
    if num_decode == len(meta.query_lens):
        return None
    groups = prefix_groups(meta.block_tables_list[num_decode:], meta.context_lens_list[num_decode:],
                           meta.query_lens[num_decode:], meta.block_size)
    return KernelSeqs(meta.block_tables[num_decode:], meta.context_lens[num_decode:], *meta.prefill_queries,
                      torch.tensor(groups, dtype=torch.int32).reshape(-1, 3))
