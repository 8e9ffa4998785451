"""Attention on AMX tiles (``csrc/amx_attention.c``): causal attention of a step's prefill
chunks over the paged pool, the prefix state of decode rows sharing cached prefix blocks, and
decode rows (from that state or from nothing), in bfloat16 with head_dim 64, on a CPU with
AMX-BF16; and `cascade_plan`, which rows of a step go where.

Invariants:
- ``supports()`` never raises: without a compiler, AMX-BF16 or the kernel's permission to use
  the tile registers it is False, and the engine uses its other paths.
- Chunks given as one group share their cached prefix blocks: its K/V are staged once and all
  the group's queries attend them together (cascade attention); the result is the same
  attention, up to float rounding.
- Every query row of the given chunks in ``out`` (or in the prefix state) is written, or a
  ValueError names what was refused.
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
_ARGTYPES = ([ctypes.c_void_p] * 8 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
             + [ctypes.c_void_p])
_DECODE_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int] + [ctypes.c_void_p] * 2


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


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                            scale: float, out: torch.Tensor, groups: torch.Tensor | None = None,
                            prefix_state: torch.Tensor | None = None) -> bool:
    """Causal attention of chunks over the paged pool, written into `out` ([rows, H, D] like `q`),
    as `cpu_attention.paged_prefill_attention`: chunk s's queries are rows query_starts[s] .. +
    query_lens[s] (other rows are left alone). `groups`: optional contiguous int32 [G, 3] rows
    (first, end, prefix_tokens), in order and disjoint: chunks first..end-1 (at least two) hold
    the same blocks for their first prefix_tokens positions and every query comes after them.
    `prefix_state` (every chunk in a group): the queries attend their group's prefix alone, each
    row's softmax state written to it (contiguous float32 [R, H, D + 2], R covering every chunk's
    rows, as `cpu_attention.paged_decode_attention` takes it) instead of to `out`. Returns False, writing
    nothing, where it does not apply (`supports` refuses q's dtype or head size, or q, out or the
    pool is not contiguous)."""
    if not (supports(q.dtype, q.shape[-1]) and k_cache.dtype == q.dtype and q.is_contiguous()
            and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if prefix_state is not None:
        check_prefix_state(prefix_state, q, int((query_starts + query_lens).max()))
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_groups = 0 if groups is None else len(groups)
    status = _load_kernel().bg_amx_prefill_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), query_starts.data_ptr(), query_lens.data_ptr(), len(query_lens), q.shape[1],
        num_kv_heads, head_dim, num_blocks, block_size, block_tables.shape[1], scale, torch.get_num_threads(),
        None if groups is None else groups.data_ptr(), num_groups,
        None if prefix_state is None else prefix_state.data_ptr(),
    )
    check_status("amx paged_prefill_attention", status)
    return True


def check_prefix_state(prefix_state: torch.Tensor, q: torch.Tensor, num_rows: int) -> None:
    """Raises ValueError unless `prefix_state` is a contiguous float32 [R, H, D + 2] tensor with
    R >= num_rows (the rows of q the chunks' queries reach)."""
    row_shape = (q.shape[1], q.shape[2] + 2)
    if (prefix_state.dtype != torch.float32 or not prefix_state.is_contiguous() or prefix_state.dim() != 3
            or prefix_state.shape[1:] != row_shape or prefix_state.shape[0] < num_rows):
        raise ValueError(f"prefix_state must be a contiguous float32 tensor of shape (R, {row_shape[0]}, "
                         f"{row_shape[1]}) with R >= {num_rows}, got {tuple(prefix_state.shape)}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                           prefix_lens: torch.Tensor | None = None, prefix_state: torch.Tensor | None = None) -> bool:
    """Decode attention (one query row per sequence) over the paged pool into `out`, as
    `cpu_attention.paged_decode_attention` computes it: q, out [S, H, D]; optionally from each
    row's prefix state (`prefix_lens` int32 [S], 0 for none; `prefix_state` float32 [S, H, D + 2]).
    No K/V is copied: the pool's rows are the tiles' operands. Returns False, writing nothing,
    where it does not apply (`supports` refuses q, a block size not a multiple of 16, more than
    16 query heads per kv head, or q, out or the pool not contiguous)."""
    if not (supports(q.dtype, q.shape[-1]) and k_cache.dtype == q.dtype and q.is_contiguous()
            and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if prefix_state is not None:
        check_prefix_state(prefix_state, q, len(q))
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    status = _load_kernel().bg_amx_decode_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), len(q), q.shape[1], num_kv_heads, head_dim, num_blocks, block_size,
        block_tables.shape[1], scale, torch.get_num_threads(),
        None if prefix_lens is None else prefix_lens.data_ptr(), None if prefix_state is None else prefix_state.data_ptr(),
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


@dataclass(frozen=True)
class CascadePlan:
    """Where a step's rows go on an AMX CPU: decode rows that share cached prefix blocks attend
    their group's prefix here (`decode_groups`, as prefix state), then every decode row goes to
    the decode kernel (from that state, `decode_prefix_lens`); every prefill chunk comes here,
    chunks sharing cached prefix blocks in groups (`prefill`)."""

    decode_groups: KernelSeqs | None  # the grouped decode rows, None for none
    decode_prefix_lens: torch.Tensor | None  # int32 [num_decode]: the prefix each decode row starts from (0: none)
    prefill: KernelSeqs | None  # every prefill chunk, None for none


def cascade_plan(meta) -> CascadePlan:
    """The plan of the step `meta` (an `AttentionMetadata` whose `decode_groups` are set)."""
    num_decode = meta.num_decode_seqs
    decode_groups = prefix_lens = prefill = None
    if meta.decode_groups is not None and len(meta.decode_groups):
        runs = meta.decode_groups.tolist()
        members = torch.tensor([s for first, end, _ in runs for s in range(first, end)], dtype=torch.long)
        prefix_lens = torch.zeros(num_decode, dtype=torch.int32)
        numbered, count = [], 0
        for first, end, prefix in runs:
            prefix_lens[first:end] = prefix
            numbered.append((count, count + end - first, prefix))
            count += end - first
        decode_groups = KernelSeqs(meta.block_tables[members], meta.context_lens[members], members.to(torch.int32),
                                   torch.ones(len(members), dtype=torch.int32),
                                   torch.tensor(numbered, dtype=torch.int32))
    if num_decode < len(meta.query_lens):
        groups = prefix_groups(meta.block_tables_list[num_decode:], meta.context_lens_list[num_decode:],
                               meta.query_lens[num_decode:], meta.block_size)
        prefill = KernelSeqs(meta.block_tables[num_decode:], meta.context_lens[num_decode:], *meta.prefill_queries,
                             torch.tensor(groups, dtype=torch.int32).reshape(-1, 3))
    return CascadePlan(decode_groups, prefix_lens, prefill)
