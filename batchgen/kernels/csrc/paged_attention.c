/*
 * Paged attention for CPUs: decode (one query token per sequence) and prefill
 * chunks attend to their sequence's keys and values, read in place from the
 * paged KV cache.
 *
 * Layout, signature and statuses: attention_kernel.h, status.h.
 *
 * Decode work is split over sequences; a sequence is read 64 tokens at a time,
 * every kv head's rows of a chunk together (each block's rows of every kv head
 * are contiguous) and each kv head's rows once for all the query heads of its
 * group. With AVX-512 or AVX2 with FMA (float32 / bfloat16, head_dim a
 * multiple of 32) the chunk goes in runs of blocks through vector code, the next
 * chunk prefetched; bf16 products use the AVX512-BF16 dot instruction where
 * present.
 *
 * Prefill (AVX-512, or AVX2 with FMA; float32 / bfloat16, head_dim a multiple
 * of 32): causal attention of prefill chunks over the pool, work items
 * (sequence, 16 query tokens, kv head), computed in columns (a tile's query
 * rows are vector lanes; see attend_columns).
 *
 * Cascade decode: decode sequences given as a group share a prefix of blocks;
 * one tile per (16 members, kv head) attends that prefix once, reading its K
 * and V once (in columns where the prefill code runs, elsewhere in rows:
 * attend_prefix_rows), and each member continues from the resulting softmax
 * state over its own tokens.
 *
 * Math is float32 with an online softmax: scores are computed for a chunk of
 * tokens, then the running max, running sum and accumulators are updated
 * once per chunk. Every output element is written, or an error is returned.
 *
 * Variants (attention_kernel.h): a sliding window starts each query's keys at its window (decode
 * rows skip the keys before it, prefill tiles start at their first row's window and mask the
 * older keys of later rows; decode groups are ignored: a window leaves no prefix shared by every
 * member's window); a soft-cap bends each chunk's scores before its softmax update; sinks start
 * every query's softmax state at the sink's logit with a sum of 1 and no value.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_kernel.h"
#include "vector_math.h"

#define CHUNK_TOKENS 64
#define LN2 0.6931471805599453f
/* The vector path (float32 / bfloat16, head_dim a multiple of 32) keeps this many query heads'
 * accumulators in registers at once. */
#define MAX_VECTOR_GROUP 8
/* Query tokens per work item of the prefill kernel. */
#define PREFILL_TILE 16
/* Lines of the next chunk asked for before each (block run, query head) of a decode chunk's scores. */
#define SCORE_FETCH_LINES 12
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
    const int32_t *prefix_lens; /* decode: [num_seqs] leading tokens already attended (0: none), or NULL */
    const float *state;         /* decode: [num_seqs, num_heads, head_dim + 2] max, sum, accumulator of them */
    int window;                 /* the variant (attention_kernel.h) */
    float softcap;
    const float *sinks;
} Problem;

/* Per-thread scratch, in the decode layout below; the column code (prefill, cascade) lays q, acc,
 * scores and weight_pairs out in columns (see "The prefill kernel keeps a tile's rows in columns"). */
typedef struct {
    float *q;       /* [queries, head_dim], pre-scaled */
    float *acc;     /* [queries, head_dim] */
    float *scores;  /* [queries, CHUNK_TOKENS], probabilities after update */
    float *row;     /* [head_dim] converted query row */
    float *converted; /* [CHUNK_TOKENS, head_dim] K or V rows converted to float; the AVX-512 bf16
                         path's V pairs of a chunk */
    uint32_t *weight_pairs; /* [queries, CHUNK_TOKENS / 2] bf16 pairs of weights (AVX-512 bf16 path) */
    float *max;     /* [queries] running max */
    float *sum;     /* [queries] running sum of exp */
    float *correction; /* [queries] column code: the factor of acc from the chunk's new max, applied as the
                          chunk's values are added (no separate pass over acc) */
    int64_t slots[CHUNK_TOKENS];
    const float *rows[CHUNK_TOKENS]; /* float32 K or V rows of the chunk */
} Scratch;

static size_t element_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

/* The first position a query at `position` attends: its window's first (0 without a window). */
static inline int window_start(const Problem *p, int position) {
    return p->window > 0 && position >= p->window ? position - p->window + 1 : 0;
}

/* The soft-cap on n scores in place: x -> c tanh(x / c) with c = p->softcap, the scores in `units`
 * per natural unit (1, or LOG2E for the column code's log2 units); tanh(y) = 1 - 2 / (e^2y + 1)
 * through vector_expf, so the loop vectorizes (|y| clamped at 9, where tanh is 1 in float32). */
static void cap_scores(const Problem *p, float *scores, int n, float units) {
    if (p->softcap <= 0.0f) return;
    float cap = p->softcap * units;
    for (int i = 0; i < n; i++) {
        float y = clamp(scores[i] / cap, -9.0f, 9.0f);
        scores[i] = cap * (1.0f - 2.0f / (vector_expf(2.0f * y) + 1.0f));
    }
}

/* A query head's softmax state before any key: its sink's logit (in `units` per natural unit)
 * with a sum of 1, or empty. */
static inline void start_state(const Problem *p, int head, float units, float *max, float *sum) {
    *max = p->sinks ? p->sinks[head] * units : -INFINITY;
    *sum = p->sinks ? 1.0f : 0.0f;
}

/* Return `n` elements at `src` as float32: `src` itself for float32 data,
 * otherwise `buf` filled with the converted values. */
static const float *as_float(const void *src, float *restrict buf, int n, int dtype) {
    if (dtype == DTYPE_F32) return (const float *)src;
    if (dtype == DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++) buf[i] = bf16_to_float(s[i]);
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

/* The chunk's scores of query heads [first, first + count) against s->rows. */
static void score_chunk(int d, int first, int count, int n, Scratch *s) {
    for (int g = first; g < first + count; g++) {
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
#pragma omp simd reduction(max : chunk_max)
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
#pragma omp simd reduction(+ : chunk_sum)
        for (int t = 0; t < n; t++) {
            score[t] = vector_expf(score[t] - new_max);
            chunk_sum += score[t];
        }
        s->sum[g] += chunk_sum;
    }
}

/* acc += weights . s->rows for query heads [first, first + count). */
static void accumulate_values(int d, int first, int count, int n, Scratch *s) {
    for (int g = first; g < first + count; g++) {
        const float *weight = s->scores + g * CHUNK_TOKENS;
        float *restrict acc = s->acc + (size_t)g * d;
        int t = 0;
        for (; t + 4 <= n; t += 4) axpy4(acc, weight + t, s->rows + t, d);
        for (; t < n; t++)
            for (int i = 0; i < d; i++) acc[i] += weight[t] * s->rows[t][i];
    }
}

/* The row of query head `head` of packed token `row` in q. */
static inline const void *query_row(const Problem *p, int64_t row, int head) {
    return (const char *)p->q + (row * p->num_heads + head) * p->head_dim * element_size(p->dtype);
}

/* Load query head `head` of packed token `row`, pre-scaled, into query slot `slot` of the scratch. */
static void load_query(const Problem *p, int64_t row, int head, int slot, Scratch *s) {
    int d = p->head_dim;
    const float *q = as_float(query_row(p, row, head), s->row, d, p->dtype);
    for (int i = 0; i < d; i++) s->q[(size_t)slot * d + i] = q[i] * p->scale;
}

static void reset_state(int d, int num_queries, Scratch *s) {
    for (int g = 0; g < num_queries; g++) {
        s->max[g] = -INFINITY;
        s->sum[g] = 0.0f;
    }
    memset(s->acc, 0, sizeof(float) * (size_t)num_queries * d);
}

/* Attend the chunk of `n` positions resolved into s->slots for kv heads first_kv_head ..
 * first_kv_head + num_kv - 1, the i-th of them for query slots [i * per_kv, (i + 1) * per_kv):
 * scores against each kv head's K rows, one softmax update, then each kv head's V rows. */
static void attend_chunk(const Problem *p, int n, int first_kv_head, int num_kv, int per_kv, Scratch *s) {
    int d = p->head_dim;
    for (int i = 0; i < num_kv; i++) {
        load_rows(p, p->k_cache, first_kv_head + i, n, s);
        score_chunk(d, i * per_kv, per_kv, n, s);
    }
    for (int g = 0; g < num_kv * per_kv; g++) cap_scores(p, s->scores + g * CHUNK_TOKENS, n, 1.0f);
    update_softmax(d, num_kv * per_kv, n, s);
    for (int i = 0; i < num_kv; i++) {
        load_rows(p, p->v_cache, first_kv_head + i, n, s);
        accumulate_values(d, i * per_kv, per_kv, n, s);
    }
}

/* Load sequence `seq`'s queries (query slot h: head h) and the softmax state of its shared prefix
 * where it has one (p->prefix_lens; else an empty state); returns the positions already attended. */
static int load_prefix_state(const Problem *p, int seq, Scratch *s) {
    int d = p->head_dim, num_heads = p->num_heads, prefix = p->prefix_lens ? p->prefix_lens[seq] : 0;
    reset_state(d, num_heads, s);
    for (int h = 0; h < num_heads; h++) {
        load_query(p, seq, h, h, s);
        start_state(p, h, 1.0f, &s->max[h], &s->sum[h]);
        if (prefix > 0) {
            const float *state = p->state + ((int64_t)seq * num_heads + h) * (d + 2);
            s->max[h] = state[0], s->sum[h] = state[1];
            memcpy(s->acc + (size_t)h * d, state + 2, sizeof(float) * d);
        }
    }
    return prefix;
}

/* The shared prefix (the first `prefix` tokens, in sequence `first`'s blocks) of sequences first ..
 * first + num_members - 1, for the query heads of `kv_head`: each chunk's K and V rows are read
 * once for all the members' queries (query slot r: member r / group, head r % group of the kv
 * head); the softmax state goes to `state` ([seq, head, max, sum, acc]), from which attend_seq
 * continues each member over its own tokens. */
static int attend_prefix_rows(const Problem *p, int first, int num_members, int prefix, int kv_head, float *state,
                              Scratch *s) {
    int d = p->head_dim, group = p->num_heads / p->num_kv_heads, count = num_members * group;
    const int32_t *table = p->block_tables + (int64_t)first * p->max_blocks;
    reset_state(d, count, s);
    for (int r = 0; r < count; r++) {
        load_query(p, first + r / group, kv_head * group + r % group, r, s);
        start_state(p, kv_head * group + r % group, 1.0f, &s->max[r], &s->sum[r]);
    }
    for (int pos = 0; pos < prefix; pos += CHUNK_TOKENS) {
        int n = prefix - pos < CHUNK_TOKENS ? prefix - pos : CHUNK_TOKENS;
        if (!resolve_slots(p, table, pos, n, s)) return STATUS_BAD_BLOCK_ID;
        attend_chunk(p, n, kv_head, 1, count, s);
    }
    for (int r = 0; r < count; r++) {
        float *row_state = state + ((int64_t)(first + r / group) * p->num_heads + kv_head * group + r % group) * (d + 2);
        row_state[0] = s->max[r], row_state[1] = s->sum[r];
        memcpy(row_state + 2, s->acc + (size_t)r * d, sizeof(float) * d);
    }
    return STATUS_OK;
}

/* A sequence's tokens for every query head, CHUNK_TOKENS at a time: a chunk's K (then V) rows
 * of every kv head are read together (a block's rows of all heads are one contiguous run of the
 * pool). The path of CPUs without AVX-512 or AVX2 (and of other dtypes and head sizes). One
 * layer of 32 sequences x 1,024 tokens in float32, built without AVX-512 (before the vector path
 * ran on AVX2; 2-core AMD EPYC family 25 / model 17): 3.5-4.2 ms, against 4.9-5.1 read a kv head
 * at a time (a work item per sequence and kv head) and 2.3 on the AVX-512 vector path; asking for
 * the next chunk's rows ahead (at once, or in slices between the kv heads) made no difference. */
static int attend_seq(const Problem *p, int seq, Scratch *s) {
    int d = p->head_dim, num_heads = p->num_heads;
    int context_len = p->context_lens[seq];
    if (context_len < 1 || context_len > (int64_t)p->max_blocks * p->block_size) return STATUS_BAD_CONTEXT_LEN;
    const int32_t *table = p->block_tables + (int64_t)seq * p->max_blocks;
    int prefix = load_prefix_state(p, seq, s), start = window_start(p, context_len - 1);
    for (int pos = prefix > start ? prefix : start; pos < context_len; pos += CHUNK_TOKENS) {
        int n = context_len - pos < CHUNK_TOKENS ? context_len - pos : CHUNK_TOKENS;
        if (!resolve_slots(p, table, pos, n, s)) return STATUS_BAD_BLOCK_ID;
        attend_chunk(p, n, 0, p->num_kv_heads, num_heads / p->num_kv_heads, s);
    }
    size_t row_bytes = (size_t)d * element_size(p->dtype);
    for (int h = 0; h < num_heads; h++)
        store_row((char *)p->out + ((int64_t)seq * num_heads + h) * row_bytes, s->acc + (size_t)h * d, 1.0f / s->sum[h],
                  d, p->dtype);
    return STATUS_OK;
}

/* Vector code, on AVX-512 (16 float lanes) or AVX2 with FMA (8 lanes), for float32 / bfloat16
 * with head_dim a multiple of 32: the decode rows path (attend_seq_vector) and the column code
 * (prefill, cascade). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define HAS_VECTOR_CODE 1
#include <immintrin.h>

/* The float vector: LANES elements of a row (decode rows path) or LANES rows of a tile (column
 * code). A column score tile holds SCORE_KEYS keys x 3 row vectors of accumulators: 24 of
 * AVX-512's 32 registers, 12 of AVX2's 16 (with AVX2, 8 keys took 1.12-1.14x as long over a
 * 2,048-token float32 prefill, interleaved A/B). */
#if defined(__AVX512F__)
#define LANES 16
#define SCORE_KEYS 8
typedef __m512 Vec;
#define VEC_PS(op) _mm512_##op##_ps /* the float intrinsic `op` at this width */
static inline Vec vec_round(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* poly * 2^n for integral n >= -150 (2^n below 2^-126 as a subnormal or 0). */
static inline Vec vec_times_pow2(Vec poly, Vec n) { return _mm512_scalef_ps(poly, n); }
#define EXP2_FLOOR -150.0f
/* Elements i .. i + 15 of a bfloat16 row, as float32. */
static inline Vec vec_load_bf16(const uint16_t *row) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row)), 16));
}
/* x[0 .. n) = v[0 .. n), 0 < n <= LANES; x[n ..] untouched. */
static inline void vec_store_first(float *x, Vec v, int n) { _mm512_mask_storeu_ps(x, (__mmask16)((1u << n) - 1), v); }
/* The 16 horizontal sums of v[0..15], in order, as one vector: a transpose-and-add tree (45
 * shuffles and adds for 16 sums, where one reduction per sum takes about 8). */
static inline Vec vec_sum_lanes(const Vec v[LANES]) {
    __m512 pairs[8], quads[4], octets[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the four vectors' lane sums */
        __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes 0+1 and 2+3 of two quads */
        octets[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(octets[0], octets[1], 0x88), _mm512_shuffle_f32x4(octets[0], octets[1], 0xDD));
}
#else
#define LANES 8
#define SCORE_KEYS 4
typedef __m256 Vec;
#define VEC_PS(op) _mm256_##op##_ps
static inline Vec vec_round(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* poly * 2^n for integral n >= -127, built in the exponent field: 2^-127 is 0 (its field is 0). */
static inline Vec vec_times_pow2(Vec poly, Vec n) {
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(poly, _mm256_castsi256_ps(exponent));
}
#define EXP2_FLOOR -127.0f
static inline Vec vec_load_bf16(const uint16_t *row) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)row)), 16));
}
static inline void vec_store_first(float *x, Vec v, int n) {
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(x, mask, v);
}
/* The 8 horizontal sums of v[0..7], in order, as one vector (the same tree as AVX-512's). */
static inline Vec vec_sum_lanes(const Vec v[LANES]) {
    __m256 pairs[4], quads[2];
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) { /* per 128-bit lane: the four vectors' lane sums */
        __m256d x = _mm256_castps_pd(pairs[2 * i]), y = _mm256_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
#endif
static inline Vec vec_load(const float *x) { return VEC_PS(loadu)(x); }
static inline void vec_store(float *x, Vec v) { VEC_PS(storeu)(x, v); }
static inline Vec vec_set1(float x) { return VEC_PS(set1)(x); }
static inline Vec vec_zero(void) { return VEC_PS(setzero)(); }
static inline Vec vec_fma(Vec a, Vec b, Vec c) { return VEC_PS(fmadd)(a, b, c); }
static inline Vec vec_add(Vec a, Vec b) { return VEC_PS(add)(a, b); }
static inline Vec vec_sub(Vec a, Vec b) { return VEC_PS(sub)(a, b); }
static inline Vec vec_mul(Vec a, Vec b) { return VEC_PS(mul)(a, b); }
static inline Vec vec_max(Vec a, Vec b) { return VEC_PS(max)(a, b); } /* b when either is NaN */
/* x where it is finite or +inf, 0 where it is -inf. */
static inline Vec vec_zero_if_minus_inf(Vec x) {
#if defined(__AVX512F__)
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), x, _mm512_setzero_ps());
#else
    return _mm256_blendv_ps(x, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
#endif
}
/* Elements i .. i + LANES - 1 of a float32 or bfloat16 row, as float32. */
static inline Vec vec_load_row(const void *row, int i, int is_bf16) {
    return is_bf16 ? vec_load_bf16((const uint16_t *)row + i) : vec_load((const float *)row + i);
}

static int is_vector_problem(const Problem *p) {
    return (p->dtype == DTYPE_F32 || p->dtype == DTYPE_BF16) && p->head_dim % 32 == 0;
}

/* A run of a chunk's tokens inside one block: its rows of every kv head are contiguous. */
typedef struct {
    const char *keys, *values; /* the first row, kv head 0 */
    int start, length;         /* its tokens' place in the chunk */
} Segment;

/* The K and V lines (all kv heads) of the chunk after the current one, asked for a few at a time
 * while the current one is computed. Blocks sit anywhere in the pool, so the hardware prefetcher
 * cannot guess the next one; and asked for at once, a chunk's lines (768 for 64 bf16 tokens of
 * 3 x 64) fill the core's miss buffers, each further prefetch waiting for a free one, so the
 * computing waits too: spread over the chunk's scores and products, decode of 64 sequences of
 * ~350 tokens took 1.0-1.2 against 1.5-1.7 ms (one layer, two threads, caches flushed). */
typedef struct {
    const char *keys[CHUNK_TOKENS], *values[CHUNK_TOKENS]; /* each run's first row, kv head 0 */
    int64_t bytes[CHUNK_TOKENS];                            /* each run's K (= V) bytes */
    int num_runs, run;                                      /* the run being asked for */
    int64_t offset;                                         /* its next line */
    int lines_left;                                         /* K and V lines not asked for yet */
} Ahead;

/* Plan the lines of positions [start, end) of a block table (blocks out of range are skipped:
 * next_chunk reports them when their chunk comes). */
static void plan_ahead(const Problem *p, const int32_t *table, int start, int end, Ahead *ahead) {
    int bs = p->block_size;
    int64_t row_bytes = (int64_t)p->num_kv_heads * p->head_dim * element_size(p->dtype);
    ahead->num_runs = 0, ahead->run = 0, ahead->offset = 0, ahead->lines_left = 0;
    for (int pos = start; pos < end;) {
        int block = table[pos / bs], length = bs - pos % bs < end - pos ? bs - pos % bs : end - pos;
        if (block >= 0 && block < p->num_blocks) {
            int64_t slot = (int64_t)block * bs + pos % bs;
            ahead->keys[ahead->num_runs] = cache_row(p, p->k_cache, slot, 0);
            ahead->values[ahead->num_runs] = cache_row(p, p->v_cache, slot, 0);
            ahead->bytes[ahead->num_runs++] = length * row_bytes;
            ahead->lines_left += 2 * (int)((length * row_bytes + 63) / 64);
        }
        pos += length;
    }
}

/* Ask for the next `lines` planned lines (K and V alternately; all that are left when fewer). */
static inline void fetch_ahead(Ahead *ahead, int lines) {
    for (; lines > 0 && ahead->run < ahead->num_runs; lines -= 2) {
        _mm_prefetch(ahead->keys[ahead->run] + ahead->offset, _MM_HINT_T1);
        _mm_prefetch(ahead->values[ahead->run] + ahead->offset, _MM_HINT_T1);
        ahead->lines_left -= 2;
        ahead->offset += 64;
        if (ahead->offset >= ahead->bytes[ahead->run]) ahead->run++, ahead->offset = 0;
    }
}

/* The next chunk of positions [*pos, end): at most CHUNK_TOKENS of them, as runs inside blocks
 * (`*n` tokens in all); advances *pos past it and plans the chunk after it in `ahead`. Returns
 * the number of segments, or -1 when a block id is out of range. */
static int next_chunk(const Problem *p, const int32_t *table, int *pos, int end, Segment *segments, int *n,
                      Ahead *ahead) {
    int bs = p->block_size, num_segments = 0;
    *n = 0;
    while (*pos < end && *n < CHUNK_TOKENS) {
        int block = table[*pos / bs], offset = *pos % bs;
        if (block < 0 || block >= p->num_blocks) return -1;
        int length = bs - offset;
        length = length < end - *pos ? length : end - *pos;
        length = length < CHUNK_TOKENS - *n ? length : CHUNK_TOKENS - *n;
        int64_t slot = (int64_t)block * bs + offset;
        segments[num_segments++] = (Segment){cache_row(p, p->k_cache, slot, 0), cache_row(p, p->v_cache, slot, 0), *n, length};
        *n += length;
        *pos += length;
    }
    plan_ahead(p, table, *pos, end - *pos < CHUNK_TOKENS ? end : *pos + CHUNK_TOKENS, ahead);
    return num_segments;
}

/* scores[t] = q . k_t for rows t < n (n <= LANES) of one block: bfloat16 products on the CPU's
 * bf16 dot instruction where it has one (`q_raw`, the unscaled bf16 query, scaled after), else
 * float32 FMAs with `q_scaled`, the pre-scaled float32 query. Only scores[0 .. n) are written
 * (a run may end mid-chunk). */
static inline void score_rows(const Problem *p, const void *q_raw, const float *q_scaled, const char *k,
                              int64_t row_stride, int n, float *scores) {
    int d = p->head_dim;
    const char *row[LANES]; /* rows past n repeat row n - 1: every loop below has LANES iterations, so
                               the accumulators stay in registers */
    for (int t = 0; t < LANES; t++) row[t] = k + (t < n ? t : n - 1) * row_stride;
    Vec acc[LANES];
    for (int t = 0; t < LANES; t++) acc[t] = vec_zero();
#if defined(__AVX512BF16__)
    if (p->dtype == DTYPE_BF16) {
        const uint16_t *q = (const uint16_t *)q_raw;
        for (int i = 0; i < d; i += 32) {
            __m512bh q_pairs = (__m512bh)_mm512_loadu_si512(q + i);
#pragma GCC unroll 16
            for (int t = 0; t < LANES; t++)
                acc[t] = _mm512_dpbf16_ps(acc[t], q_pairs, (__m512bh)_mm512_loadu_si512((const uint16_t *)row[t] + i));
        }
        vec_store_first(scores, vec_mul(vec_set1(p->scale), vec_sum_lanes(acc)), n);
        return;
    }
#endif
    (void)q_raw;
    for (int i = 0; i < d; i += LANES) {
        Vec q_part = vec_load(q_scaled + i);
#pragma GCC unroll 16
        for (int t = 0; t < LANES; t++) acc[t] = vec_fma(q_part, vec_load_row(row[t], i, p->dtype == DTYPE_BF16), acc[t]);
    }
    vec_store_first(scores, vec_sum_lanes(acc), n);
}

/* acc_r += sum_t weights[r][t] * v_t over output elements i0 .. i0 + LANES * tile of the `count`
 * query rows from head0: tile * count accumulators stay in registers across the rows (a
 * compile-time tile and count: a runtime-sized accumulator array would live in memory, and
 * every row would wait on a store and a load). */
static inline __attribute__((always_inline)) void accumulate_tile(const Problem *p, const char *first,
                                                                  int64_t row_stride, int n, const float *weights,
                                                                  int i0, int head0, Scratch *s, const int tile,
                                                                  const int count) {
    int d = p->head_dim, is_bf16 = p->dtype == DTYPE_BF16;
    Vec acc[4][MAX_VECTOR_GROUP];
    for (int a = 0; a < tile; a++)
        for (int g = 0; g < count; g++) acc[a][g] = vec_load(s->acc + (size_t)(head0 + g) * d + i0 + LANES * a);
    for (int t = 0; t < n; t++) {
        const char *row = first + t * row_stride;
        for (int a = 0; a < tile; a++) {
            Vec v = vec_load_row(row, i0 + LANES * a, is_bf16);
            for (int g = 0; g < count; g++)
                acc[a][g] = vec_fma(vec_set1(weights[(head0 + g) * CHUNK_TOKENS + t]), v, acc[a][g]);
        }
    }
    for (int a = 0; a < tile; a++)
        for (int g = 0; g < count; g++) vec_store(s->acc + (size_t)(head0 + g) * d + i0 + LANES * a, acc[a][g]);
}

/* The register tile for `count` rows of width d: four LANES-wide pieces of up to 3 rows, two of
 * up to 6, one of up to 8 (12 or fewer accumulators, in AVX2's 16 registers too). */
static inline int tile_for(int count, int d) { return count <= 3 && d % (4 * LANES) == 0 ? 4 : count <= 6 ? 2 : 1; }

/* Runs CASE(tile, count) for the compile-time pair equal to (tile, count). */
#define TILE_SWITCH(CASE, tile, count) \
    switch ((tile) * 16 + (count)) { \
        CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4) CASE(2, 5) CASE(2, 6) \
        CASE(1, 7) CASE(1, 8) \
    }

#define TILE_CASE(tile, count) \
    case (tile) * 16 + (count): \
        for (int i0 = 0; i0 < d; i0 += LANES * (tile)) \
            accumulate_tile(p, first, row_stride, n, weights, i0, head0, s, tile, count); \
        break;

/* acc_r += sum_t weights[r][t] * v_t for query rows r in [row0, row0 + num_rows) of the
 * scratch (weights[r][t] at weights[r * CHUNK_TOKENS + t]), all reading the same kv head:
 * `first` is its first V row, rows are `row_stride` bytes apart (register tiles: tile_for). */
static void accumulate_heads(const Problem *p, const char *first, int64_t row_stride, int n, const float *weights,
                             int row0, int num_rows, Scratch *s) {
    int d = p->head_dim;
    for (int head0 = row0; head0 < row0 + num_rows; head0 += MAX_VECTOR_GROUP) {
        int count = row0 + num_rows - head0 < MAX_VECTOR_GROUP ? row0 + num_rows - head0 : MAX_VECTOR_GROUP;
        TILE_SWITCH(TILE_CASE, tile_for(count, d), count)
    }
}

#if defined(__AVX512BF16__)
/* The bf16 V rows of a chunk (one kv head), interleaved by pairs of keys into s->converted: for
 * key pair k and element i, (v[2k][i], v[2k+1][i]) at pairs[k * 2d + 2i], a zero row after an
 * odd last key. The bf16 dot instruction then adds both keys' products into one fp32 lane. */
static void pack_value_pairs(const Problem *p, const Segment *segments, int num_segments, int64_t head_offset,
                             int64_t row_stride, Scratch *s) {
    int d = p->head_dim;
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    const uint16_t *rows[CHUNK_TOKENS + 1];
    int n = 0;
    for (int i = 0; i < num_segments; i++)
        for (int t = 0; t < segments[i].length; t++)
            rows[n++] = (const uint16_t *)(segments[i].values + head_offset + t * row_stride);
    uint16_t *pairs = (uint16_t *)s->converted;
    for (int k = 0; 2 * k < n; k++) {
        const uint16_t *first = rows[2 * k], *second = 2 * k + 1 < n ? rows[2 * k + 1] : NULL;
        for (int i = 0; i < d; i += 32) {
            __m512i x = _mm512_loadu_si512(first + i);
            __m512i y = second ? _mm512_loadu_si512(second + i) : _mm512_setzero_si512();
            _mm512_storeu_si512(pairs + (size_t)k * 2 * d + 2 * i, _mm512_permutex2var_epi16(x, low, y));
            _mm512_storeu_si512(pairs + (size_t)k * 2 * d + 2 * i + 32, _mm512_permutex2var_epi16(x, high, y));
        }
    }
}

/* Rows r in [row0, row0 + num_rows): their n chunk weights as bf16 pairs (0 past n). */
static void pack_weight_pairs(int row0, int num_rows, int n, Scratch *s) {
    for (int r = row0; r < row0 + num_rows; r++)
        for (int t = 0; t < n; t += 32) {
            __mmask16 first = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
            __mmask16 second = n - t >= 32 ? 0xFFFF : n - t <= 16 ? 0 : (__mmask16)((1u << (n - t - 16)) - 1);
            __m512 a = _mm512_maskz_loadu_ps(first, s->scores + r * CHUNK_TOKENS + t);
            __m512 b = _mm512_maskz_loadu_ps(second, s->scores + r * CHUNK_TOKENS + t + 16);
            _mm512_storeu_si512(s->weight_pairs + r * (CHUNK_TOKENS / 2) + t / 2, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
}

/* acc_r += sum_t weights[r][t] * v_t over output elements i0 .. i0 + 16 * tile of `count` rows
 * from row0, on the packed pairs (two keys per bf16 dot instruction). */
static inline __attribute__((always_inline)) void accumulate_pairs_tile(const Problem *p, int num_pairs, int i0,
                                                                        int row0, Scratch *s, const int tile,
                                                                        const int count) {
    int d = p->head_dim;
    const uint16_t *pairs = (const uint16_t *)s->converted;
    __m512 acc[4][MAX_VECTOR_GROUP];
    for (int a = 0; a < tile; a++)
        for (int g = 0; g < count; g++) acc[a][g] = _mm512_loadu_ps(s->acc + (size_t)(row0 + g) * d + i0 + 16 * a);
    for (int k = 0; k < num_pairs; k++)
        for (int a = 0; a < tile; a++) {
            __m512bh v = (__m512bh)_mm512_loadu_si512(pairs + (size_t)k * 2 * d + 2 * (i0 + 16 * a));
            for (int g = 0; g < count; g++) {
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)s->weight_pairs[(row0 + g) * (CHUNK_TOKENS / 2) + k]);
                acc[a][g] = _mm512_dpbf16_ps(acc[a][g], v, w);
            }
        }
    for (int a = 0; a < tile; a++)
        for (int g = 0; g < count; g++) _mm512_storeu_ps(s->acc + (size_t)(row0 + g) * d + i0 + 16 * a, acc[a][g]);
}

#define PAIRS_CASE(tile, count) \
    case (tile) * 16 + (count): \
        for (int i0 = 0; i0 < d; i0 += 16 * (tile)) accumulate_pairs_tile(p, num_pairs, i0, head0, s, tile, count); \
        break;

/* The bf16 form of accumulate_heads over a whole chunk of n keys: V rows packed by pairs once
 * for all `num_rows` rows, weights rounded to bf16 (as SDPA rounds them for its bf16 product). */
static void accumulate_chunk_bf16(const Problem *p, const Segment *segments, int num_segments, int64_t head_offset,
                                  int64_t row_stride, int n, int row0, int num_rows, Scratch *s) {
    int d = p->head_dim, num_pairs = (n + 1) / 2;
    pack_value_pairs(p, segments, num_segments, head_offset, row_stride, s);
    pack_weight_pairs(row0, num_rows, n, s);
    for (int head0 = row0; head0 < row0 + num_rows; head0 += MAX_VECTOR_GROUP) {
        int count = row0 + num_rows - head0 < MAX_VECTOR_GROUP ? row0 + num_rows - head0 : MAX_VECTOR_GROUP;
        TILE_SWITCH(PAIRS_CASE, tile_for(count, d), count)
    }
}
#endif

/* Plan the first chunk sequence `seq` attends (from its prefix state's end). */
static void plan_first_chunk(const Problem *p, int seq, Ahead *ahead) {
    int context_len = p->context_lens[seq], start = p->prefix_lens ? p->prefix_lens[seq] : 0;
    if (context_len < 1 || context_len > (int64_t)p->max_blocks * p->block_size) return;
    if (window_start(p, context_len - 1) > start) start = window_start(p, context_len - 1);
    plan_ahead(p, p->block_tables + (int64_t)seq * p->max_blocks, start,
               context_len - start < CHUNK_TOKENS ? context_len : start + CHUNK_TOKENS, ahead);
}

/* One sequence, every kv head, CHUNK_TOKENS tokens at a time (runs of whole blocks, each
 * block's rows of all heads one contiguous run of the pool), from its prefix state when it has
 * one (p->prefix_lens). While its last chunk is computed, the first chunk of `next_seq` (the
 * sequence this thread attends next; -1 for none) is asked for: with short contexts that chunk
 * is much of a sequence's K/V (cold caches, 2 threads, 2-core AMD EPYC family 25 / model 17,
 * bf16: 32 sequences of 32-288 tokens 270-295 against 321-327 us, 64 of 100-512 724-796
 * against 812-900, 32 of 1024 1191-1361 against 1296-1416). Built for AVX2 (8 lanes), the same
 * CPU, caches flushed, against the portable attend_seq: 32 of 1024 2.76 against 3.58 ms in float32,
 * 1.27 against 3.81 in bf16 (its rows converted to float32 as they are loaded). */
static int attend_seq_vector(const Problem *p, int seq, int next_seq, Scratch *s) {
    int d = p->head_dim, bs = p->block_size, num_heads = p->num_heads;
    int context_len = p->context_lens[seq];
    if (context_len < 1 || context_len > (int64_t)p->max_blocks * bs) return STATUS_BAD_CONTEXT_LEN;
    const int32_t *table = p->block_tables + (int64_t)seq * p->max_blocks;
    int prefix = load_prefix_state(p, seq, s), start = window_start(p, context_len - 1);
    int64_t row_stride = (int64_t)p->num_kv_heads * d * element_size(p->dtype);
    int group = num_heads / p->num_kv_heads;
    Segment segments[CHUNK_TOKENS];
    Ahead ahead;
    plan_first_chunk(p, seq, &ahead);
    fetch_ahead(&ahead, ahead.lines_left);
    for (int pos = prefix > start ? prefix : start; pos < context_len;) {
        int n = 0, num_segments = next_chunk(p, table, &pos, context_len, segments, &n, &ahead);
        if (num_segments < 0) return STATUS_BAD_BLOCK_ID;
        if (pos >= context_len && next_seq >= 0) plan_first_chunk(p, next_seq, &ahead);
        for (int i = 0; i < num_segments; i++) {
            const Segment *segment = &segments[i];
            for (int h = 0; h < num_heads; h++) {
                fetch_ahead(&ahead, SCORE_FETCH_LINES);
                const char *k = segment->keys + (int64_t)(h / group) * d * element_size(p->dtype);
                for (int t0 = 0; t0 < segment->length; t0 += LANES)
                    score_rows(p, query_row(p, seq, h), s->q + (size_t)h * d, k + t0 * row_stride, row_stride,
                               segment->length - t0 < LANES ? segment->length - t0 : LANES,
                               s->scores + h * CHUNK_TOKENS + segment->start + t0);
            }
        }
        for (int h = 0; h < num_heads; h++) cap_scores(p, s->scores + h * CHUNK_TOKENS, n, 1.0f);
        update_softmax(d, num_heads, n, s);
        for (int kv_head = 0; kv_head < p->num_kv_heads; kv_head++) {
            fetch_ahead(&ahead, ahead.lines_left / (p->num_kv_heads - kv_head));
            int64_t head_offset = (int64_t)kv_head * d * element_size(p->dtype);
#if defined(__AVX512BF16__)
            if (p->dtype == DTYPE_BF16) {
                accumulate_chunk_bf16(p, segments, num_segments, head_offset, row_stride, n, kv_head * group, group, s);
                continue;
            }
#endif
            for (int i = 0; i < num_segments; i++)
                accumulate_heads(p, segments[i].values + head_offset, row_stride, segments[i].length,
                                 s->scores + segments[i].start, kv_head * group, group, s);
        }
    }
    size_t row_bytes = (size_t)d * element_size(p->dtype);
    for (int h = 0; h < num_heads; h++)
        store_row((char *)p->out + ((int64_t)seq * num_heads + h) * row_bytes, s->acc + (size_t)h * d, 1.0f / s->sum[h],
                  d, p->dtype);
    return STATUS_OK;
}

/*
 * The prefill kernel keeps a tile's rows in columns (key-major): with `stride` rows (the tile's
 * rows rounded up to 16, a multiple of LANES), s->q holds Q transposed ([d / 2][stride] bf16
 * pairs (q[2i], q[2i+1]) where the bf16 dot instruction runs, else [d][stride] pre-scaled
 * float32), s->scores
 * [CHUNK_TOKENS][stride] the chunk's scores (in log2 units: q.k * scale * log2(e), so the
 * softmax's exponentials are powers of 2, see exp2_vec) and then weights, s->weight_pairs
 * [CHUNK_TOKENS / 2][stride]. A key's scores for LANES rows are then one vector: its K elements are
 * broadcast from the pool as they lie (no transpose, no horizontal sums), and the softmax's max
 * and sums run down the columns.
 */

/* 1 where bf16 scores and weights go through the bf16 dot instruction. */
static inline int uses_bf16_dot(const Problem *p) {
#if defined(__AVX512BF16__)
    return p->dtype == DTYPE_BF16;
#else
    (void)p;
    return 0;
#endif
}

/* Rows r < num_rows of a prefill tile (query token first_row + r / group, head kv_head * group +
 * r % group) into s->q, transposed; columns num_rows .. stride are zero. */
static void load_queries_transposed(const Problem *p, int64_t first_row, int kv_head, int num_rows, int stride,
                                    Scratch *s) {
    int d = p->head_dim, group = p->num_heads / p->num_kv_heads;
    memset(s->q, 0, sizeof(float) * (size_t)d * stride);
    for (int r = 0; r < num_rows; r++) {
        const void *q = query_row(p, first_row + r / group, kv_head * group + r % group);
        if (uses_bf16_dot(p)) {
            uint32_t *restrict pairs = (uint32_t *)s->q; /* restrict: s->q is not reloaded for every pair */
            for (int i = 0; i < d / 2; i++) pairs[(size_t)i * stride + r] = ((const uint32_t *)q)[i];
        } else {
            const float *row = as_float(q, s->row, d, p->dtype);
            for (int i = 0; i < d; i++) s->q[(size_t)i * stride + r] = row[i] * (p->scale * LOG2E);
        }
    }
}

/* scores[u * stride + c] for `keys` consecutive keys u (from `k`, rows `row_stride` bytes apart)
 * and the columns of row vectors 0 .. vecs of `q` (s->q from a vector): keys * vecs accumulators
 * in registers, each K element (a bf16 pair or a float) broadcast once for every row vector,
 * each Q^T vector loaded once for every key. */
static inline __attribute__((always_inline)) void score_columns_tile(const Problem *p, const float *q, const char *k,
                                                                     int64_t row_stride, int stride, float *scores,
                                                                     const int keys, const int vecs) {
    Vec acc[SCORE_KEYS][3];
    for (int u = 0; u < keys; u++)
        for (int j = 0; j < vecs; j++) acc[u][j] = vec_zero();
#if defined(__AVX512BF16__)
    if (p->dtype == DTYPE_BF16) {
        for (int i = 0; i < p->head_dim / 2; i++) {
            __m512bh qv[3];
            for (int j = 0; j < vecs; j++) qv[j] = (__m512bh)_mm512_loadu_ps(q + (size_t)i * stride + LANES * j);
            for (int u = 0; u < keys; u++) {
                __m512bh kb = (__m512bh)_mm512_set1_epi32(((const int32_t *)(k + u * row_stride))[i]);
                for (int j = 0; j < vecs; j++) acc[u][j] = _mm512_dpbf16_ps(acc[u][j], qv[j], kb);
            }
        }
        for (int u = 0; u < keys; u++)
            for (int j = 0; j < vecs; j++)
                vec_store(scores + (size_t)u * stride + LANES * j, vec_mul(vec_set1(p->scale * LOG2E), acc[u][j]));
        return;
    }
#endif
    for (int i = 0; i < p->head_dim; i++) {
        Vec qv[3];
        for (int j = 0; j < vecs; j++) qv[j] = vec_load(q + (size_t)i * stride + LANES * j);
        for (int u = 0; u < keys; u++) {
            const char *row = k + u * row_stride;
            Vec kb = vec_set1(p->dtype == DTYPE_BF16 ? bf16_to_float(((const uint16_t *)row)[i])
                                                     : ((const float *)row)[i]);
            for (int j = 0; j < vecs; j++) acc[u][j] = vec_fma(qv[j], kb, acc[u][j]);
        }
    }
    for (int u = 0; u < keys; u++)
        for (int j = 0; j < vecs; j++) vec_store(scores + (size_t)u * stride + LANES * j, acc[u][j]);
}

#define SCORE_COLUMNS_CASE(keys, vecs) \
    case (keys) * 4 + (vecs): score_columns_tile(p, q, k_rows, row_stride, stride, scores, keys, vecs); break;

/* Key-major scores of a run of n keys (from `k`) for row vectors 0 .. num_vecs of s->q, into
 * key_scores, SCORE_KEYS keys x 3 row vectors at a time (with AVX-512, 8 x 3: 24 accumulators,
 * up to 30% faster than 4 x 3). */
static void score_columns(const Problem *p, const char *k, int64_t row_stride, int n, int num_vecs, int stride,
                          const Scratch *s, float *key_scores) {
    for (int t0 = 0; t0 < n; t0 += SCORE_KEYS)
        for (int vec0 = 0; vec0 < num_vecs; vec0 += 3) {
            int keys = n - t0 < SCORE_KEYS ? n - t0 : SCORE_KEYS, vecs = num_vecs - vec0 < 3 ? num_vecs - vec0 : 3;
            const float *q = s->q + LANES * vec0;
            const char *k_rows = k + t0 * row_stride;
            float *scores = key_scores + (size_t)t0 * stride + LANES * vec0;
            switch (keys * 4 + vecs) {
                SCORE_COLUMNS_CASE(1, 1) SCORE_COLUMNS_CASE(1, 2) SCORE_COLUMNS_CASE(1, 3)
                SCORE_COLUMNS_CASE(2, 1) SCORE_COLUMNS_CASE(2, 2) SCORE_COLUMNS_CASE(2, 3)
                SCORE_COLUMNS_CASE(3, 1) SCORE_COLUMNS_CASE(3, 2) SCORE_COLUMNS_CASE(3, 3)
                SCORE_COLUMNS_CASE(4, 1) SCORE_COLUMNS_CASE(4, 2) SCORE_COLUMNS_CASE(4, 3)
#if SCORE_KEYS == 8
                SCORE_COLUMNS_CASE(5, 1) SCORE_COLUMNS_CASE(5, 2) SCORE_COLUMNS_CASE(5, 3)
                SCORE_COLUMNS_CASE(6, 1) SCORE_COLUMNS_CASE(6, 2) SCORE_COLUMNS_CASE(6, 3)
                SCORE_COLUMNS_CASE(7, 1) SCORE_COLUMNS_CASE(7, 2) SCORE_COLUMNS_CASE(7, 3)
                SCORE_COLUMNS_CASE(8, 1) SCORE_COLUMNS_CASE(8, 2) SCORE_COLUMNS_CASE(8, 3)
#endif
            }
        }
}

/* Key positions after a row's own token get no weight: key chunk_pos + t is masked for rows
 * r < (chunk_pos + t - first_pos) * group (row r is the token at first_pos + r / group). */
static void mask_future_keys(int chunk_pos, int n, int first_pos, int group, int num_rows, int stride, Scratch *s) {
    for (int t = 0; t < n; t++) {
        int masked = (chunk_pos + t - first_pos) * group;
        masked = masked < 0 ? 0 : masked > num_rows ? num_rows : masked;
        for (int r = 0; r < masked; r++) s->scores[(size_t)t * stride + r] = -INFINITY;
    }
}

/* Key positions before a row's window get no weight: key chunk_pos + t is masked for rows
 * r >= (chunk_pos + t + window - first_pos) * group (row r is the token at first_pos + r / group). */
static void mask_old_keys(const Problem *p, int chunk_pos, int n, int first_pos, int group, int num_rows, int stride,
                          Scratch *s) {
    for (int t = 0; t < n; t++) {
        int first_masked = (chunk_pos + t + p->window - first_pos) * group;
        first_masked = first_masked < 0 ? 0 : first_masked;
        for (int r = first_masked; r < num_rows; r++) s->scores[(size_t)t * stride + r] = -INFINITY;
    }
}

/* 2^x for LANES floats x <= 0 (0 below EXP2_FLOOR, on AVX2 below EXP2_FLOOR + 1/2: what is lost
 * there is under 2^-126, against a softmax sum of at least 1; -inf included): x = n + f with n an
 * integer and |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error < 1.3e-7), times
 * 2^n exactly. NaN stays NaN. */
static inline Vec exp2_vec(Vec x) {
    x = vec_max(vec_set1(EXP2_FLOOR), x); /* a NaN x is returned as it is */
    Vec n = vec_round(x);
    Vec f = vec_sub(x, n);
    Vec poly = vec_set1(1.5403530393381606e-4f);
    poly = vec_fma(poly, f, vec_set1(1.3333558146428441e-3f));
    poly = vec_fma(poly, f, vec_set1(9.618129107628477e-3f));
    poly = vec_fma(poly, f, vec_set1(5.5504108664821576e-2f));
    poly = vec_fma(poly, f, vec_set1(2.402265069591007e-1f));
    poly = vec_fma(poly, f, vec_set1(6.931471805599453e-1f));
    poly = vec_fma(poly, f, vec_set1(1.0f));
    return vec_times_pow2(poly, n);
}

#if defined(__AVX512BF16__)
/* Two keys' weights for 16 rows as bf16 pairs (w0[r], w1[r]), in row order. */
static inline __m512i weight_pairs16(__m512 w0, __m512 w1) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)); /* w0's 16, then w1's */
}
#endif

/* update_softmax over key-major scores (log2 units) of n keys, for row vectors 0 .. num_vecs:
 * per vector of LANES rows, the new running max, the rescale of the sum, the accumulator's factor
 * (into s->correction, for accumulate_columns to apply as it adds the chunk), and the weights 2^(score - max): as bf16 pairs into s->weight_pairs (key pair k at k * stride, 0 for
 * the second of an odd last key) when `as_pairs`, else over the scores. A row whose keys so far
 * are all masked (by a window) keeps a max of -inf: its weights and correction are then taken
 * against 0 (all 0) rather than against -inf (NaN). Padding rows get weights too, and are never
 * stored. */
static void softmax_columns(int num_vecs, int stride, int n, int as_pairs, Scratch *s) {
#if !defined(__AVX512BF16__)
    (void)as_pairs; /* pairs come only from the bf16 dot path */
#endif
    for (int j = 0; j < num_vecs; j++) {
        float *scores = s->scores + LANES * j;
        Vec old_max = vec_load(s->max + LANES * j), max = old_max;
        for (int t = 0; t < n; t++) max = vec_max(max, vec_load(scores + (size_t)t * stride));
        Vec base = vec_zero_if_minus_inf(max);
        Vec correction = exp2_vec(vec_sub(old_max, base));
        Vec sum = vec_mul(vec_load(s->sum + LANES * j), correction);
        for (int t = 0; t < n; t += 2) {
            Vec first = exp2_vec(vec_sub(vec_load(scores + (size_t)t * stride), base));
            Vec second = t + 1 < n ? exp2_vec(vec_sub(vec_load(scores + (size_t)(t + 1) * stride), base)) : vec_zero();
            sum = vec_add(vec_add(sum, first), second); /* key order, as one key at a time */
#if defined(__AVX512BF16__)
            if (as_pairs) {
                _mm512_storeu_si512(s->weight_pairs + (size_t)(t / 2) * stride + LANES * j, weight_pairs16(first, second));
                continue;
            }
#endif
            vec_store(scores + (size_t)t * stride, first);
            if (t + 1 < n) vec_store(scores + (size_t)(t + 1) * stride, second);
        }
        vec_store(s->max + LANES * j, max);
        vec_store(s->sum + LANES * j, sum);
        vec_store(s->correction + LANES * j, correction);
    }
}

/* acc^T[e][c] = acc^T[e][c] * correction[c] (when given) + sum_k w[k][c] * v_k[e], for elements
 * e0 .. e0 + elems (compile time) and the columns of row vectors 0 .. vecs: `w` the key-major
 * weights (or bf16 weight pairs) from the first row vector, `correction` from its first row,
 * `v` the first V row (or V key pair) at element e0, rows `v_stride` bytes apart. Per key, each
 * V element (or pair) is broadcast once, then each weight vector loaded once, right before its
 * `elems` products: loaded first and held across the elements instead, gcc loaded every weight
 * vector again for each element (12 loads per 12 products, load-bound; a 2,048-token bf16
 * prefill's attention took 1.20-1.33x as long, interleaved A/B). */
static inline __attribute__((always_inline)) void accumulate_columns_tile(const Problem *p, const float *w,
                                                                          const char *v, int64_t v_stride,
                                                                          int num_keys, int stride, float *acc,
                                                                          const float *correction, const int elems,
                                                                          const int vecs) {
    Vec sums[4][3];
    for (int x = 0; x < elems; x++)
        for (int j = 0; j < vecs; j++) {
            sums[x][j] = vec_load(acc + (size_t)x * stride + LANES * j);
            if (correction) sums[x][j] = vec_mul(sums[x][j], vec_load(correction + LANES * j));
        }
#if defined(__AVX512BF16__)
    if (p->dtype == DTYPE_BF16) {
        for (int k = 0; k < num_keys; k++) {
            __m512bh vb[4];
            for (int x = 0; x < elems; x++) vb[x] = (__m512bh)_mm512_set1_epi32(((const int32_t *)(v + k * v_stride))[x]);
            for (int j = 0; j < vecs; j++) {
                __m512bh wv = (__m512bh)_mm512_loadu_ps(w + (size_t)k * stride + LANES * j);
                for (int x = 0; x < elems; x++) sums[x][j] = _mm512_dpbf16_ps(sums[x][j], wv, vb[x]);
            }
        }
    } else
#endif
    {
        for (int k = 0; k < num_keys; k++) {
            const char *row = v + k * v_stride;
            Vec vb[4];
            for (int x = 0; x < elems; x++)
                vb[x] = vec_set1(p->dtype == DTYPE_BF16 ? bf16_to_float(((const uint16_t *)row)[x])
                                                        : ((const float *)row)[x]);
            for (int j = 0; j < vecs; j++) {
                Vec wv = vec_load(w + (size_t)k * stride + LANES * j);
                for (int x = 0; x < elems; x++) sums[x][j] = vec_fma(wv, vb[x], sums[x][j]);
            }
        }
    }
    for (int x = 0; x < elems; x++)
        for (int j = 0; j < vecs; j++) vec_store(acc + (size_t)x * stride + LANES * j, sums[x][j]);
}

#define ACCUMULATE_COLUMNS_CASE(vecs) \
    case vecs: \
        accumulate_columns_tile(p, w, v + e0 * element_bytes, v_stride, num_keys, stride, acc, factors, 4, vecs); \
        break;

/* acc^T = acc^T * correction (per row, when given) + the weights' products with num_keys V rows
 * (or pairs) from `v` (element 0), for row vectors 0 .. num_vecs: 4 elements x 3 row vectors at
 * a time (with AVX2 too: 17 of its 16 registers, yet 2-5% faster than 4 x 2 over a 2,048-token
 * float32 prefill). `element_bytes` is the size of one V element (or pair) in `v`. */
static void accumulate_columns(const Problem *p, const float *weights, const char *v, int64_t v_stride,
                               int element_bytes, int num_keys, int num_vecs, int stride, const float *correction,
                               Scratch *s) {
    for (int e0 = 0; e0 < p->head_dim; e0 += 4)
        for (int vec0 = 0; vec0 < num_vecs; vec0 += 3) {
            const float *w = weights + LANES * vec0;
            float *acc = s->acc + (size_t)e0 * stride + LANES * vec0;
            const float *factors = correction ? correction + LANES * vec0 : NULL;
            switch (num_vecs - vec0 < 3 ? num_vecs - vec0 : 3) {
                ACCUMULATE_COLUMNS_CASE(1) ACCUMULATE_COLUMNS_CASE(2) ACCUMULATE_COLUMNS_CASE(3)
            }
        }
}

/* Attention of a column tile: num_tokens consecutive packed q rows from first_row (a prefill
 * chunk's tokens, or the member sequences of a shared prefix), each with the query heads of
 * `kv_head`, over keys [key_start, key_end) of `table`; row token i sees keys up to position
 * first_pos + i (and from its window's first, with a window). Leaves each row's softmax state in the scratch (column r: token r / group,
 * head kv_head * group + r % group; s->acc is acc^T, [d][stride]).
 * `fetches_ahead`: ask for each next chunk while one is computed (a column tile's chunk is long
 * work, so its misses overlap it) where the keys come from memory, as a shared prefix's do. A
 * prefill tile's keys are mostly in cache (its chunk's own just written, the rest read by the
 * tiles before it), and asking again cost more than it saved: one 2048-token sequence bf16 took
 * 8.9 against 9.8 ms without. */
static int attend_columns(const Problem *p, const int32_t *table, int key_start, int key_end, int64_t first_row,
                          int num_tokens, int first_pos, int kv_head, int fetches_ahead, Scratch *s) {
    int d = p->head_dim, group = p->num_heads / p->num_kv_heads;
    int num_rows = num_tokens * group, stride = PREFILL_TILE * group, num_vecs = (num_rows + LANES - 1) / LANES;
    reset_state(d, stride, s);
    for (int r = 0; r < stride; r++) start_state(p, kv_head * group + r % group, LOG2E, &s->max[r], &s->sum[r]);
    load_queries_transposed(p, first_row, kv_head, num_rows, stride, s);
    int element_bytes = (int)element_size(p->dtype);
    int64_t row_stride = (int64_t)p->num_kv_heads * d * element_bytes, head_offset = (int64_t)kv_head * d * element_bytes;
    Segment segments[CHUNK_TOKENS];
    Ahead ahead;
    for (int pos = key_start; pos < key_end;) {
        int chunk_pos = pos, n = 0;
        int num_segments = next_chunk(p, table, &pos, key_end, segments, &n, &ahead);
        if (num_segments < 0) return STATUS_BAD_BLOCK_ID;
        if (fetches_ahead) fetch_ahead(&ahead, ahead.lines_left);
        for (int i = 0; i < num_segments; i++)
            score_columns(p, segments[i].keys + head_offset, row_stride, segments[i].length, num_vecs, stride, s,
                          s->scores + (size_t)segments[i].start * stride);
        cap_scores(p, s->scores, n * stride, LOG2E);
        mask_future_keys(chunk_pos, n, first_pos, group, num_rows, stride, s);
        if (p->window > 0) mask_old_keys(p, chunk_pos, n, first_pos, group, num_rows, stride, s);
        softmax_columns(num_vecs, stride, n, uses_bf16_dot(p), s);
#if defined(__AVX512BF16__)
        if (p->dtype == DTYPE_BF16) {
            pack_value_pairs(p, segments, num_segments, head_offset, row_stride, s);
            accumulate_columns(p, (const float *)s->weight_pairs, (const char *)s->converted, 4 * d, 4, (n + 1) / 2,
                               num_vecs, stride, s->correction, s);
            continue;
        }
#endif
        for (int i = 0; i < num_segments; i++)
            accumulate_columns(p, s->scores + (size_t)segments[i].start * stride, segments[i].values + head_offset,
                               row_stride, element_bytes, segments[i].length, num_vecs, stride,
                               i == 0 ? s->correction : NULL, s);
    }
    return STATUS_OK;
}

/* Column r of acc^T (stride columns) into s->row. */
static const float *accumulator_row(int d, int stride, int r, Scratch *s) {
    for (int i = 0; i < d; i++) s->row[i] = s->acc[(size_t)i * stride + r];
    return s->row;
}

/* Causal prefill attention of one tile of a chunk: query tokens tile_start .. +16 of sequence
 * `seq` (packed rows query_start + ...), the query heads of `kv_head`, over every cached
 * position up to each token's own. */
static int attend_prefill_tile(const Problem *p, int seq, int query_start, int query_len, int tile_start, int kv_head,
                               Scratch *s) {
    int d = p->head_dim, group = p->num_heads / p->num_kv_heads;
    int context_len = p->context_lens[seq];
    if (query_len < 1 || query_len > context_len || context_len > (int64_t)p->max_blocks * p->block_size)
        return STATUS_BAD_CONTEXT_LEN;
    int num_tokens = query_len - tile_start < PREFILL_TILE ? query_len - tile_start : PREFILL_TILE;
    int first_pos = context_len - query_len + tile_start;
    int code = attend_columns(p, p->block_tables + (int64_t)seq * p->max_blocks, window_start(p, first_pos),
                              first_pos + num_tokens, query_start + tile_start, num_tokens, first_pos, kv_head, 0, s);
    if (code != STATUS_OK) return code;
    size_t row_bytes = (size_t)d * element_size(p->dtype);
    for (int r = 0; r < num_tokens * group; r++) {
        int64_t row = query_start + tile_start + r / group;
        store_row((char *)p->out + (row * p->num_heads + kv_head * group + r % group) * row_bytes,
                  accumulator_row(d, PREFILL_TILE * group, r, s), 1.0f / s->sum[r], d, p->dtype);
    }
    return STATUS_OK;
}

/* Cascade decode, first pass: the shared prefix [0, prefix) of decode sequences first .. first +
 * num_members (one tile of at most PREFILL_TILE of them), read once for all of them; each
 * member's softmax state over it into state ([num_seqs, num_heads, d + 2]). */
static int attend_shared_prefix(const Problem *p, int first, int num_members, int prefix, int kv_head, float *state,
                                Scratch *s) {
    int d = p->head_dim, group = p->num_heads / p->num_kv_heads;
    int code = attend_columns(p, p->block_tables + (int64_t)first * p->max_blocks, 0, prefix, first, num_members,
                              prefix - 1, kv_head, 1, s);
    if (code != STATUS_OK) return code;
    for (int r = 0; r < num_members * group; r++) {
        float *row_state = state + ((int64_t)(first + r / group) * p->num_heads + kv_head * group + r % group) * (d + 2);
        row_state[0] = s->max[r] * LN2, row_state[1] = s->sum[r]; /* the decode pass's max is in natural units */
        memcpy(row_state + 2, accumulator_row(d, PREFILL_TILE * group, r, s), sizeof(float) * d);
    }
    return STATUS_OK;
}
#else
static int is_vector_problem(const Problem *p) { (void)p; return 0; }
static int attend_seq_vector(const Problem *p, int seq, int next_seq, Scratch *s) {
    (void)p, (void)seq, (void)next_seq, (void)s;
    return STATUS_UNSUPPORTED;
}
static int attend_prefill_tile(const Problem *p, int seq, int query_start, int query_len, int tile_start, int kv_head,
                               Scratch *s) {
    (void)p, (void)seq, (void)query_start, (void)query_len, (void)tile_start, (void)kv_head, (void)s;
    return STATUS_UNSUPPORTED;
}
static int attend_shared_prefix(const Problem *p, int first, int num_members, int prefix, int kv_head, float *state,
                                Scratch *s) {
    (void)p, (void)first, (void)num_members, (void)prefix, (void)kv_head, (void)state, (void)s;
    return STATUS_UNSUPPORTED;
}
#endif

static float *alloc_scratch(Scratch *s, int num_queries, int d) {
    size_t floats = (size_t)num_queries * (2 * d + CHUNK_TOKENS + 3 + CHUNK_TOKENS / 2) + (size_t)(CHUNK_TOKENS + 1) * d;
    float *base = (float *)malloc(sizeof(float) * floats);
    if (base == NULL) return NULL;
    s->q = base;
    s->acc = s->q + (size_t)num_queries * d;
    s->scores = s->acc + (size_t)num_queries * d;
    s->max = s->scores + (size_t)num_queries * CHUNK_TOKENS;
    s->sum = s->max + num_queries;
    s->correction = s->sum + num_queries;
    s->row = s->correction + num_queries;
    s->converted = s->row + d;
    s->weight_pairs = (uint32_t *)(s->converted + (size_t)CHUNK_TOKENS * d);
    return base;
}

/* 1 when every group row (first, end, prefix_tokens) is valid: in order and disjoint, at least
 * 2 members, 0 < prefix < every member's context, and every member holding the first member's
 * blocks for the prefix. */
static int groups_are_valid(const Problem *p, const int32_t *groups, int num_groups) {
    int last_end = 0, bs = p->block_size;
    for (int g = 0; g < num_groups; g++) {
        int first = groups[3 * g], end = groups[3 * g + 1], prefix = groups[3 * g + 2];
        if (first < last_end ||
            !decode_group_holds(p->block_tables, p->context_lens, p->num_seqs, bs, p->max_blocks, first, end, prefix))
            return 0;
        for (int seq = first; seq < end; seq++)
            if (p->context_lens[seq] > (int64_t)p->max_blocks * bs) return 0;
        last_end = end;
    }
    return 1;
}

/* The cascade's first-pass work: (first member, members, prefix) per tile of at most
 * PREFILL_TILE members of a group, into tiles; marks every member's prefix_lens. Returns the
 * number of tiles. */
static int shared_prefix_tiles(const int32_t *groups, int num_groups, int32_t *tiles, int32_t *prefix_lens) {
    int num_tiles = 0;
    for (int g = 0; g < num_groups; g++) {
        int first = groups[3 * g], end = groups[3 * g + 1], prefix = groups[3 * g + 2];
        for (int start = first; start < end; start += PREFILL_TILE, num_tiles++) {
            tiles[3 * num_tiles] = start;
            tiles[3 * num_tiles + 1] = end - start < PREFILL_TILE ? end - start : PREFILL_TILE;
            tiles[3 * num_tiles + 2] = prefix;
        }
        for (int seq = first; seq < end; seq++) prefix_lens[seq] = prefix;
    }
    return num_tiles;
}

/* The next work item of a shared counter, for the thread that calls. */
static inline int claim_item(int *next_item) {
    int item;
#pragma omp atomic capture
    item = (*next_item)++;
    return item;
}

/* Decode entry point (attention_kernel.h). Returns a STATUS_* code; on STATUS_OK every element
 * of `out` has been written. Runs on `num_threads` OpenMP threads.
 *
 * `groups` (num_groups rows (first, end, prefix_tokens), see groups_are_valid): decode sequences
 * first .. end - 1 share their first prefix_tokens tokens. That prefix is attended once for all
 * members (cascade attention: a tile of up to PREFILL_TILE members, its K and V read once), then
 * each sequence continues from that state over its own tokens. The result is the same attention. */
int bg_paged_decode_attention(ATTENTION_KERNEL_PARAMS) {
    (void)query_starts, (void)query_lens; /* decode: query row s is sequence s's */
#ifndef __FLT16_MAX__
    if (dtype == DTYPE_F16) return STATUS_UNSUPPORTED;
#endif
    if (dtype < DTYPE_F32 || dtype > DTYPE_F16) return STATUS_UNSUPPORTED;
    Problem p = {out, q, k_cache, v_cache, block_tables, context_lens, num_seqs, num_heads,
                 num_kv_heads, head_dim, num_blocks, block_size, max_blocks, dtype, scale, NULL, NULL,
                 window, softcap, sinks};
    if (!groups_are_valid(&p, groups, num_groups)) return STATUS_BAD_GROUP;
    if (window > 0) num_groups = 0; /* no prefix lies in every member's window */
    int is_vector = is_vector_problem(&p), group = num_heads / num_kv_heads;
    int num_tiles = 0, status = STATUS_OK;
    int32_t *tiles = NULL, *prefix_lens = NULL;
    float *state = NULL;
    if (num_groups > 0) {
        tiles = (int32_t *)malloc(sizeof(int32_t) * 3 * (size_t)num_seqs);
        prefix_lens = (int32_t *)calloc((size_t)num_seqs, sizeof(int32_t));
        state = (float *)malloc(sizeof(float) * (size_t)num_seqs * num_heads * (head_dim + 2));
        if (tiles == NULL || prefix_lens == NULL || state == NULL) status = STATUS_NO_MEMORY;
        else num_tiles = shared_prefix_tiles(groups, num_groups, tiles, prefix_lens);
        p.prefix_lens = prefix_lens, p.state = state;
    }
    int64_t work = 0;
    for (int seq = 0; seq < num_seqs; seq++)
        work += (int64_t)context_lens[seq] * num_kv_heads;
    int scratch_rows = num_tiles > 0 && PREFILL_TILE * group > num_heads ? PREFILL_TILE * group : num_heads;
    int is_parallel = num_threads > 1 && num_seqs > 1 && work >= MIN_PARALLEL_WORK;
    int next_item = 0;
#pragma omp parallel num_threads(num_threads) if (is_parallel && status == STATUS_OK)
    {
        Scratch s = {0};
        float *base = status == STATUS_OK ? alloc_scratch(&s, scratch_rows, head_dim) : NULL;
        if (base == NULL) {
#pragma omp atomic write
            status = STATUS_NO_MEMORY;
        }
        /* First the shared prefixes: (tile, kv head) items. */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_tiles * num_kv_heads; item++) {
            const int32_t *tile = tiles + 3 * (item / num_kv_heads);
            int code = !base ? STATUS_OK
                       : is_vector ? attend_shared_prefix(&p, tile[0], tile[1], tile[2], item % num_kv_heads, state, &s)
                                   : attend_prefix_rows(&p, tile[0], tile[1], tile[2], item % num_kv_heads, state, &s);
            if (code != STATUS_OK) {
#pragma omp atomic write
                status = code;
            }
        }
        /* Then the sequences, claimed in order; a thread claims its next one as it starts one (so
         * that the vector path can ask for that sequence's first K/V early), except among the last,
         * where a claimed sequence would wait while another thread had none. */
        int team = omp_get_num_threads();
        for (int item = claim_item(&next_item), upcoming; item < num_seqs; item = upcoming) {
            int unclaimed;
#pragma omp atomic read
            unclaimed = next_item;
            int is_ahead = unclaimed < num_seqs - team;
            upcoming = is_ahead ? claim_item(&next_item) : -1;
            int code = STATUS_OK;
            if (base && is_vector) code = attend_seq_vector(&p, item, upcoming < num_seqs ? upcoming : -1, &s);
            else if (base) code = attend_seq(&p, item, &s);
            if (code != STATUS_OK) {
#pragma omp atomic write
                status = code;
            }
            if (!is_ahead) upcoming = claim_item(&next_item);
        }
        free(base);
    }
    free(tiles), free(prefix_lens), free(state);
    return status;
}

/* 1 when bg_paged_prefill_attention runs `dtype` with `head_dim` here (its column code). */
int bg_prefill_supported(int dtype, int head_dim) {
    Problem p = {0};
    p.dtype = dtype, p.head_dim = head_dim;
    return is_vector_problem(&p);
}

/* Causal attention of prefill chunks over the paged pool, whose K/V already hold the chunks'
 * own tokens. Sequence s's query tokens are packed rows query_starts[s] .. + query_lens[s] of
 * q and out ([rows, num_heads, head_dim]); they are the last query_lens[s] of its
 * context_lens[s] positions. Work items are (sequence, tile of PREFILL_TILE tokens, kv head). */
int bg_paged_prefill_attention(ATTENTION_KERNEL_PARAMS) {
    (void)groups, (void)num_groups; /* each chunk attends its whole context itself */
    Problem p = {out, q, k_cache, v_cache, block_tables, context_lens, num_seqs, num_heads,
                 num_kv_heads, head_dim, num_blocks, block_size, max_blocks, dtype, scale, NULL, NULL,
                 window, softcap, sinks};
    if (!is_vector_problem(&p)) return STATUS_UNSUPPORTED;
    int num_tiles = 0;
    for (int seq = 0; seq < num_seqs; seq++) {
        if (query_lens[seq] < 1) return STATUS_BAD_CONTEXT_LEN;
        num_tiles += (query_lens[seq] + PREFILL_TILE - 1) / PREFILL_TILE;
    }
    int32_t *tiles = (int32_t *)malloc(sizeof(int32_t) * 2 * (size_t)num_tiles); /* (sequence, first token) */
    if (tiles == NULL) return STATUS_NO_MEMORY;
    for (int seq = 0, tile = 0; seq < num_seqs; seq++)
        for (int start = 0; start < query_lens[seq]; start += PREFILL_TILE, tile++)
            tiles[2 * tile] = seq, tiles[2 * tile + 1] = start;
    int status = STATUS_OK;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_tiles * num_kv_heads > 1)
    {
        Scratch s = {0};
        float *base = alloc_scratch(&s, PREFILL_TILE * (num_heads / num_kv_heads), head_dim);
        if (base == NULL) {
#pragma omp atomic write
            status = STATUS_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_tiles * num_kv_heads; item++) {
            int tile = item / num_kv_heads, seq = tiles[2 * tile];
            int code = base ? attend_prefill_tile(&p, seq, query_starts[seq], query_lens[seq], tiles[2 * tile + 1],
                                                  item % num_kv_heads, &s)
                            : STATUS_OK;
            if (code != STATUS_OK) {
#pragma omp atomic write
                status = code;
            }
        }
        free(base);
    }
    free(tiles);
    return status;
}

/* 1 where this build's CPU has AMX-BF16: there torch's flash attention, whose products run on
 * AMX tiles, is the faster bf16 prefill (cpu_attention.prefill_is_preferred). */
int bg_has_amx_bf16(void) {
#if defined(__AMX_BF16__)
    return 1;
#else
    return 0;
#endif
}
