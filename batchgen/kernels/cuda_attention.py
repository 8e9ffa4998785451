"""CUDA paged-attention decode: a Triton kernel that reads the paged KV cache in place.

`attention_kernel`'s contract, decode: one query token per sequence attends over its K/V,
found through its block table, with no per-step gather.

Work split. One program handles one (sequence, kv head, split): it loads each [BLOCK_N,
head_dim] K and V tile once (BLOCK_N tokens spanning several cache blocks, each token row a
contiguous, coalesced ``head_dim`` run) and uses it for every query head of the GQA group,
so K/V bytes are read once per kv head, not once per query head. The group's query rows are
padded to BLOCK_H >= 16 so that both products (Q·Kᵀ and P·V) are `tl.dot`s; the padded rows
cost arithmetic only, which a memory-bound kernel has to spare. Tiles are widened to float32
in registers and the products use tf32 tensor cores for bfloat16/float16 caches (tf32 holds
every bfloat16 and float16 value exactly, so Q·Kᵀ is as exact as a native half-precision
product, and P keeps 10 mantissa bits instead of 8) and IEEE float32 for float32 caches.
Widening also keeps one code path that Triton's CPU interpreter runs correctly: it cannot
multiply bfloat16 operands in `tl.dot`. Scores, the running max and sum and the output
accumulator are float32 (online softmax in base 2).

Cascade (shared prefixes). Given ``groups``, a second kernel reads each group's shared prefix
once for all its members: one program per (group, kv head, split) holds the query rows of up
to PREFIX_BLOCK_M // group-size members and runs the same online softmax over the prefix's
tiles; each member's own kernel finds its group in ``groups`` and starts past the prefix, and
the merge kernel combines the two as it combines splits. A step of 16 sequences on one 1,024-token prefix then reads the prefix's
K/V once instead of 16 times.

int8 pools (`kv_int8`). Over a pool of int8 rows (head_dim values, then their float32 scale)
the tiles load the int8 values, widened to float32 as a float pool's are (tf32 holds them
exactly); each score is multiplied by its key's scale and each softmax weight by its value's
before the P·V product, which is the attention of the dequantized rows up to float32 rounding.
The same program, cascade and split-K serve both pools; an int8 step reads (head_dim + 4) bytes
a row where bf16 reads 2 × head_dim.

Split-K (flash-decoding). When sequences × kv heads alone would leave SMs idle (small batch,
long context), each sequence's context is cut into ``num_splits`` contiguous token ranges;
every split writes its normalised partial output and log-sum-exp, and a second kernel merges
them per (sequence, head). The split count is derived from the block table's width, a host
value, so a call never waits on the GPU (and stays CUDA-graph friendly).

Expected bound. Decode attention is memory-bound: time >= bytes of K/V read / bandwidth, with
bytes = sum(context_lens) × num_kv_heads × head_dim × 2 (K and V) × element size. On an H200
(about 4.3 TB/s measured copy bandwidth): batch 32 × context 1024 with 3 kv heads of dim 64 in
bf16 reads 25.2 MB, about 5.9 µs per layer; batch 256 × 4096 reads 805 MB, about 187 µs.
Partial results add S × H × num_splits × (head_dim + 1) × 4 bytes, written and read once.

Invariants:
- Triton is imported here, guarded, and the engine imports this module only when a CUDA
  device asks for its decode path: CPU users without Triton never need it, and without
  Triton ``is_available()`` is False (it never raises).
- Every element of the output is written; context lengths are >= 1 (each sequence's own new
  token is already in the cache), so split 0 of every sequence is non-empty.
- Offsets into the cache are 64-bit: pools larger than 2**31 elements are addressed correctly.
"""

from __future__ import annotations

import functools
import math

import torch

from batchgen.kernels.attention_kernel import FULL, AttentionVariant, PagedSeqs, check_inputs

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

LOG2_E = 1.4426950408889634
MIN_BLOCK_H = 16  # tl.dot needs at least 16 rows
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
PREFIX_BLOCK_M = 64  # query rows of a group's members a prefix program holds at once
PROGRAMS_PER_SM = 4


def is_available() -> bool:
    """True when Triton imports and the current CUDA device is sm_80 or newer (tf32 dots)."""
    return triton is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def launch_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_N tokens per iteration, num_warps, num_stages) for a head dim.

    A [BLOCK_N, BLOCK_D] tile of K and one of V are in flight per pipeline stage (cp.async
    copies; the page-index loads are pipelined with them). The table keeps each program under
    ~90 registers per thread on sm_90 (so 5+ programs fit an SM) with 16-32 KiB of bf16 K+V
    per stage (as compiled for sm_90 by Triton 3.6 and 3.9: no register spills).
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_d <= 64:
        return block_d, 64, 4, 3
    if block_d <= 128:
        return block_d, 64, 8, 3
    return block_d, 32, 8, 2


if triton is not None:

    @triton.jit
    def _row_scales(cache_ptr, rows, is_valid, HEAD_DIM: tl.constexpr):
        """The float32 scales of an int8 pool's rows (their 4 bytes after the row's values; 0 where
        not `is_valid`)."""
        return tl.load((cache_ptr + rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=is_valid, other=0.0)

    @triton.jit
    def _attend_range(q, k_ptr, v_ptr, table, kv_head, start, end, scale_log2,
                      stride_k_block, stride_k_token, stride_k_head, BLOCK_ROWS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, INT8_ROWS: tl.constexpr):
        """Online softmax of the query rows `q` ([BLOCK_ROWS, BLOCK_D] float32) over the tokens
        start..end-1 of one kv head, found through `table`: (accumulator, row max, row sum). Over
        an int8 pool (INT8_ROWS) the products take the rows' int8 values, each score then scaled
        by its key's scale and each softmax weight by its value's."""
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        dim_mask = offs_d < HEAD_DIM
        row_max = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_ROWS], tl.float32)
        acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            positions = tile_start + offs_n
            is_valid = positions < end
            blocks = tl.load(table + positions // BLOCK_SIZE, mask=is_valid, other=0).to(tl.int64)
            rows = blocks * stride_k_block + (positions % BLOCK_SIZE) * stride_k_token + kv_head * stride_k_head
            tile_mask = is_valid[:, None] & dim_mask[None, :]
            k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=tile_mask, other=0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            if INT8_ROWS:  # the keys' int8 values: each score times its key's scale
                scores *= _row_scales(k_ptr, rows, is_valid, HEAD_DIM)[None, :]
            scores = tl.where(is_valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            correction = tl.exp2(row_max - new_max)
            p = tl.exp2(scores - new_max[:, None])
            row_sum = row_sum * correction + tl.sum(p, 1)
            v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=tile_mask, other=0).to(tl.float32)
            weights = p
            if INT8_ROWS:  # the values' int8 values: each weight times its value's scale
                weights = p * _row_scales(v_ptr, rows, is_valid, HEAD_DIM)[None, :]
            acc = acc * correction[:, None] + tl.dot(weights, v, input_precision=DOT_PRECISION)
            row_max = new_max
        return acc, row_max, row_sum

    @triton.jit
    def _store_part(part_out_ptr, part_lse_ptr, part_rows, row_mask, acc, row_max, row_sum,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """Store a range's normalised output and log2-sum-exp at rows `part_rows` of the partials."""
        offs_d = tl.arange(0, BLOCK_D)
        denominator = tl.maximum(row_sum, 1.0)  # row_sum >= 1 (the max term is 1) unless the range is empty
        tl.store(part_out_ptr + part_rows[:, None] * BLOCK_D + offs_d[None, :], acc / denominator[:, None],
                 mask=row_mask[:, None] & (offs_d < HEAD_DIM)[None, :])
        tl.store(part_lse_ptr + part_rows, row_max + tl.log2(denominator), mask=row_mask)

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, groups_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        scale_log2, tokens_per_split, num_parts, num_groups,
        stride_q_seq, stride_q_head, stride_k_block, stride_k_token, stride_k_head,
        stride_table_seq, stride_out_seq, stride_out_head,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr,
        DOT_PRECISION: tl.constexpr, INT8_ROWS: tl.constexpr,
    ):
        """Online softmax of one kv head's query group over one token range of one sequence: the
        split-th range of tokens_per_split from the sequence's start, past its group's prefix when
        it is in one of the `num_groups` groups (BLOCK_G > 0: a cascade call, whose prefix parts
        follow each sequence's own; this program writes a sequence's empty prefix part when it is
        in no group, `_prefix_split_kernel` a member's)."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + seq)
        start = split * tokens_per_split
        if BLOCK_G > 0:
            offs_g = tl.arange(0, BLOCK_G)
            group_rows = groups_ptr + offs_g * 3
            group_mask = offs_g < num_groups
            in_group = ((seq >= tl.load(group_rows, mask=group_mask, other=0))
                        & (seq < tl.load(group_rows + 1, mask=group_mask, other=0)))
            start += tl.sum(tl.where(in_group, tl.load(group_rows + 2, mask=group_mask, other=0), 0), 0)
            num_memberships = tl.sum(in_group.to(tl.int32), 0)
        end = tl.minimum(start + tokens_per_split, context_len)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + offs_h
        head_mask = offs_h < GROUP
        dim_mask = offs_d < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                    mask=head_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
        acc, row_max, row_sum = _attend_range(q, k_ptr, v_ptr, table, kv_head, start, end, scale_log2,
                                              stride_k_block, stride_k_token, stride_k_head, BLOCK_H, HEAD_DIM,
                                              BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, INT8_ROWS)
        if IS_SPLIT:
            part_rows = (seq * (GROUP * tl.num_programs(1)) + heads) * num_parts + split
            _store_part(part_out_ptr, part_lse_ptr, part_rows, head_mask, acc, row_max, row_sum, HEAD_DIM, BLOCK_D)
            if BLOCK_G > 0:  # an empty range: output 0, lse -inf (a tl.where mask: Triton 3.9's interpreter
                # refuses `block & scalar` as a store mask)
                _store_part(part_out_ptr, part_lse_ptr, part_rows + num_parts // 2,
                            tl.where(num_memberships == 0, head_mask, False),
                            tl.zeros([BLOCK_H, BLOCK_D], tl.float32), tl.full([BLOCK_H], float("-inf"), tl.float32),
                            tl.zeros([BLOCK_H], tl.float32), HEAD_DIM, BLOCK_D)
        else:
            result = acc / tl.maximum(row_sum, 1.0)[:, None]
            out_rows = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head
            tl.store(out_rows + offs_d[None, :], result.to(out_ptr.dtype.element_ty),
                     mask=head_mask[:, None] & dim_mask[None, :])

    @triton.jit
    def _prefix_split_kernel(
        q_ptr, k_ptr, v_ptr, block_tables_ptr, groups_ptr, part_out_ptr, part_lse_ptr,
        scale_log2, tokens_per_split, num_splits, num_parts,
        stride_q_seq, stride_q_head, stride_k_block, stride_k_token, stride_k_head, stride_table_seq,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, INT8_ROWS: tl.constexpr,
    ):
        """One group's shared prefix (the split-th range of it) for one kv head: the query rows of
        every member, BLOCK_M // GROUP members at a time, over K/V tiles read once for all of them;
        each member's partial goes to part num_splits + split."""
        group = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        first = tl.load(groups_ptr + group * 3)
        end = tl.load(groups_ptr + group * 3 + 1)
        prefix_len = tl.load(groups_ptr + group * 3 + 2)
        start = split * tokens_per_split
        stop = tl.minimum(start + tokens_per_split, prefix_len)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        table = block_tables_ptr + first.to(tl.int64) * stride_table_seq  # every member holds these blocks
        for pass_first in range(first, end, BLOCK_M // GROUP):
            members = pass_first + offs_m // GROUP
            heads = kv_head * GROUP + offs_m % GROUP
            row_mask = (offs_m < (BLOCK_M // GROUP) * GROUP) & (members < end)
            q = tl.load(q_ptr + members[:, None] * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                        mask=row_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
            acc, row_max, row_sum = _attend_range(q, k_ptr, v_ptr, table, kv_head, start, stop, scale_log2,
                                                  stride_k_block, stride_k_token, stride_k_head, BLOCK_M, HEAD_DIM,
                                                  BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, INT8_ROWS)
            part_rows = (members * (GROUP * tl.num_programs(1)) + heads) * num_parts + num_splits + split
            _store_part(part_out_ptr, part_lse_ptr, part_rows, row_mask, acc, row_max, row_sum, HEAD_DIM, BLOCK_D)

    @triton.jit
    def _merge_splits_kernel(
        part_out_ptr, part_lse_ptr, out_ptr, num_parts, stride_out_seq, stride_out_head,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    ):
        """Weight each part's output by its share of the total softmax mass (a part never
        written has lse -inf and output 0)."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        split_mask = offs_s < num_parts
        first_row = (seq * tl.num_programs(1) + head) * num_parts
        lse = tl.load(part_lse_ptr + first_row + offs_s, mask=split_mask, other=float("-inf"))
        weights = tl.exp2(lse - tl.max(lse, 0))
        parts = tl.load(part_out_ptr + (first_row + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                        mask=split_mask[:, None], other=0.0)
        merged = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
        out_row = out_ptr + seq * stride_out_seq + head * stride_out_head
        tl.store(out_row + offs_d, merged.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs on the CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int) -> int:
    """Splits per sequence: enough programs for every SM, each split at least a few tiles long."""
    wanted = math.ceil(PROGRAMS_PER_SM * num_sms / (num_seqs * num_kv_heads))
    longest = math.ceil(max_context / max(MIN_TOKENS_PER_SPLIT, block_n))
    return max(1, min(wanted, longest, MAX_SPLITS))


def _runs_on(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
             out: torch.Tensor) -> bool:
    """Whether the kernel reads these tensors' layout: contiguous caches, context lengths and
    groups; unit last strides of q, out and the block tables (their rows may be strided)."""
    return (k_cache.is_contiguous() and v_cache.is_contiguous() and seqs.context_lens.is_contiguous()
            and (seqs.groups is None or seqs.groups.is_contiguous())
            and q.stride(2) == 1 and out.stride(2) == 1 and seqs.block_tables.stride(1) == 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: PagedSeqs,
                           scale: float, out: torch.Tensor, variant: AttentionVariant = FULL) -> bool:
    """Decode attention under `attention_kernel`'s contract. A group's prefix is read once for all
    its members (cascade attention): each member attends its own tokens from prefix_tokens on,
    and the two parts are merged; group rows with first == end are empty (a CUDA graph's
    fixed-size group buffer). Does not run without Triton or on a layout `_runs_on` refuses.
    """
    if triton is None or not variant.is_full:
        return False
    check_inputs(q, k_cache, v_cache, seqs, out)
    if not _runs_on(q, k_cache, v_cache, seqs, out):
        return False
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return True
    block_tables, context_lens, groups = seqs.block_tables, seqs.context_lens, seqs.groups
    group = num_heads // num_kv_heads
    block_d, block_n, num_warps, num_stages = launch_config(head_dim)
    max_context = block_tables.shape[1] * block_size
    num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, block_n, _num_sms(q.device))
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context, tokens_per_split)  # no split left without a token
    num_parts = 2 * num_splits if groups is not None else num_splits  # a member's prefix parts follow its own
    part_out = part_lse = out
    if num_parts > 1:
        part_out = torch.empty((num_seqs, num_heads, num_parts, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=q.device)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    shapes = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  INT8_ROWS=k_cache.dtype == torch.int8, num_warps=num_warps, num_stages=num_stages)
    num_groups = seqs.num_groups
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, context_lens if groups is None else groups, out, part_out,
        part_lse, scale * LOG2_E, tokens_per_split, num_parts, num_groups, *strides, out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=max(MIN_BLOCK_H, triton.next_power_of_2(group)), IS_SPLIT=num_parts > 1,
        BLOCK_G=0 if groups is None else triton.next_power_of_2(max(1, num_groups)), **shapes,
    )
    if num_groups:
        _prefix_split_kernel[(num_groups, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, groups, part_out, part_lse,
            scale * LOG2_E, tokens_per_split, num_splits, num_parts, *strides,
            GROUP=group, BLOCK_M=max(PREFIX_BLOCK_M, triton.next_power_of_2(group)), **shapes,
        )
    if num_parts > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_parts, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SPLITS=triton.next_power_of_2(num_parts), num_warps=1,
        )
    return True
