/*
 * Decode attention over an int8 K/V pool (`kv_cache_dtype: int8`, kv_int8.py), bfloat16 queries
 * and output, on a CPU with AVX-512 and AVX512-BF16 (elsewhere every call is STATUS_UNSUPPORTED).
 *
 *   bg_kv_int8_decode_attention  for each sequence s (one query row) and query head h: softmax
 *                                over its context of scale * q . k, times v, where k and v are
 *                                the pool's rows dequantized (values * their float32 scale)
 *
 * Pool: [num_blocks, block_size, num_kv_heads, head_dim + 4] int8; row (token, head) holds
 * head_dim int8 values then the 4 bytes of its float32 scale. Token position p of sequence s is
 * slot block_tables[s][p / block_size] * block_size + p % block_size; query head h reads kv
 * head h / (num_heads / num_kv_heads).
 *
 * Each (sequence, kv head) is one work item: its group's query rows stay in registers, each
 * key row is converted to float32 once for the whole group, and a block's scores are
 * exponentiated together (online softmax, one rescale per block). The pool is read once per
 * step: half the bytes of a bf16 pool, plus the scales.
 */
#include <stdint.h>
#include <string.h>

#include "status.h"
#include "vector_math.h"

#define SCALE_BYTES 4
#define MAX_GROUP 16                      /* query heads per kv head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#define VECTOR 16
#define MAX_VECTORS (MAX_HEAD_DIM / VECTOR)

static inline __m512 int8_to_float(const int8_t *x) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x)));
}

static inline __m512 bf16_to_float16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
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

/* Scores of one block's `count` tokens (from slot `base`) for every query head of the group. */
static void block_scores(const Item *item, int64_t base, int count, __m512 queries[][MAX_VECTORS],
                         float scores[][MAX_BLOCK_SIZE]) {
    const int vectors = item->head_dim / VECTOR;
    for (int t = 0; t < count; t++) {
        const int8_t *row = item->k_cache + (base + t) * item->token_stride;
        __m512 key[MAX_VECTORS];
        for (int j = 0; j < vectors; j++) key[j] = int8_to_float(row + j * VECTOR);
        const float key_scale = row_scale(row, item->head_dim);
        for (int g = 0; g < item->group; g++) {
            __m512 sum = _mm512_mul_ps(queries[g][0], key[0]);
            for (int j = 1; j < vectors; j++) sum = _mm512_fmadd_ps(queries[g][j], key[j], sum);
            scores[g][t] = _mm512_reduce_add_ps(sum) * key_scale;
        }
    }
}

/* One sequence's attention for the group of query heads of one kv head, into out (bf16). */
static void attend(const Item *item, const int32_t *table, int context, const uint16_t *q, uint16_t *out) {
    const int vectors = item->head_dim / VECTOR, group = item->group;
    __m512 queries[MAX_GROUP][MAX_VECTORS], sums[MAX_GROUP][MAX_VECTORS];
    float scores[MAX_GROUP][MAX_BLOCK_SIZE], running_max[MAX_GROUP], total[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        for (int j = 0; j < vectors; j++) {
            queries[g][j] = _mm512_mul_ps(bf16_to_float16(q + g * item->head_dim + j * VECTOR),
                                          _mm512_set1_ps(item->scale));
            sums[g][j] = _mm512_setzero_ps();
        }
        running_max[g] = -3.0e38f;
        total[g] = 0.0f;
    }
    for (int start = 0; start < context; start += item->block_size) {
        const int count = context - start < item->block_size ? context - start : item->block_size;
        const int64_t base = (int64_t)table[start / item->block_size] * item->block_size;
        block_scores(item, base, count, queries, scores);
        for (int g = 0; g < group; g++) {
            float block_max = scores[g][0];
            for (int t = 1; t < count; t++) block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
            const float new_max = block_max > running_max[g] ? block_max : running_max[g];
            const float correction = vector_expf(running_max[g] - new_max);
            float block_total = 0.0f;
            for (int t = 0; t < count; t++) {
                scores[g][t] = vector_expf(scores[g][t] - new_max);
                block_total += scores[g][t];
            }
            total[g] = total[g] * correction + block_total;
            running_max[g] = new_max;
            for (int j = 0; j < vectors; j++) sums[g][j] = _mm512_mul_ps(sums[g][j], _mm512_set1_ps(correction));
        }
        for (int t = 0; t < count; t++) {
            const int8_t *row = item->v_cache + (base + t) * item->token_stride;
            const float value_scale = row_scale(row, item->head_dim);
            for (int j = 0; j < vectors; j++) {
                const __m512 value = int8_to_float(row + j * VECTOR);
                for (int g = 0; g < group; g++)
                    sums[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g][t] * value_scale), value, sums[g][j]);
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
