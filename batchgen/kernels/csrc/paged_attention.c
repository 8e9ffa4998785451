/*
 * Paged-attention decode for CPUs: one query token per sequence attends to
 * that sequence's keys and values, read in place from the paged KV cache.
 *
 * Layout (fixed by the engine):
 *   q, out            [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, max_blocks] int32
 *   context_lens      [num_seqs] int32
 * Token position p of sequence s lives in slot
 *   block_tables[s][p / block_size] * block_size + p % block_size.
 * Query head h reads kv head h / (num_heads / num_kv_heads).
 *
 * Work is split over (sequence, kv head) pairs. A pair handles every query
 * head of its group at once, so each K and V row is read from memory once.
 *
 * Shared prefixes (cascade attention): `groups` lists runs of consecutive
 * sequences [first, end) whose first `prefix` tokens are the same blocks.
 * Phase 1 reads each group's prefix once per kv head for the queries of all
 * its sequences and keeps the online-softmax state (max, sum, accumulator)
 * of every query; phase 2 starts each sequence from that state and reads
 * only its own tokens. The result is the same attention, with the prefix's
 * K and V read once per group instead of once per sequence.
 * Math is float32 with an online softmax: scores are computed for a chunk of
 * tokens, then the running max, running sum and accumulators are updated
 * once per chunk. Every output element is written, or an error is returned.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };
enum {
    STATUS_OK = 0,
    STATUS_BAD_CONTEXT_LEN = 1,
    STATUS_BAD_BLOCK_ID = 2,
    STATUS_BAD_DTYPE = 3,
    STATUS_NO_MEMORY = 4,
    STATUS_BAD_GROUP = 5
};

#define CHUNK_TOKENS 64
/* Below this many (token, kv head) pairs, waking more threads costs more than it saves. */
#define MIN_PARALLEL_WORK 4096

typedef struct {
    void *out;
    const void *q;
    const void *k_cache;
    const void *v_cache;
    const int32_t *block_tables;
    const int32_t *context_lens;
    int num_seqs, num_heads, num_kv_heads, head_dim;
    int num_blocks, block_size, max_blocks, dtype;
    float scale;
    const int32_t *groups; /* [num_groups, 3]: first row, end row, shared prefix tokens */
    int num_groups;
    int32_t *prefix_of_seq;  /* [num_seqs] shared prefix tokens of each sequence (0: none) */
    float *state;            /* [num_seqs, num_heads, head_dim + 2]: prefix softmax state */
} Problem;

/* Online-softmax state of one query head: running max, running sum, accumulator. */
typedef struct {
    float *max, *sum, *acc;
} HeadState;

typedef struct {
    float *q;       /* [queries, head_dim], pre-scaled */
    float *acc;     /* [queries, head_dim] */
    float *scores;  /* [queries, CHUNK_TOKENS], probabilities after update */
    float *row;     /* [head_dim] converted query row */
    float *converted; /* [CHUNK_TOKENS, head_dim] K or V rows converted to float */
    float *max;     /* [queries] running max */
    float *sum;     /* [queries] running sum of exp */
    int64_t slots[CHUNK_TOKENS];
    const float *rows[CHUNK_TOKENS]; /* float32 K or V rows of the chunk */
} Scratch;

static size_t element_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

static uint16_t float_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Return `n` elements at `src` as float32: `src` itself for float32 data,
 * otherwise `buf` filled with the converted values. */
static const float *as_float(const void *src, float *restrict buf, int n, int dtype) {
    if (dtype == DTYPE_F32) return (const float *)src;
    if (dtype == DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *b = (uint32_t *)buf;
        for (int i = 0; i < n; i++) b[i] = (uint32_t)s[i] << 16;
        return buf;
    }
#ifdef __FLT16_MAX__
    const _Float16 *s = (const _Float16 *)src;
    for (int i = 0; i < n; i++) buf[i] = (float)s[i];
#endif
    return buf;
}

static void store_row(void *dst, const float *restrict src, float factor, int n, int dtype) {
    if (dtype == DTYPE_F32) {
        float *d = (float *)dst;
        for (int i = 0; i < n; i++) d[i] = src[i] * factor;
    } else if (dtype == DTYPE_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int i = 0; i < n; i++) d[i] = float_to_bf16(src[i] * factor);
    } else {
#ifdef __FLT16_MAX__
        _Float16 *d = (_Float16 *)dst;
        for (int i = 0; i < n; i++) d[i] = (_Float16)(src[i] * factor);
#endif
    }
}

/* out[j] = q . rows[j] for four rows; four independent sums keep the FMA units busy. */
static inline void dot4(const float *restrict q, const float *const *rows, int d, float *restrict out) {
    const float *k0 = rows[0], *k1 = rows[1], *k2 = rows[2], *k3 = rows[3];
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int i = 0; i < d; i++) {
        s0 += q[i] * k0[i];
        s1 += q[i] * k1[i];
        s2 += q[i] * k2[i];
        s3 += q[i] * k3[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < n; i++) total += a[i] * b[i];
    return total;
}

/* acc += sum_j weights[j] * rows[j] for four rows (one pass over acc). */
static inline void axpy4(float *restrict acc, const float *restrict weights, const float *const *rows, int d) {
    const float *v0 = rows[0], *v1 = rows[1], *v2 = rows[2], *v3 = rows[3];
    float w0 = weights[0], w1 = weights[1], w2 = weights[2], w3 = weights[3];
#pragma omp simd
    for (int i = 0; i < d; i++) acc[i] += w0 * v0[i] + w1 * v1[i] + w2 * v2[i] + w3 * v3[i];
}

/* Fill s->slots for positions [start, start + n); 0 if a block id is out of range. */
static int resolve_slots(const Problem *p, const int32_t *table, int start, int n, Scratch *s) {
    for (int t = 0; t < n; t++) {
        int pos = start + t;
        int32_t block = table[pos / p->block_size];
        if (block < 0 || block >= p->num_blocks) return 0;
        s->slots[t] = (int64_t)block * p->block_size + pos % p->block_size;
    }
    return 1;
}

static const void *cache_row(const Problem *p, const void *cache, int64_t slot, int kv_head) {
    int64_t index = (slot * p->num_kv_heads + kv_head) * p->head_dim;
    return (const char *)cache + index * (int64_t)element_size(p->dtype);
}

/* Point s->rows at the chunk's K or V rows of `kv_head`, converted to float32 when needed. */
static void load_rows(const Problem *p, const void *cache, int kv_head, int n, Scratch *s) {
    for (int t = 0; t < n; t++)
        s->rows[t] = as_float(cache_row(p, cache, s->slots[t], kv_head), s->converted + (size_t)t * p->head_dim,
                              p->head_dim, p->dtype);
}

static void score_chunk(int d, int group, int n, Scratch *s) {
    for (int g = 0; g < group; g++) {
        const float *q = s->q + (size_t)g * d;
        float *score = s->scores + g * CHUNK_TOKENS;
        int t = 0;
        for (; t + 4 <= n; t += 4) dot4(q, s->rows + t, d, score + t);
        for (; t < n; t++) score[t] = dot(q, s->rows[t], d);
    }
}

/* Turn a chunk's scores into weights against the new running max and
 * rescale the running sum and accumulators of each head. */
static void update_softmax(int d, int group, int n, Scratch *s) {
    for (int g = 0; g < group; g++) {
        float *score = s->scores + g * CHUNK_TOKENS;
        float chunk_max = score[0];
        for (int t = 1; t < n; t++) chunk_max = score[t] > chunk_max ? score[t] : chunk_max;
        float new_max = chunk_max > s->max[g] ? chunk_max : s->max[g];
        if (new_max > s->max[g]) {
            float correction = expf(s->max[g] - new_max);
            float *acc = s->acc + g * d;
            for (int i = 0; i < d; i++) acc[i] *= correction;
            s->sum[g] *= correction;
            s->max[g] = new_max;
        }
        float chunk_sum = 0.0f;
        for (int t = 0; t < n; t++) {
            score[t] = expf(score[t] - new_max);
            chunk_sum += score[t];
        }
        s->sum[g] += chunk_sum;
    }
}

static void accumulate_values(int d, int group, int n, Scratch *s) {
    for (int g = 0; g < group; g++) {
        const float *weight = s->scores + g * CHUNK_TOKENS;
        float *restrict acc = s->acc + (size_t)g * d;
        int t = 0;
        for (; t + 4 <= n; t += 4) axpy4(acc, weight + t, s->rows + t, d);
        for (; t < n; t++)
            for (int i = 0; i < d; i++) acc[i] += weight[t] * s->rows[t][i];
    }
}

/* Load query head `head` of sequence `seq`, pre-scaled, into query slot `slot` of the scratch. */
static void load_query(const Problem *p, int seq, int head, int slot, Scratch *s) {
    int d = p->head_dim;
    size_t row_bytes = (size_t)d * element_size(p->dtype);
    const void *src = (const char *)p->q + ((int64_t)seq * p->num_heads + head) * row_bytes;
    const float *q = as_float(src, s->row, d, p->dtype);
    for (int i = 0; i < d; i++) s->q[(size_t)slot * d + i] = q[i] * p->scale;
}

/* The saved prefix state of query head `head` of sequence `seq`. */
static HeadState prefix_state(const Problem *p, int seq, int head) {
    float *base = p->state + ((int64_t)seq * p->num_heads + head) * (p->head_dim + 2);
    HeadState state = {base, base + 1, base + 2};
    return state;
}

/* Attend the `num_queries` loaded queries to positions [start, end) of `table` for `kv_head`,
 * updating their online-softmax state in the scratch. */
static int attend_range(const Problem *p, const int32_t *table, int start, int end, int kv_head,
                        int num_queries, Scratch *s) {
    int d = p->head_dim;
    for (int pos = start; pos < end; pos += CHUNK_TOKENS) {
        int n = end - pos < CHUNK_TOKENS ? end - pos : CHUNK_TOKENS;
        if (!resolve_slots(p, table, pos, n, s)) return STATUS_BAD_BLOCK_ID;
        load_rows(p, p->k_cache, kv_head, n, s);
        score_chunk(d, num_queries, n, s);
        update_softmax(d, num_queries, n, s);
        load_rows(p, p->v_cache, kv_head, n, s);
        accumulate_values(d, num_queries, n, s);
    }
    return STATUS_OK;
}

static void reset_state(int d, int num_queries, Scratch *s) {
    for (int g = 0; g < num_queries; g++) {
        s->max[g] = -INFINITY;
        s->sum[g] = 0.0f;
    }
    memset(s->acc, 0, sizeof(float) * (size_t)num_queries * d);
}

/* Phase 1: the shared prefix of group `index`, once for the queries of all its sequences. */
static int attend_group_prefix(const Problem *p, int index, int kv_head, Scratch *s) {
    int d = p->head_dim, group = p->num_heads / p->num_kv_heads;
    int first = p->groups[3 * index], end = p->groups[3 * index + 1], prefix = p->groups[3 * index + 2];
    int num_queries = (end - first) * group;
    for (int seq = first; seq < end; seq++)
        for (int g = 0; g < group; g++) load_query(p, seq, kv_head * group + g, (seq - first) * group + g, s);
    reset_state(d, num_queries, s);
    int code = attend_range(p, p->block_tables + (int64_t)first * p->max_blocks, 0, prefix, kv_head, num_queries, s);
    for (int slot = 0; slot < num_queries; slot++) {
        HeadState state = prefix_state(p, first + slot / group, kv_head * group + slot % group);
        *state.max = s->max[slot];
        *state.sum = s->sum[slot];
        memcpy(state.acc, s->acc + (size_t)slot * d, sizeof(float) * d);
    }
    return code;
}

/* Phase 2: a sequence's own tokens, starting from its prefix state when it has one. */
static int attend_pair(const Problem *p, int seq, int kv_head, Scratch *s) {
    int d = p->head_dim, group = p->num_heads / p->num_kv_heads;
    int context_len = p->context_lens[seq];
    if (context_len < 1 || context_len > (int64_t)p->max_blocks * p->block_size) return STATUS_BAD_CONTEXT_LEN;
    const int32_t *table = p->block_tables + (int64_t)seq * p->max_blocks;
    int prefix = p->prefix_of_seq ? p->prefix_of_seq[seq] : 0;
    reset_state(d, group, s);
    for (int g = 0; g < group; g++) {
        load_query(p, seq, kv_head * group + g, g, s);
        if (prefix > 0) {
            HeadState state = prefix_state(p, seq, kv_head * group + g);
            s->max[g] = *state.max;
            s->sum[g] = *state.sum;
            memcpy(s->acc + (size_t)g * d, state.acc, sizeof(float) * d);
        }
    }
    int code = attend_range(p, table, prefix, context_len, kv_head, group, s);
    if (code != STATUS_OK) return code;
    size_t row_bytes = (size_t)d * element_size(p->dtype);
    int64_t first_head = (int64_t)seq * p->num_heads + (int64_t)kv_head * group;
    for (int g = 0; g < group; g++)
        store_row((char *)p->out + (first_head + g) * row_bytes, s->acc + g * d, 1.0f / s->sum[g], d, p->dtype);
    return STATUS_OK;
}

/* Check the groups and record each member's prefix length; returns the largest group size. */
static int index_groups(Problem *p, int *status) {
    int largest = 1;
    for (int index = 0; index < p->num_groups; index++) {
        int first = p->groups[3 * index], end = p->groups[3 * index + 1], prefix = p->groups[3 * index + 2];
        if (first < 0 || end > p->num_seqs || first >= end || prefix < 0) *status = STATUS_BAD_GROUP;
        for (int seq = first; seq < end && *status == STATUS_OK; seq++) {
            if (prefix >= p->context_lens[seq] || p->prefix_of_seq[seq] != 0) *status = STATUS_BAD_GROUP;
            p->prefix_of_seq[seq] = prefix;
        }
        if (*status != STATUS_OK) return largest;
        largest = end - first > largest ? end - first : largest;
    }
    return largest;
}

static float *alloc_scratch(Scratch *s, int num_queries, int d) {
    size_t floats = (size_t)num_queries * (2 * d + CHUNK_TOKENS + 2) + (size_t)(CHUNK_TOKENS + 1) * d;
    float *base = (float *)malloc(sizeof(float) * floats);
    if (base == NULL) return NULL;
    s->q = base;
    s->acc = s->q + (size_t)num_queries * d;
    s->scores = s->acc + (size_t)num_queries * d;
    s->max = s->scores + (size_t)num_queries * CHUNK_TOKENS;
    s->sum = s->max + num_queries;
    s->row = s->sum + num_queries;
    s->converted = s->row + d;
    return base;
}

/* Entry point. Returns a STATUS_* code; on STATUS_OK every element of `out`
 * has been written. Runs on `num_threads` OpenMP threads. */
int bg_paged_decode_attention(void *out, const void *q, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, const int32_t *context_lens, int num_seqs,
                              int num_heads, int num_kv_heads, int head_dim, int num_blocks,
                              int block_size, int max_blocks, float scale, int dtype, int num_threads,
                              const int32_t *groups, int num_groups) {
#ifndef __FLT16_MAX__
    if (dtype == DTYPE_F16) return STATUS_BAD_DTYPE;
#endif
    if (dtype < DTYPE_F32 || dtype > DTYPE_F16) return STATUS_BAD_DTYPE;
    Problem p = {out, q, k_cache, v_cache, block_tables, context_lens, num_seqs, num_heads,
                 num_kv_heads, head_dim, num_blocks, block_size, max_blocks, dtype, scale,
                 groups, num_groups, NULL, NULL};
    int status = STATUS_OK, largest_group = 1;
    if (num_groups > 0) {
        p.prefix_of_seq = (int32_t *)calloc((size_t)num_seqs, sizeof(int32_t));
        p.state = (float *)malloc(sizeof(float) * (size_t)num_seqs * num_heads * (head_dim + 2));
        if (p.prefix_of_seq == NULL || p.state == NULL) status = STATUS_NO_MEMORY;
        else largest_group = index_groups(&p, &status);
    }
    int64_t work = 0;
    for (int seq = 0; seq < num_seqs; seq++) work += (int64_t)context_lens[seq] * num_kv_heads;
    int is_parallel = num_threads > 1 && num_seqs * num_kv_heads > 1 && work >= MIN_PARALLEL_WORK;
    if (status == STATUS_OK) {
#pragma omp parallel num_threads(num_threads) if (is_parallel)
        {
            Scratch s = {0};
            float *base = alloc_scratch(&s, largest_group * (num_heads / num_kv_heads), head_dim);
            if (base == NULL) {
#pragma omp atomic write
                status = STATUS_NO_MEMORY;
            }
            /* Phase 1, then (after the loop's barrier) phase 2. */
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < num_groups * num_kv_heads; item++) {
                int code = base ? attend_group_prefix(&p, item / num_kv_heads, item % num_kv_heads, &s) : STATUS_OK;
                if (code != STATUS_OK) {
#pragma omp atomic write
                    status = code;
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < num_seqs * num_kv_heads; item++) {
                int code = base ? attend_pair(&p, item / num_kv_heads, item % num_kv_heads, &s) : STATUS_OK;
                if (code != STATUS_OK) {
#pragma omp atomic write
                    status = code;
                }
            }
            free(base);
        }
    }
    free(p.prefix_of_seq);
    free(p.state);
    return status;
}

int bg_supports_float16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}
