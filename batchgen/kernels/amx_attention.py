"""Prefill attention on AMX tiles (``csrc/amx_attention.c``): causal attention of a step's
prefill chunks over the paged pool, in bfloat16 with head_dim 64, on a CPU with AMX-BF16.

Invariants:
- ``supports()`` never raises: without a compiler, AMX-BF16 or the kernel's permission to use
  the tile registers it is False, and the engine uses another prefill path.
- Chunks given as one group share their cached prefix blocks: its K/V are staged once and all
  the group's queries attend them together (cascade attention); the result is the same
  attention, up to float rounding.
- Every query row of ``out`` is written, or a ValueError names what was refused.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from batchgen.kernels.c_library import load_library
from batchgen.kernels.cpu_attention import check_status

HEAD_DIM = 64
_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]


@functools.cache
def _load_kernel():
    """The kernel's entry point, or None where it cannot run."""
    library = load_library("amx_attention.c")
    if library is None or not library.bg_amx_attention_available():
        return None
    library.bg_amx_prefill_attention.argtypes = _ARGTYPES
    library.bg_amx_prefill_attention.restype = ctypes.c_int
    return library.bg_amx_prefill_attention


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `paged_prefill_attention` runs this dtype and head size here."""
    return dtype == torch.bfloat16 and head_dim == HEAD_DIM and _load_kernel() is not None


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                            scale: float, out: torch.Tensor, groups: torch.Tensor | None = None) -> bool:
    """Causal attention of prefill chunks over the paged pool, written into `out` ([rows, H, D]
    like `q`), as `cpu_attention.paged_prefill_attention`. `groups`: optional contiguous int32
    [G, 3] rows (first, end, prefix_tokens), in order and disjoint: chunks first..end-1 (at least
    two, packed one after another) hold the same blocks for their first prefix_tokens positions
    and every query comes after them. Returns False, writing nothing, where it does not apply
    (`supports` refuses q's dtype or head size, or q, out or the pool is not contiguous)."""
    if not (supports(q.dtype, q.shape[-1]) and k_cache.dtype == q.dtype and q.is_contiguous()
            and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_groups = 0 if groups is None else len(groups)
    status = _load_kernel()(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), query_starts.data_ptr(), query_lens.data_ptr(), len(query_lens), q.shape[1],
        num_kv_heads, head_dim, num_blocks, block_size, block_tables.shape[1], scale, torch.get_num_threads(),
        None if groups is None else groups.data_ptr(), num_groups,
    )
    check_status("amx paged_prefill_attention", status)
    return True
