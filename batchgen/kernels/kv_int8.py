"""The int8 K/V cache (`kv_cache_dtype: int8`): each token's key (and value) of each KV head is
stored as head_dim int8 values and their float32 scale, side by side in the pool.

A pool block of an int8 cache is [block_size, num_kv_heads, head_dim + SCALE_BYTES] int8: row
(token, head) holds ``round(x * (127 / max|x|))`` (to nearest even) then ``max|x| / 127`` as the
4 bytes of a float32, so a row is dequantized as ``values * scale`` on its own. The pool then
holds (2 * head_dim) / (head_dim + 4) times the tokens of a bf16 one (1.88x at head_dim 64), and
a decode step reads that much less. Blocks, block tables and hashes are those of any pool:
prefix caching does not change.

Invariants:
- `quantize` is symmetric per (token, head), a row of zeros giving values 0 and scale 0; its
  values satisfy ``|values| <= 127``.
- `readable` gives a gathered cache's rows as the dtype the attention computes in: a float
  cache's as they are, an int8 cache's dequantized (float32 products, then rounded to `dtype`).
- `store` writes the rows `quantize` gives (in C for bf16 rows where the kernels run).
- `over_dequantized_blocks(kernel)` runs a float pool's kernel over an int8 one: on the blocks its
  sequences read, dequantized (as `readable` does) into a pool of their own, block tables
  renumbered alike, so shared-prefix groups hold.
- `paged_decode_attention` follows `attention_kernel`'s contract over an int8 pool (bf16
  queries, C on AVX-512 with AVX512-VNNI and AVX512-BF16): the attention of the dequantized
  rows for the scaled queries quantized as `quantize` does (exact int8 dot products), each
  block's softmax weights (times their value rows' scales) rounded to 8 bits against the
  block's largest (int8 products again), up to the order of float32 sums; it returns False,
  writing nothing, where it does not run. A shared-prefix group's members get the output each
  would get alone, bit for bit.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from batchgen.kernels.attention_kernel import (FULL, SCALE_BYTES, AttentionKernel, AttentionVariant, PagedSeqs,
                                               check_inputs, head_dim_of)
from batchgen.kernels.c_library import load_library, pointer
from batchgen.kernels.kernel_status import check_status

KV_CACHE_DTYPES = ("auto", "int8")  # the engine option's values: auto is the model's dtype
INT8_MAX = 127


def is_int8(cache: torch.Tensor) -> bool:
    """Whether `cache` (a pool or rows gathered from one) is an int8 cache."""
    return cache.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, head) row of a cache of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., head_dim] (any float dtype) as int8 cache rows [..., head_dim + SCALE_BYTES]."""
    x = x.float()
    absmax = x.abs().amax(dim=-1, keepdim=True)
    # a true division (``127 / tensor`` in torch multiplies by a reciprocal, rounding twice)
    inverse = torch.where(absmax > 0, torch.full_like(absmax, INT8_MAX) / absmax, 0.0)
    values = (x * inverse).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    scales = (absmax / INT8_MAX).contiguous().view(torch.int8)
    return torch.cat([values, scales], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 cache rows [..., head_dim + SCALE_BYTES] as [..., head_dim] of `dtype`."""
    scales = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scales).to(dtype)


def readable(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as attention reads them: dequantized from an int8 cache, else as they are."""
    return dequantize(rows, dtype) if is_int8(rows) else rows


def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """The new tokens' K/V ([T, Hkv, head_dim]) at their slots, quantized into an int8 cache."""
    if is_int8(k_cache):
        if _store_in_c(k, v, k_cache, v_cache, slot_mapping):
            return
        k, v = quantize(k), quantize(v)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


@functools.cache
def library() -> ctypes.CDLL | None:
    return load_build()


def load_build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """A build of ``kv_int8_attention.c`` that holds the kernels, with their signatures set, or None;
    `extra_flags` add to the compiler's (``-mno-amx-int8``: every product on VNNI on a CPU with AMX)."""
    library = load_library("kv_int8_attention.c", extra_flags)
    if library is None or not library.bg_kv_int8_attention_available():
        return None
    library.bg_kv_int8_decode_attention.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 8 + [ctypes.c_float,
                                                                                                  ctypes.c_int]
    library.bg_kv_int8_store.argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
                                         + [ctypes.c_int] * 3 + [ctypes.c_int64, ctypes.c_int])
    library.bg_kv_int8_dequantize.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                                                         ctypes.c_int, ctypes.c_void_p, ctypes.c_int])
    return library


def _rows_of_heads(x: torch.Tensor) -> bool:
    """Whether `x` ([T, Hkv, head_dim]) is bf16 on the CPU with each token's heads contiguous."""
    return x.dtype == torch.bfloat16 and x.is_cpu and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _store_in_c(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> bool:
    """`store` into an int8 cache by the C kernel (the same rows `quantize` gives); False, writing
    nothing, where it does not run."""
    built = library()
    if (built is None or not (_rows_of_heads(k) and _rows_of_heads(v)) or slot_mapping.dtype != torch.int64
            or not all(t.is_cpu and t.is_contiguous() for t in (k_cache, v_cache, slot_mapping))):
        return False
    status = built.bg_kv_int8_store(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), len(slot_mapping), k.shape[1], k.shape[2], k_cache.shape[0] * k_cache.shape[1],
        torch.get_num_threads())
    return check_status("kv_int8 store", status)


def is_available() -> bool:
    """Whether this machine's build holds the int8 decode kernel."""
    return library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
                           scale: float, out: torch.Tensor, variant: AttentionVariant = FULL) -> bool:
    """Decode rows over an int8 pool (`attention_kernel`'s contract, the pool's rows
    [.., head_dim + SCALE_BYTES]). A group's shared blocks are read once for all its members
    (cascade attention), each member's result the same as without the group."""
    built = library()
    if (built is None or not variant.is_full or not is_int8(k_cache) or q.dtype != torch.bfloat16
            or not seqs.on_cpu_contiguous
            or not all(t.is_cpu and t.is_contiguous() for t in (q, k_cache, v_cache, out))):
        return False
    check_inputs(q, k_cache, v_cache, seqs, out)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    status = built.bg_kv_int8_decode_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seqs.block_tables.data_ptr(),
        seqs.context_lens.data_ptr(), pointer(seqs.groups), seqs.num_groups, len(seqs.context_lens), q.shape[1],
        num_kv_heads, head_dim_of(k_cache), num_blocks, block_size, seqs.block_tables.shape[1], scale,
        torch.get_num_threads())
    return check_status("kv_int8 paged_decode_attention", status)


def dequantized_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize(cache[blocks], dtype)` of an int8 pool (in C for bf16 where the kernels run)."""
    built = library()
    head_dim = head_dim_of(cache)
    if built is None or dtype != torch.bfloat16 or not (cache.is_cpu and cache.is_contiguous()):
        return dequantize(cache[blocks], dtype)
    blocks = blocks.to(torch.int64).contiguous()
    out = torch.empty((len(blocks), *cache.shape[1:-1], head_dim), dtype=dtype)
    status = built.bg_kv_int8_dequantize(cache.data_ptr(), blocks.data_ptr(), len(blocks), cache.shape[0],
                                         cache.shape[1] * cache.shape[2], head_dim, out.data_ptr(),
                                         torch.get_num_threads())
    return out if check_status("kv_int8 dequantize", status) else dequantize(cache[blocks], dtype)


def over_dequantized_blocks(kernel: AttentionKernel | None) -> AttentionKernel | None:
    """`kernel` (of a float pool) over an int8 pool: the blocks the sequences read dequantized to
    the queries' dtype into a pool of their own, block tables renumbered to it. Prefill runs so on
    the float pool's fastest kernels; the dequantized copy costs one pass over the rows read."""
    if kernel is None:
        return None

    def run(q, k_cache, v_cache, seqs: PagedSeqs, scale, out, variant: AttentionVariant = FULL) -> bool:
        block_size = k_cache.shape[1]
        blocks_read = (seqs.context_lens.long() + block_size - 1) // block_size
        read = torch.arange(seqs.block_tables.shape[1], device=q.device)[None, :] < blocks_read[:, None]
        blocks, renumbered = torch.unique(seqs.block_tables[read], return_inverse=True)
        tables = torch.zeros_like(seqs.block_tables)
        tables[read] = renumbered.to(tables.dtype)
        keys, values = dequantized_blocks(k_cache, blocks, q.dtype), dequantized_blocks(v_cache, blocks, q.dtype)
        return kernel(q, keys, values, dataclasses.replace(seqs, block_tables=tables), scale, out, variant)

    return run
