/*
 * The one signature of the paged attention kernels: decode (one query row per sequence, with or
 * without a shared-prefix cascade) and prefill, portable / AVX (paged_attention.c) and AMX
 * (amx_attention.c). attention_kernel.py's c_arguments passes a call's tensors in this order.
 *
 *   out, q            [rows, num_heads, head_dim], contiguous, `dtype`
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], contiguous, `dtype`; with
 *                     DTYPE_BF16_INT8_POOL (bf16 q and out) an int8 pool (kv_int8.py): each row
 *                     head_dim int8 values, then the SCALE_BYTES of their float32 scale
 *   block_tables      [num_seqs, max_blocks] int32; context_lens [num_seqs] int32
 *   query_starts, query_lens  [num_seqs] int32: prefill chunk s's queries are rows
 *                     query_starts[s] .. + query_lens[s], the last query_lens[s] of its
 *                     context_lens[s] positions; NULL for decode, whose query row s is sequence s's
 *   groups            [num_groups, 3] int32 rows (first, end, prefix_tokens), in order and
 *                     disjoint, or NULL: sequences first .. end - 1 (at least two) hold the same
 *                     blocks for their first prefix_tokens positions, before every query of theirs.
 *                     A kernel may attend that prefix once for all of them (cascade) or ignore the
 *                     rows: the attention is the same.
 *
 *   window            > 0: a query at position p attends only positions p - window + 1 .. p; 0: all
 *   softcap           > 0: each scaled score x becomes softcap * tanh(x / softcap); 0: none
 *   sinks             [num_heads] float32 or NULL: one more logit per query head in the softmax's
 *                     denominator, with no value (attention sinks)
 *   A kernel without code for a window, soft-cap or sinks returns STATUS_UNSUPPORTED.
 *
 * Token position p of sequence s lives in slot
 *   block_tables[s][p / block_size] * block_size + p % block_size,
 * and query head h reads kv head h / (num_heads / num_kv_heads). A kernel returns a STATUS_*
 * code (status.h); on STATUS_OK every element of every query row of `out` is written, on
 * STATUS_UNSUPPORTED nothing is (a kernel without code for a dtype, an int8 pool's among them).
 */
#ifndef BATCHGEN_ATTENTION_KERNEL_H
#define BATCHGEN_ATTENTION_KERNEL_H

#include <stdint.h>
#include <string.h>

#include "status.h"

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2, DTYPE_BF16_INT8_POOL = 3 };

#define SCALE_BYTES 4 /* an int8 pool row's float32 scale, after its values */

/* The parameters of every attention kernel, in the order described above: a kernel is defined
 * as `int name(ATTENTION_KERNEL_PARAMS) { ... }`. */
#define ATTENTION_KERNEL_PARAMS                                                                                   \
    void *out, const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,            \
        const int32_t *context_lens, const int32_t *query_starts, const int32_t *query_lens, const int32_t *groups, \
        int num_seqs, int num_groups, int num_heads, int num_kv_heads, int head_dim, int num_blocks,                \
        int block_size, int max_blocks, float scale, int window, float softcap, const float *sinks, int dtype,     \
        int num_threads

typedef int AttentionKernel(ATTENTION_KERNEL_PARAMS);

/* Whether decode group (first, end, prefix) keeps its invariant: at least two members, each
 * holding the first member's blocks for positions [0, prefix) and a position past them. */
static inline int decode_group_holds(const int32_t *block_tables, const int32_t *context_lens, int num_seqs,
                                     int block_size, int max_blocks, int first, int end, int prefix) {
    if (end > num_seqs || end - first < 2 || prefix < 1) return 0;
    for (int member = first; member < end; member++)
        if (prefix >= context_lens[member] ||
            memcmp(block_tables + (int64_t)member * max_blocks, block_tables + (int64_t)first * max_blocks,
                   sizeof(int32_t) * (size_t)((prefix + block_size - 1) / block_size)))
            return 0;
    return 1;
}

AttentionKernel bg_paged_decode_attention, bg_paged_prefill_attention; /* paged_attention.c */
AttentionKernel bg_amx_decode_attention, bg_amx_prefill_attention;     /* amx_attention.c */

#endif
