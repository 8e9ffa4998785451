/*
 * Decode attention over an int8 K/V pool (`kv_cache_dtype: int8`, kv_int8.py), bfloat16 queries
 * and output, on a CPU with AVX-512, AVX512-VNNI and AVX512-BF16 (elsewhere every call is
 * STATUS_UNSUPPORTED).
 *
 *   bg_kv_int8_decode_attention  for each sequence s (one query row) and query head h: softmax
 *                                over its context of q' . k, times v, where k and v are the
 *                                pool's rows dequantized (values * their float32 scale) and q' is
 *                                scale * q quantized to int8 per (row, head) as the pool's rows
 *                                are (round to nearest even of 127 / max|x|), then dequantized
 *
 * Pool: [num_blocks, block_size, num_kv_heads, head_dim + 4] int8; row (token, head) holds
 * head_dim int8 values then the 4 bytes of its float32 scale. Token position p of sequence s is
 * slot block_tables[s][p / block_size] * block_size + p % block_size; query head h reads kv
 * head h / (num_heads / num_kv_heads).
 *
 * Each (sequence, kv head) is one work item. Its group's query rows are quantized once, so each
 * key row's dot products are exact int8 ones (vpdpbusd, 64 products an instruction, no
 * conversion of the key), 16 keys' sums reduced together; a block's scores are exponentiated
 * together (online softmax, one rescale per block); each value row is converted to float32 once
 * for the whole group. The pool is read once per step: half the bytes of a bf16 pool, plus the
 * scales.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "status.h"
#include "vector_math.h"

#define SCALE_BYTES 4
#define MAX_GROUP 16                      /* query heads per kv head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#define VECTOR 16
#define MAX_VECTORS (MAX_HEAD_DIM / VECTOR)
#define CHUNK 64                          /* int8 values a vector */
#define MAX_CHUNKS (MAX_HEAD_DIM / CHUNK)

static inline __m512 int8_to_float(const int8_t *x) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x)));
}

static inline float row_scale(const int8_t *row, int head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

typedef struct {
    const int8_t *k_cache, *v_cache;     /* at this item's kv head */
    int64_t token_stride;                 /* bytes from one slot to the next */
    int head_dim, block_size, group;
    float scale;
} Item;

/* The lane sums of 16 vectors as one vector (lane t: the sum of v[t]'s lanes): pairs of vectors,
 * then quads, are added lane-interleaved, then 128-bit quarters. */
static inline __m512 lane_sums(const __m512 v[VECTOR]) {
    __m512 quads[4];
    for (int i = 0; i < 4; i++) {
        const __m512 *x = v + 4 * i;
        __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
        __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    }
    /* quads[i]'s quarter k holds the sums of quarter k of v[4i .. 4i + 3] */
    __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                               _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

/* A group's query rows (times the softmax scale) as int8, symmetric per head, 64 a vector (zeros
 * past head_dim); `offsets` is 128 times each head's sum of values: vpdpbusd reads every key
 * value with its sign bit flipped, as value + 128. */
typedef struct {
    __m512i values[MAX_GROUP][MAX_CHUNKS];
    float scales[MAX_GROUP], offsets[MAX_GROUP];
} Queries;

static void quantize_queries(const uint16_t *q, int group, int head_dim, float scale, Queries *queries) {
    for (int g = 0; g < group; g++) {
        float row[MAX_HEAD_DIM], absmax = 0.0f;
        for (int d = 0; d < head_dim; d++) {
            row[d] = bf16_to_float(q[g * head_dim + d]) * scale;
            absmax = fabsf(row[d]) > absmax ? fabsf(row[d]) : absmax;
        }
        const float inverse = absmax > 0.0f ? 127.0f / absmax : 0.0f;
        int8_t values[MAX_CHUNKS * CHUNK] = {0};
        int sum = 0;
        for (int d = 0; d < head_dim; d++) {
            values[d] = (int8_t)lrintf(row[d] * inverse);
            sum += values[d];
        }
        for (int c = 0; c < MAX_CHUNKS; c++) queries->values[g][c] = _mm512_loadu_si512(values + c * CHUNK);
        queries->scales[g] = absmax / 127.0f;
        queries->offsets[g] = 128.0f * (float)sum;
    }
}

/* Scores of one block's `count` tokens (from slot `base`) for every query head of the group, 16
 * tokens at a time: each key row's int8 values times the int8 query by vpdpbusd, exactly. */
static void block_scores(const Item *item, int64_t base, int count, const Queries *queries,
                         float scores[][MAX_BLOCK_SIZE + VECTOR]) {
    const int chunks = (item->head_dim + CHUNK - 1) / CHUNK;
    const __m512i sign_bits = _mm512_set1_epi8((char)0x80);
    __m512 partial[MAX_GROUP][VECTOR];
    float key_scales[VECTOR];
    for (int first = 0; first < count; first += VECTOR) {
        for (int t = 0; t < VECTOR; t++) {
            if (first + t >= count) {
                for (int g = 0; g < item->group; g++) partial[g][t] = _mm512_setzero_ps();
                key_scales[t] = 0.0f;
                continue;
            }
            const int8_t *row = item->k_cache + (base + first + t) * item->token_stride;
            __m512i key[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++) {
                const int left = item->head_dim - c * CHUNK;
                const __mmask64 mask = left >= CHUNK ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
                key[c] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, row + c * CHUNK), sign_bits);
            }
            key_scales[t] = row_scale(row, item->head_dim);
            for (int g = 0; g < item->group; g++) {
                __m512i sums = _mm512_setzero_si512();
                for (int c = 0; c < chunks; c++) sums = _mm512_dpbusd_epi32(sums, key[c], queries->values[g][c]);
                partial[g][t] = _mm512_cvtepi32_ps(sums);  /* exact: |sums| < 2^24 */
            }
        }
        const __m512 scales = _mm512_loadu_ps(key_scales);
        for (int g = 0; g < item->group; g++) {
            const __m512 dots = _mm512_sub_ps(lane_sums(partial[g]), _mm512_set1_ps(queries->offsets[g]));
            _mm512_storeu_ps(scores[g] + first, _mm512_mul_ps(_mm512_mul_ps(dots, _mm512_set1_ps(queries->scales[g])),
                                                              scales));
        }
    }
}

static inline __mmask16 lanes_before(int count, int first) {
    const int left = count - first;
    return left >= VECTOR ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* exp(x) for x <= 0 (a score less the running max), 0 below -87: 2 ** (x log2 e) as 2 ** n
 * times a degree-7 polynomial of the fraction in [-0.5, 0.5] (relative error under 1e-7). */
static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    static const float coefficients[] = {1.5252734e-05f, 1.5403530e-04f, 1.3333558e-03f, 9.6181291e-03f,
                                         5.5504109e-02f, 2.4022651e-01f, 6.9314718e-01f, 1.0f};
    __m512 p = _mm512_set1_ps(coefficients[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(coefficients[i]));
    return _mm512_scalef_ps(p, n);
}

/* The largest of scores[0 .. count). */
static inline float block_max(const float *scores, int count) {
    __m512 peak = _mm512_set1_ps(-3.0e38f);
    for (int first = 0; first < count; first += VECTOR)
        peak = _mm512_mask_max_ps(peak, lanes_before(count, first), peak, _mm512_loadu_ps(scores + first));
    return _mm512_reduce_max_ps(peak);
}

/* scores[t] = exp(scores[t] - max) for t < count; returns their sum. */
static inline float exponentiate(float *scores, int count, float max) {
    __m512 total = _mm512_setzero_ps();
    for (int first = 0; first < count; first += VECTOR) {
        const __mmask16 lanes = lanes_before(count, first);
        const __m512 p = _mm512_maskz_mov_ps(lanes, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + first),
                                                                                 _mm512_set1_ps(max))));
        _mm512_storeu_ps(scores + first, p);
        total = _mm512_add_ps(total, p);
    }
    return _mm512_reduce_add_ps(total);
}

/* One sequence's attention for the `group` query heads of one kv head, into out (bf16); `vectors`
 * is head_dim / 16. Inlined where both are constants, so that the group's sums stay in registers. */
static inline __attribute__((always_inline)) void attend_shape(const Item *item, const int32_t *table, int context,
                                                               const uint16_t *q, uint16_t *out, const int vectors,
                                                               const int group) {
    Queries queries;
    __m512 sums[MAX_GROUP][MAX_VECTORS];
    float scores[MAX_GROUP][MAX_BLOCK_SIZE + VECTOR], running_max[MAX_GROUP], total[MAX_GROUP];
    quantize_queries(q, group, item->head_dim, item->scale, &queries);
    for (int g = 0; g < group; g++) {
        for (int j = 0; j < vectors; j++) sums[g][j] = _mm512_setzero_ps();
        running_max[g] = -3.0e38f;
        total[g] = 0.0f;
    }
    for (int start = 0; start < context; start += item->block_size) {
        const int count = context - start < item->block_size ? context - start : item->block_size;
        const int64_t base = (int64_t)table[start / item->block_size] * item->block_size;
        block_scores(item, base, count, &queries, scores);
        for (int g = 0; g < group; g++) {
            const float new_max = fmaxf(running_max[g], block_max(scores[g], count));
            const float correction = expf(running_max[g] - new_max);
            total[g] = total[g] * correction + exponentiate(scores[g], count, new_max);
            running_max[g] = new_max;
            for (int j = 0; j < vectors; j++) sums[g][j] = _mm512_mul_ps(sums[g][j], _mm512_set1_ps(correction));
        }
        for (int t = 0; t < count; t++) {
            const int8_t *row = item->v_cache + (base + t) * item->token_stride;
            const float value_scale = row_scale(row, item->head_dim);
            __m512 value[MAX_VECTORS];
            for (int j = 0; j < vectors; j++) value[j] = int8_to_float(row + j * VECTOR);
            for (int g = 0; g < group; g++) {
                const __m512 weight = _mm512_set1_ps(scores[g][t] * value_scale);
                for (int j = 0; j < vectors; j++) sums[g][j] = _mm512_fmadd_ps(weight, value[j], sums[g][j]);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const __m512 inverse = _mm512_set1_ps(1.0f / total[g]);
        for (int j = 0; j < vectors; j++)
            _mm256_storeu_si256((__m256i *)(out + g * item->head_dim + j * VECTOR),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sums[g][j], inverse)));
    }
}

#define SHAPE(vectors, group) \
    case (vectors) * MAX_GROUP + (group): attend_shape(item, table, context, q, out, vectors, group); return;

/* `attend_shape` compiled for head_dim 64 and 128 with up to 8 query heads a kv head (measured
 * 1.2x faster than for any shape), else for any shape. */
static void attend(const Item *item, const int32_t *table, int context, const uint16_t *q, uint16_t *out) {
    const int vectors = item->head_dim / VECTOR;
    switch (vectors * MAX_GROUP + item->group) {
        SHAPE(4, 1) SHAPE(4, 2) SHAPE(4, 3) SHAPE(4, 4) SHAPE(4, 5) SHAPE(4, 6) SHAPE(4, 7) SHAPE(4, 8)
        SHAPE(8, 1) SHAPE(8, 2) SHAPE(8, 3) SHAPE(8, 4) SHAPE(8, 5) SHAPE(8, 6) SHAPE(8, 7) SHAPE(8, 8)
        default: attend_shape(item, table, context, q, out, vectors, item->group);
    }
}

static int check_layout(const int32_t *block_tables, const int32_t *context_lens, int num_seqs, int num_blocks,
                        int block_size, int max_blocks) {
    for (int s = 0; s < num_seqs; s++) {
        const int context = context_lens[s];
        if (context < 1 || context > (int64_t)max_blocks * block_size) return STATUS_BAD_CONTEXT_LEN;
        for (int b = 0; b < (context + block_size - 1) / block_size; b++) {
            const int32_t block = block_tables[(int64_t)s * max_blocks + b];
            if (block < 0 || block >= num_blocks) return STATUS_BAD_BLOCK_ID;
        }
    }
    return STATUS_OK;
}

int bg_kv_int8_decode_attention(uint16_t *out, const uint16_t *q, const int8_t *k_cache, const int8_t *v_cache,
                                const int32_t *block_tables, const int32_t *context_lens, int num_seqs,
                                int num_heads, int num_kv_heads, int head_dim, int num_blocks, int block_size,
                                int max_blocks, float scale, int num_threads) {
    const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (group < 1 || group > MAX_GROUP || num_heads % num_kv_heads != 0 || head_dim % VECTOR != 0
            || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE)
        return STATUS_UNSUPPORTED;
    const int status = check_layout(block_tables, context_lens, num_seqs, num_blocks, block_size, max_blocks);
    if (status != STATUS_OK) return status;
    const int64_t row_bytes = head_dim + SCALE_BYTES, num_items = (int64_t)num_seqs * num_kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic)
    for (int64_t i = 0; i < num_items; i++) {
        const int s = (int)(i / num_kv_heads), h = (int)(i % num_kv_heads);
        const Item item = {k_cache + h * row_bytes, v_cache + h * row_bytes, num_kv_heads * row_bytes, head_dim,
                           block_size, group, scale};
        const int64_t rows = ((int64_t)s * num_heads + (int64_t)h * group) * head_dim;
        attend(&item, block_tables + (int64_t)s * max_blocks, context_lens[s], q + rows, out + rows);
    }
    return STATUS_OK;
}

int bg_kv_int8_attention_available(void) { return 1; }

#else

int bg_kv_int8_decode_attention(uint16_t *out, const uint16_t *q, const int8_t *k_cache, const int8_t *v_cache,
                                const int32_t *block_tables, const int32_t *context_lens, int num_seqs,
                                int num_heads, int num_kv_heads, int head_dim, int num_blocks, int block_size,
                                int max_blocks, float scale, int num_threads) {
    return STATUS_UNSUPPORTED;
}

int bg_kv_int8_attention_available(void) { return 0; }

#endif
