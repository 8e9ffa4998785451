"""Fast CPU paged-attention decode: ``csrc/paged_attention.c``, built at first use by
``c_library`` (cached per source, compiler and machine).

Invariants:
- ``is_available()`` never raises: without a compiler, or when the build or
  load fails, it is False and the engine uses its torch backend.
- The kernel reads K/V in place from the paged cache (no gather), computes in
  float32 with an online softmax and writes every element of its output.
- It runs on ``torch.get_num_threads()`` OpenMP threads, sharing torch's pool.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from batchgen.kernels.c_library import load_library
from batchgen.kernels.decode_inputs import check_decode_inputs

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STATUS_MESSAGES = {
    1: "a context length is < 1 or longer than the block table covers",
    2: "a block table entry is outside [0, num_blocks)",
    3: "this dtype is not supported by the compiled kernel",
    4: "the kernel could not allocate its scratch memory",
    5: "a shared-prefix group is out of range, overlaps another, or is not shorter than a member's context",
}
_ARGTYPES = (
    [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int]
)


@functools.cache
def _load_kernel() -> tuple[Callable[..., int], bool] | None:
    """The kernel entry point and whether it supports float16, or None if unavailable."""
    library = load_library("paged_attention.c")
    if library is None:
        return None
    function = library.bg_paged_decode_attention
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    return function, bool(library.bg_supports_float16())


def is_available() -> bool:
    """True when the kernel is built and loaded (the result is cached)."""
    return _load_kernel() is not None


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens) -> None:
    """The shared contract, plus: every tensor contiguous and on the CPU."""
    check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens)
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                         ("block_tables", block_tables), ("context_lens", context_lens)):
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    ``groups``: optional int32 [num_groups, 3] rows (first, end, prefix_tokens): sequences
    first..end-1 share their first ``prefix_tokens`` tokens in the same blocks (each shorter
    than its context; groups disjoint). That prefix is then read once per group (cascade
    attention); the result is the same attention.

    ``q``: [num_seqs, num_heads, head_dim], the token at position
    ``context_lens[s] - 1`` whose own K/V are already in the cache;
    ``k_cache``/``v_cache``: [num_blocks, block_size, num_kv_heads, head_dim];
    ``block_tables``: [num_seqs, max_blocks] int32; ``context_lens``:
    [num_seqs] int32, each in [1, max_blocks * block_size]. Query head ``h``
    reads kv head ``h // (num_heads // num_kv_heads)``. Returns
    [num_seqs, num_heads, head_dim] in ``q``'s dtype: ``out`` when given
    (contiguous, same shape and dtype as ``q``), else a new tensor.
    """
    kernel = _load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU paged-attention kernel is unavailable (see is_available())")
    function, supports_float16 = kernel
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if q.dtype == torch.float16 and not supports_float16:
        raise ValueError("this compiler build of the kernel has no float16 support")
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if groups is not None and (groups.dtype != torch.int32 or groups.dim() != 2 or groups.shape[1] != 3
                               or not groups.is_contiguous()):
        raise ValueError(f"groups must be a contiguous int32 [num_groups, 3] tensor, got {groups.dtype} "
                         f"{tuple(groups.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    status = function(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), num_seqs, num_heads, num_kv_heads,
        head_dim, num_blocks, block_size, block_tables.shape[1], scale, _DTYPE_CODES[q.dtype],
        torch.get_num_threads(), 0 if groups is None else groups.data_ptr(),
        0 if groups is None else groups.shape[0],
    )
    if status != 0:
        raise ValueError(f"paged_decode_attention: {_STATUS_MESSAGES.get(status, f'status {status}')}")
    return out
