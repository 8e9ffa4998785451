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

from batchgen.kernels.attention_kernel import C_ARGTYPES, DTYPE_CODES, FULL, AttentionVariant, PagedSeqs, run_c_kernel
from batchgen.kernels.c_library import load_library


@dataclass(frozen=True)
class Kernel:
    """The library's entry points (the two kernels return a `kernel_status.Status`)."""

    decode: Callable[..., int]
    prefill: Callable[..., int]
    prefill_supported: Callable[[int, int], int]
    has_amx_bf16: bool


@functools.cache
def load_kernel() -> Kernel | None:
    """This machine's build's entry points, or None if unavailable."""
    return load_build()


def load_build(extra_flags: tuple[str, ...] = ()) -> Kernel | None:
    """The entry points of a build of ``paged_attention.c``, or None if unavailable; `extra_flags`
    add to the compiler's (``-mno-avx512f``: the kernel as a CPU without AVX-512 runs it)."""
    library = load_library("paged_attention.c", extra_flags)
    if library is None:
        return None
    for function, argtypes in ((library.bg_paged_decode_attention, C_ARGTYPES),
                               (library.bg_paged_prefill_attention, C_ARGTYPES),
                               (library.bg_prefill_supported, [ctypes.c_int, ctypes.c_int])):
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return Kernel(library.bg_paged_decode_attention, library.bg_paged_prefill_attention,
                  library.bg_prefill_supported, bool(library.bg_has_amx_bf16()))


def is_available() -> bool:
    """True when the kernel is built and loaded (the result is cached)."""
    return load_kernel() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
                           scale: float, out: torch.Tensor, variant: AttentionVariant = FULL) -> bool:
    """Decode attention under `attention_kernel`'s contract: every dtype (float16 where the
    compiler has ``_Float16``) and head size; a group's prefix is read once for up to 16 of its
    members (cascade). Does not run without a build here, for float16 on a build without it, or
    for a tensor that is not contiguous."""
    kernel = load_kernel()
    return run_c_kernel(kernel and kernel.decode, "paged_decode_attention", q, k_cache, v_cache, seqs, scale, out,
                        variant)


def prefill_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `paged_prefill_attention` runs this dtype and head size here (its AVX-512 or AVX2
    code: float32 / bfloat16, head_dim a multiple of 32)."""
    kernel = load_kernel()
    return kernel is not None and dtype in (torch.float32, torch.bfloat16) and bool(
        kernel.prefill_supported(DTYPE_CODES[dtype], head_dim))


def prefill_is_preferred(dtype: torch.dtype) -> bool:
    """Whether the engine's prefill should run through `paged_prefill_attention` (where it runs):
    yes, except bf16 on a CPU with AMX-BF16, where torch's flash attention (oneDNN's AMX tile
    products) runs a 2,048-token causal prefill 3.1x faster (9.8 against 30.7 ms a layer) and
    512 tokens 2.1x (scripts/bench_cpu_attention.py, 2-core Intel Xeon with AMX)."""
    kernel = load_kernel()
    return kernel is not None and not (dtype == torch.bfloat16 and kernel.has_amx_bf16)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
                            scale: float, out: torch.Tensor, variant: AttentionVariant = FULL) -> bool:
    """Causal prefill attention under `attention_kernel`'s contract, each chunk over its whole
    context (it ignores `seqs.groups`). Does not run where `prefill_supported` refuses q's dtype
    and head size, or for a tensor that is not contiguous."""
    kernel = load_kernel()
    return run_c_kernel(kernel and kernel.prefill, "paged_prefill_attention", q, k_cache, v_cache, seqs, scale, out,
                        variant)
