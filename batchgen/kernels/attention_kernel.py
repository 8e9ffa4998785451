"""The one contract of the paged attention kernels. Every kernel, decode (with or without a
shared-prefix cascade) or prefill, on every backend (C portable / AVX, AMX, Triton, torch), is
called as

    kernel(q, k_cache, v_cache, seqs, scale, out, variant=FULL) -> bool

with the step's sequences described once, by `PagedSeqs`, and the layer's `AttentionVariant`
(sliding window, logit soft-cap, sinks). It writes the attention of every query row of `seqs`
into `out` and returns True, or returns False having written nothing where it does not run these
tensors (not built or not available here; a dtype, head size, block size, layout or variant it
has no code for): its caller then runs another path. Inputs that break the contract raise
ValueError (`check_inputs`, or the kernel's status: `kernel_status`).

Tensors: q and out [rows, num_heads, head_dim], one float dtype (float32, bfloat16, float16);
k_cache and v_cache [num_blocks, block_size, num_kv_heads, head_dim] in q's dtype, or an int8
pool (`kv_int8`) [num_blocks, block_size, num_kv_heads, head_dim + SCALE_BYTES]: each row its
head_dim int8 values, then their float32 scale (a kernel that has no code for one returns
False); num_heads a multiple of num_kv_heads; query head h reads kv head
h // (num_heads // num_kv_heads). Token position p of sequence s lives in slot
block_tables[s, p // block_size] * block_size + p % block_size. The C kernels take every tensor
contiguous, in the order of ``csrc/attention_kernel.h`` (`c_arguments`).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from batchgen.kernels.c_library import pointer
from batchgen.kernels.kernel_status import check_status

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # attention_kernel.h's DTYPE_*
INT8_POOL_CODES = {torch.bfloat16: 3}  # DTYPE_BF16_INT8_POOL: these queries over an int8 pool
SCALE_BYTES = 4  # an int8 pool row's float32 scale, after its values
C_ARGTYPES = ([ctypes.c_void_p] * 9 + [ctypes.c_int] * 8 + [ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
              + [ctypes.c_int] * 2)


@dataclass(frozen=True)
class AttentionVariant:
    """What one layer's attention computes beyond causal softmax(scale * q.k) v.

    - `window` > 0: a query at position p attends only positions p - window + 1 .. p (its own
      included), as transformers' sliding-window mask; 0 attends every earlier position.
    - `softcap` > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
    - `sinks` (float32 [num_heads]): one more logit per query head in the softmax's denominator
      that no value goes with (gpt-oss' attention sinks).
    """

    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    @property
    def is_full(self) -> bool:
        """Plain causal attention over every earlier position."""
        return self.window == 0 and self.softcap == 0.0 and self.sinks is None

    def within(self, num_positions: int) -> AttentionVariant:
        """This variant over contexts of at most `num_positions` positions: without its window
        where the window holds them all (it then masks nothing)."""
        return dataclasses.replace(self, window=0) if 0 < self.window and num_positions <= self.window else self


FULL = AttentionVariant()


@dataclass(frozen=True)
class PagedSeqs:
    """A step's sequences over the paged K/V pool, as every attention kernel takes them.

    Decode (no `query_starts`): sequence s's one query is row s of q, at position
    context_lens[s] - 1. Prefill: chunk s's queries are rows query_starts[s] .. + query_lens[s]
    of q, the last query_lens[s] of its context_lens[s] positions; other rows of out are left
    alone. Either way the K/V of every context position, the queries' own included, are in the
    pool.

    `groups` rows (first, end, prefix_tokens), in order and disjoint (`shared_prefixes`):
    sequences first..end-1 (at least two) hold the same blocks for their first prefix_tokens
    positions, before every query of theirs. A kernel may read that prefix once for all of them
    (cascade attention) or ignore the rows: the attention is the same.
    """

    block_tables: torch.Tensor  # int32 [S, max_blocks]; entries past a sequence's context are never read
    context_lens: torch.Tensor  # int32 [S], each in [1, max_blocks * block_size]
    groups: torch.Tensor | None = None  # int32 [G, 3]
    query_starts: torch.Tensor | None = None  # int32 [S], prefill only
    query_lens: torch.Tensor | None = None  # int32 [S], prefill only

    @property
    def is_decode(self) -> bool:
        return self.query_starts is None

    @property
    def num_groups(self) -> int:
        return 0 if self.groups is None else len(self.groups)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor given."""
        return [t for t in (self.block_tables, self.context_lens, self.groups, self.query_starts, self.query_lens)
                if t is not None]

    @cached_property
    def on_cpu_contiguous(self) -> bool:
        """Whether every tensor is a contiguous CPU tensor, as the C kernels take them (kept, as
        `checked_count`)."""
        return all(t.is_cpu and t.is_contiguous() for t in self.tensors())

    @cached_property
    def checked_count(self) -> int:
        """The number of sequences (block_tables' rows), once every tensor's dtype and shape is
        checked against it and all are found on one device (a ValueError naming the problem).
        Checked at the first kernel call and kept: every layer of a step passes the same object."""
        if (self.query_lens is None) != self.is_decode:
            raise ValueError("query_starts and query_lens are given together (prefill) or not at all (decode)")
        tables = self.block_tables
        if tables.dtype != torch.int32 or tables.dim() != 2:
            raise ValueError(f"block_tables must be int32 [num_seqs, max_blocks], got {tables.dtype} "
                             f"{tuple(tables.shape)}")
        num_seqs = tables.shape[0]
        for name in ("context_lens", "query_starts", "query_lens"):
            tensor = getattr(self, name)
            if tensor is not None and (tensor.dtype != torch.int32 or tensor.shape != (num_seqs,)):
                raise ValueError(f"{name} must be int32 [{num_seqs}], got {tensor.dtype} {tuple(tensor.shape)}")
        if self.groups is not None and (self.groups.dtype != torch.int32 or self.groups.dim() != 2
                                        or self.groups.shape[1] != 3):
            raise ValueError(f"groups must be int32 [num_groups, 3], got {self.groups.dtype} "
                             f"{tuple(self.groups.shape)}")
        devices = {t.device for t in self.tensors()}
        if len(devices) != 1:
            raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
        return num_seqs


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a pool (or rows gathered from one) stores."""
    return cache.shape[-1] - SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[-1]


AttentionKernel = Callable[..., bool]  # (q, k_cache, v_cache, seqs, scale, out, variant=FULL) -> bool


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
                 out: torch.Tensor) -> None:
    """Cheap shape, dtype and device checks of a kernel call; a ValueError naming the problem."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be 3-D and k_cache/v_cache 4-D of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or q.dtype not in DTYPES or k_cache.dtype not in (q.dtype, torch.int8):
        raise ValueError(f"q must be float32/bfloat16/float16 and k_cache, v_cache in its dtype or int8, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if head_dim_of(k_cache) != q.shape[2] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)} "
                         "(head_dim must match and num_heads be a multiple of num_kv_heads)")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)}")
    num_seqs = seqs.checked_count
    if seqs.is_decode and q.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be int32 [num_seqs={q.shape[0]}, max_blocks], got "
                         f"{seqs.block_tables.dtype} {tuple(seqs.block_tables.shape)}")
    devices = {q.device, k_cache.device, v_cache.device, out.device, seqs.block_tables.device}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def c_arguments(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs, scale: float,
                out: torch.Tensor, variant: AttentionVariant = FULL) -> tuple:
    """A call's arguments in ``csrc/attention_kernel.h``'s order (`C_ARGTYPES`), on
    ``torch.get_num_threads()`` threads; `variant.sinks` must be a contiguous float32 CPU tensor."""
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    dtype = INT8_POOL_CODES[q.dtype] if k_cache.dtype == torch.int8 else DTYPE_CODES[q.dtype]
    return (out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seqs.block_tables.data_ptr(),
            seqs.context_lens.data_ptr(), pointer(seqs.query_starts), pointer(seqs.query_lens),
            pointer(seqs.groups), len(seqs.context_lens), seqs.num_groups, q.shape[1], num_kv_heads,
            head_dim_of(k_cache), num_blocks, block_size, seqs.block_tables.shape[1], scale, variant.window,
            variant.softcap, pointer(variant.sinks), dtype, torch.get_num_threads())


def run_c_kernel(entry: Callable[..., int] | None, name: str, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, seqs: PagedSeqs, scale: float, out: torch.Tensor,
                 variant: AttentionVariant = FULL) -> bool:
    """A call of the C kernel `entry` (None: not built here) under the contract: the inputs
    checked; False where a tensor is not a contiguous CPU tensor or the kernel does not run them."""
    if entry is None:
        return False
    check_inputs(q, k_cache, v_cache, seqs, out)
    sinks = [] if variant.sinks is None else [variant.sinks]
    tensors = (q, k_cache, v_cache, out, *sinks)
    if not (seqs.on_cpu_contiguous and all(t.is_cpu and t.is_contiguous() for t in tensors)):
        return False
    if k_cache.dtype == torch.int8 and q.dtype not in INT8_POOL_CODES:
        return False
    return check_status(name, entry(*c_arguments(q, k_cache, v_cache, seqs, scale, out, variant)))
