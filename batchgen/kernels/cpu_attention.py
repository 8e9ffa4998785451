"""Fast CPU paged attention, decode and prefill: ``csrc/paged_attention.c``, built at first use
by ``c_library`` (cached per source, compiler and machine).

Invariants:
- ``is_available()`` never raises: without a compiler, or when the build or
  load fails, it is False and the engine uses its torch backend.
- The kernel reads K/V in place from the paged cache (no gather), computes in
  float32 with an online softmax and writes every element of its output.
- It runs on ``torch.get_num_threads()`` OpenMP threads, sharing torch's pool.
- Decode ``groups`` (a shared prefix of adjacent sequences) change how the attention is computed,
  never its result: the prefix is attended once for all its sequences.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.kernels.c_library import load_library
from batchgen.kernels.decode_inputs import check_decode_inputs

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STATUS_MESSAGES = {
    1: "a context length is < 1 or longer than the block table covers",
    2: "a block table entry is outside [0, num_blocks)",
    3: "this dtype is not supported by the compiled kernel",
    4: "the kernel could not allocate its scratch memory",
    5: "a shared-prefix group is out of order or range, has one member, is not shorter than a member's context, "
       "or its members do not hold the same prefix blocks",
}
_ARGTYPES = ([ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_int] * 2
             + [ctypes.c_void_p, ctypes.c_int])  # ..., num_threads, groups, num_groups
_PREFILL_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_int] * 2


@dataclass(frozen=True)
class Kernel:
    """The library's entry points (each returns a status code, 0 for success)."""

    decode: Callable[..., int]
    prefill: Callable[..., int]
    prefill_supported: Callable[[int, int], int]
    supports_float16: bool
    has_amx_bf16: bool


@functools.cache
def _load_kernel() -> Kernel | None:
    """This machine's build's entry points, or None if unavailable."""
    return load_build()


def load_build(extra_flags: tuple[str, ...] = ()) -> Kernel | None:
    """The entry points of a build of ``paged_attention.c``, or None if unavailable; `extra_flags`
    add to the compiler's (``-mno-avx512f``: the kernel as a CPU without AVX-512 runs it)."""
    library = load_library("paged_attention.c", extra_flags)
    if library is None:
        return None
    for function, argtypes in ((library.bg_paged_decode_attention, _ARGTYPES),
                               (library.bg_paged_prefill_attention, _PREFILL_ARGTYPES),
                               (library.bg_prefill_supported, [ctypes.c_int, ctypes.c_int])):
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return Kernel(library.bg_paged_decode_attention, library.bg_paged_prefill_attention,
                  library.bg_prefill_supported, bool(library.bg_supports_float16()), bool(library.bg_has_amx_bf16()))


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

    ``groups``: optional contiguous int32 [num_groups, 3] rows (first, end, prefix_tokens), in
    order and disjoint: sequences first..end-1 (at least two) hold the same blocks for their
    first ``prefix_tokens`` tokens, fewer than each one's context. That prefix is then read once
    for the whole group (cascade attention); the result is the same attention.

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
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if q.dtype == torch.float16 and not kernel.supports_float16:
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
    status = kernel.decode(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), num_seqs, num_heads, num_kv_heads,
        head_dim, num_blocks, block_size, block_tables.shape[1], scale, _DTYPE_CODES[q.dtype],
        torch.get_num_threads(), None if groups is None else groups.data_ptr(), 0 if groups is None else len(groups),
    )
    check_status("paged_decode_attention", status)
    return out


def prefill_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `paged_prefill_attention` runs this dtype and head size here (its AVX-512 or AVX2
    code: float32 / bfloat16, head_dim a multiple of 32)."""
    kernel = _load_kernel()
    return (kernel is not None and dtype in (torch.float32, torch.bfloat16)
            and bool(kernel.prefill_supported(_DTYPE_CODES[dtype], head_dim)))


def prefill_is_preferred(dtype: torch.dtype) -> bool:
    """Whether the engine's prefill should run through `paged_prefill_attention` (where it runs):
    yes, except bf16 on a CPU with AMX-BF16, where torch's flash attention (oneDNN's AMX tile
    products) runs a 2,048-token causal prefill 3.1x faster (9.8 against 30.7 ms a layer) and
    512 tokens 2.1x (scripts/bench_cpu_attention.py, 2-core Intel Xeon with AMX)."""
    kernel = _load_kernel()
    return kernel is not None and not (dtype == torch.bfloat16 and kernel.has_amx_bf16)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                            scale: float, out: torch.Tensor) -> bool:
    """Causal attention of prefill chunks over the paged pool, written into `out` ([rows, H, D]
    like `q`). Sequence s's queries are rows query_starts[s] .. + query_lens[s] of q, the last
    query_lens[s] of its context_lens[s] positions, whose K/V (its own new tokens included) are
    in the pool at its block table's slots; block_tables [S, max_blocks] and the three [S]
    tensors are contiguous int32. Returns False, writing nothing, where it does not apply: a
    dtype or head size `prefill_supported` refuses, or a non-contiguous q or out."""
    if not (prefill_supported(q.dtype, q.shape[-1]) and q.is_contiguous() and out.is_contiguous()):
        return False
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    status = _load_kernel().prefill(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), query_starts.data_ptr(), query_lens.data_ptr(), len(query_lens), q.shape[1],
        num_kv_heads, head_dim, num_blocks, block_size, block_tables.shape[1], scale, _DTYPE_CODES[q.dtype],
        torch.get_num_threads(),
    )
    check_status("paged_prefill_attention", status)
    return True


def check_status(function: str, status: int) -> None:
    """ValueError naming what the kernel refused, for a status other than 0."""
    if status != 0:
        raise ValueError(f"{function}: {_STATUS_MESSAGES.get(status, f'status {status}')}")

