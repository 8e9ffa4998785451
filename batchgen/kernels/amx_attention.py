"""Attention on AMX tiles (``csrc/amx_attention.c``): causal attention of a step's prefill
chunks (with any of a sliding window, a soft-cap and sinks; head_dim 64, 128, 192 or 256) and of
decode rows (none of them; head_dim 64) over the paged pool, in bfloat16, on a CPU with
AMX-BF16, under `attention_kernel`'s contract; decode rows with a window, a soft-cap or sinks
are left to the caller's other kernels.

Invariants:
- ``supports()`` never raises: without a compiler, AMX-BF16 or the kernel's permission to use
  the tile registers it is False, and the engine uses its other paths.
- Chunks (or decode rows) given as one group share their cached prefix blocks: the prefix's K/V
  are read once for all the group's queries (of a work item) that attend them together
  (cascade attention); the result is the same attention, up to float rounding.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from batchgen.kernels.attention_kernel import C_ARGTYPES, FULL, AttentionVariant, PagedSeqs, run_c_kernel
from batchgen.kernels.c_library import load_library

HEAD_DIM = 64  # the decode kernel's head size
PREFILL_HEAD_DIMS = (64, 128, 192, 256)  # the prefill kernel's: its queries and accumulators in tiles at 64


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The kernel's library (its prefill and decode entry points typed), or None where it cannot run."""
    library = load_library("amx_attention.c")
    if library is None or not library.bg_amx_attention_available():
        return None
    for entry in (library.bg_amx_prefill_attention, library.bg_amx_decode_attention):
        entry.argtypes, entry.restype = C_ARGTYPES, ctypes.c_int
    return library


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether both kernels run this dtype and head size here."""
    return head_dim == HEAD_DIM and supports_prefill(dtype, head_dim)


def supports_prefill(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the prefill kernel runs this dtype and head size here (bf16, a multiple of 64 up to 256)."""
    return dtype == torch.bfloat16 and head_dim in PREFILL_HEAD_DIMS and load_kernel() is not None


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
                            scale: float, out: torch.Tensor, variant: AttentionVariant = FULL) -> bool:
    """Causal prefill attention, windowed, soft-capped and with sinks where `variant` says; the
    chunks of a group attend their prefix together. Over an int8 pool (`kv_int8`'s rows) each row
    is dequantized as it is staged, as `kv_int8.dequantize` rounds it to bf16: the same attention
    as over those rows dequantized. Does not run where `supports_prefill` refuses q's dtype or head
    size, or for a tensor that is not contiguous."""
    library = load_kernel()
    return run_c_kernel(library and library.bg_amx_prefill_attention, "amx paged_prefill_attention", q, k_cache,
                        v_cache, seqs, scale, out, variant)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
                           scale: float, out: torch.Tensor, variant: AttentionVariant = FULL) -> bool:
    """Decode attention, reading a group's prefix once for up to 64 query heads of its members
    per kv head (four column sets of 16). No K/V is copied: the pool's rows are the tiles'
    operands. Does not run where `supports` refuses q, for a block size not a multiple of 16,
    more than 16 query heads per kv head, or a tensor that is not contiguous."""
    library = load_kernel()
    return run_c_kernel(library and library.bg_amx_decode_attention, "amx paged_decode_attention", q, k_cache,
                        v_cache, seqs, scale, out, variant)
