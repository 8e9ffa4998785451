"""Attention on AMX tiles (``csrc/amx_attention.c``): causal attention of a step's chunks
(prefill chunks, and decode rows as one-token chunks) over the paged pool, in bfloat16 with
head_dim 64, on a CPU with AMX-BF16; and `cascade_plan`, which rows of a step go to it.

Invariants:
- ``supports()`` never raises: without a compiler, AMX-BF16 or the kernel's permission to use
  the tile registers it is False, and the engine uses its other paths.
- Chunks given as one group share their cached prefix blocks: its K/V are staged once and all
  the group's queries attend them together (cascade attention); the result is the same
  attention, up to float rounding.
- Every query row of the given chunks in ``out`` is written, or a ValueError names what was refused.
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
    """Causal attention of chunks over the paged pool, written into `out` ([rows, H, D] like `q`),
    as `cpu_attention.paged_prefill_attention`: chunk s's queries are rows query_starts[s] .. +
    query_lens[s] (other rows are left alone). `groups`: optional contiguous int32 [G, 3] rows
    (first, end, prefix_tokens), in order and disjoint: chunks first..end-1 (at least two) hold
    the same blocks for their first prefix_tokens positions and every query comes after them. Returns False, writing nothing, where it does not apply
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


@dataclass(frozen=True)
class CascadePlan:
    """Where a step's rows go on an AMX CPU: decode rows that share no cached prefix blocks with
    others to the decode kernel, every other sequence to this kernel, groups sharing a prefix
    (decode rows and prefill chunks alike) attending it together."""

    lone_decode: slice | torch.Tensor  # the decode kernel's rows (a slice where they are the first ones)
    num_lone_decode: int
    block_tables: torch.Tensor  # int32 [S, max_blocks]: this kernel's sequences, in step order
    context_lens: torch.Tensor  # int32 [S]
    query_starts: torch.Tensor  # int32 [S]
    query_lens: torch.Tensor  # int32 [S]
    groups: torch.Tensor  # int32 [G, 3] (first, end, prefix_tokens), numbered among those sequences

    def query_rows(self) -> torch.Tensor:
        """This kernel's packed query rows, int64."""
        starts, lens = self.query_starts.long(), self.query_lens.long()
        return torch.repeat_interleave(starts - torch.cumsum(lens, 0) + lens, lens) + torch.arange(int(lens.sum()))


def cascade_plan(meta) -> CascadePlan:
    """The plan of the step `meta` (an `AttentionMetadata`)."""
    runs = prefix_groups(meta.block_tables_list, meta.context_lens_list, meta.query_lens, meta.block_size)
    grouped = {s for first, end, _ in runs for s in range(first, end)}
    num_decode = meta.num_decode_seqs
    lone = [s for s in range(num_decode) if s not in grouped]
    seqs = [s for s in range(len(meta.query_lens)) if s >= num_decode or s in grouped]
    number = {s: i for i, s in enumerate(seqs)}
    picked = torch.tensor(seqs, dtype=torch.long)
    return CascadePlan(
        lone_decode=slice(0, len(lone)) if lone == list(range(len(lone))) else torch.tensor(lone, dtype=torch.long),
        num_lone_decode=len(lone),
        block_tables=meta.block_tables[picked],
        context_lens=meta.context_lens[picked],
        query_starts=torch.tensor([meta.query_start_loc[s] for s in seqs], dtype=torch.int32),
        query_lens=torch.tensor([meta.query_lens[s] for s in seqs], dtype=torch.int32),
        groups=torch.tensor([(number[first], number[end - 1] + 1, prefix) for first, end, prefix in runs],
                            dtype=torch.int32).reshape(-1, 3))
