/*
 * Decode attention over an int8 K/V pool (`kv_cache_dtype: int8`, kv_int8.py), bfloat16 queries
 * and output, on a CPU with AVX-512, AVX512-VNNI and AVX512-BF16 (elsewhere every call is
 * STATUS_UNSUPPORTED).
 *
 *   bg_kv_int8_decode_attention  for each sequence s (one query row) and query head h: softmax
 *                                over its context of q' . k, times v, where k and v are the
 *                                pool's rows dequantized (values * their float32 scale), q' is
 *                                scale * q quantized to int8 per (row, head) as the pool's rows
 *                                are (round to nearest even of 127 / max|x|), then dequantized,
 *                                and each block's softmax weights (times their value row's
 *                                scale) are rounded to 8 bits against the block's largest
 *   bg_kv_int8_store             new tokens' K and V rows (bf16) quantized into their slots, as
 *                                kv_int8.quantize does: round to nearest even of x * (127 / max|x|),
 *                                then the float32 max|x| / 127
 *   bg_kv_int8_dequantize        the rows of chosen blocks as bf16, as kv_int8.dequantize does:
 *                                values * scale in float32, rounded to nearest even
 *
 * Pool: [num_blocks, block_size, num_kv_heads, head_dim + 4] int8; row (token, head) holds
 * head_dim int8 values then the 4 bytes of its float32 scale. Token position p of sequence s is
 * slot block_tables[s][p / block_size] * block_size + p % block_size; query head h reads kv
 * head h / (num_heads / num_kv_heads).
 *
 * Both products are int8 dot products on VNNI (vpdpbusd: 4 byte products summed into each of 16
 * int32 lanes), so the pool's values are never converted to float:
 * - scores: 16 key rows (64 bytes each) are transposed as 16 x 16 four-byte groups, so that lane
 *   t of vector j holds token t's bytes 4j .. 4j + 3; 16 instructions then give 16 tokens' exact
 *   dot products with a query head (broadcast four bytes at a time);
 * - values: 4 value rows are interleaved byte-wise, so that each int32 lane holds one dimension
 *   of 4 tokens; with the 4 tokens' weights (0 .. 255) broadcast, one instruction adds 16
 *   dimensions' weighted values; a block's int32 sums are scaled into float32 once.
 * A work item is one sequence's kv heads (split over items only where sequences are fewer than
 * threads), computed block by block, every head of a block in turn: a token's heads share cache
 * lines, read from memory once. The next blocks' lines are asked for a few at a time while a
 * block is computed (blocks sit anywhere in the pool; asked for at once, a block's lines fill the
 * core's miss buffers and the computing waits; measured in docs/performance.md).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"
#include "vector_math.h"

#define SCALE_BYTES 4
#define MAX_GROUP 16                      /* query heads per kv head */
#define ITEM_HEAD_CHUNKS 128              /* query heads x 64-dim chunks one work item attends for */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#define VECTOR 16
#define CHUNK 64                          /* int8 values a vector */
#define MAX_CHUNKS (MAX_HEAD_DIM / CHUNK)
#define DWORDS (CHUNK / 4)                /* four-byte groups a vector */
#define WEIGHT_MAX 255.0f                 /* the softmax weights' 8-bit range */
#define FETCH_DISTANCE 2                  /* blocks ahead */

static inline __m512 bf16_vector(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

static inline float row_scale(const int8_t *row, int head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

/* The shape of the pool's rows as an item reads them: kv heads [first, first + kv_heads), every
 * query head of each. */
typedef struct {
    const int8_t *k_cache, *v_cache;     /* at the item's first kv head */
    int64_t token_stride;                 /* bytes from one slot to the next */
    int head_dim, block_size, group, kv_heads;
    float scale;
} Item;

/* A work item: the kv heads first_head .. + kv_heads - 1 of sequences first .. first + count - 1,
 * whose first shared_blocks blocks are the same (a group's members; 0 for a lone sequence). */
typedef struct {
    int first, count, shared_blocks, first_head, kv_heads;
} Work;

/* An item's query rows (times the softmax scale) as int8, symmetric per head, four bytes a dword
 * (zeros past head_dim), head h's chunk c at dwords[h * chunks + c]; `offsets` is 128 times each
 * head's sum of values: vpdpbusd reads every key value with its sign bit flipped, as value + 128.
 * Head (m * kv_heads + h) * group + g is member m's query head g of the item's kv head h. */
typedef struct {
    int32_t dwords[ITEM_HEAD_CHUNKS][DWORDS];
    float scales[ITEM_HEAD_CHUNKS], offsets[ITEM_HEAD_CHUNKS];
} Queries;

static void quantize_queries(const uint16_t *q, int num_heads, int head_dim, int chunks, float scale, int first_head,
                             Queries *queries) {
    for (int g = 0; g < num_heads; g++) {
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
        memcpy(queries->dwords[(first_head + g) * chunks], values, (size_t)chunks * CHUNK);
        queries->scales[first_head + g] = absmax / 127.0f;
        queries->offsets[first_head + g] = 128.0f * (float)sum;
    }
}

/* Bytes [64 c, 64 c + 64) of a row past its head_dim values read as zero. */
static inline __mmask64 chunk_mask(int head_dim, int c) {
    const int left = head_dim - c * CHUNK;
    return left >= CHUNK ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
}

static inline __mmask16 lanes_before(int count, int first) {
    const int left = count - first;
    return left >= VECTOR ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* 16 vectors of 16 dwords transposed in place: afterwards lane t of r[j] is what lane j of r[t]
 * was. Pairs of dwords, then of qwords, are interleaved within 128-bit lanes; then 128-bit lanes
 * are gathered across vectors. */
static inline void transpose_dwords(__m512i r[VECTOR]) {
    __m512i a[VECTOR], b[VECTOR];
    for (int i = 0; i < VECTOR; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* b[4i + m]: lane L holds rows 4i .. 4i + 3's dword 4L + m */
    for (int i = 0; i < VECTOR; i += 4) {
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i even_low = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x88), odd_low = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xDD);
        const __m512i even_high = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x88),
                      odd_high = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xDD);
        r[m] = _mm512_shuffle_i32x4(even_low, even_high, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(odd_low, odd_high, 0x88);
        r[8 + m] = _mm512_shuffle_i32x4(even_low, even_high, 0xDD);
        r[12 + m] = _mm512_shuffle_i32x4(odd_low, odd_high, 0xDD);
    }
}

/* 4 value rows' bytes [64 c, 64 c + 64) interleaved: lane L of out[j] holds dimensions
 * 16 L + 4 j .. 16 L + 4 j + 3, each as its 4 tokens' bytes. */
static inline void interleave_rows(const __m512i rows[4], __m512i out[4]) {
    const __m512i low01 = _mm512_unpacklo_epi8(rows[0], rows[1]), high01 = _mm512_unpackhi_epi8(rows[0], rows[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(rows[2], rows[3]), high23 = _mm512_unpackhi_epi8(rows[2], rows[3]);
    out[0] = _mm512_unpacklo_epi16(low01, low23);
    out[1] = _mm512_unpackhi_epi16(low01, low23);
    out[2] = _mm512_unpacklo_epi16(high01, high23);
    out[3] = _mm512_unpackhi_epi16(high01, high23);
}

/* One kv head's rows of a block as both products read them, laid out once for every query head
 * that attends them: keys in 16-token groups, each chunk's 16 rows (sign bits flipped) transposed
 * as 16 x 16 dwords, so that lane t of keys[i][c][j] holds token 16 i + t's bytes 64 c + 4 j ..
 * + 3 (zero rows past `count`); values 4 tokens interleaved (interleave_rows). */
typedef struct {
    __m512i keys[MAX_BLOCK_SIZE / VECTOR][MAX_CHUNKS][DWORDS];
    __m512 key_scales[MAX_BLOCK_SIZE / VECTOR];
    __m512i values[MAX_CHUNKS][MAX_BLOCK_SIZE / 4][4];
    float value_scales[MAX_BLOCK_SIZE];
    int count;
} Block;

static inline __attribute__((always_inline)) void lay_out_block(const Item *item, const int8_t *keys,
                                                                const int8_t *values, int count, const int chunks,
                                                                Block *block) {
    const __m512i sign_bits = _mm512_set1_epi8((char)0x80);
    const __m512i scale_offsets = _mm512_mullo_epi32(_mm512_set1_epi32((int)item->token_stride),
                                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    block->count = count;
    for (int first = 0; first < count; first += VECTOR) {
        const int8_t *rows = keys + first * item->token_stride;
        for (int c = 0; c < chunks; c++) {
            const __mmask64 mask = chunk_mask(item->head_dim, c);
            __m512i *groups = block->keys[first / VECTOR][c];
            for (int t = 0; t < VECTOR; t++)
                groups[t] = _mm512_xor_si512(t < count - first ? _mm512_maskz_loadu_epi8(mask, rows + t * item->token_stride + c * CHUNK)
                                                              : _mm512_setzero_si512(), sign_bits);
            transpose_dwords(groups);
        }
        block->key_scales[first / VECTOR] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes_before(count, first),
                                                                     scale_offsets, rows + item->head_dim, 1);
    }
    for (int t = 0; t < count; t++) block->value_scales[t] = row_scale(values + t * item->token_stride, item->head_dim);
    for (int c = 0; c < chunks; c++) {
        const __mmask64 mask = chunk_mask(item->head_dim, c);
        for (int t = 0; t < count; t += 4) {
            __m512i rows[4];
            for (int r = 0; r < 4; r++)
                rows[r] = t + r < count ? _mm512_maskz_loadu_epi8(mask, values + (t + r) * item->token_stride + c * CHUNK)
                                        : _mm512_setzero_si512();
            interleave_rows(rows, block->values[c][t / 4]);
        }
    }
}

/* One query head's scores of the block's tokens: exact int8 dot products, times the query's and
 * the key row's scales (lanes past the block's count are left over, never read). */
static inline __attribute__((always_inline)) void head_scores(const Block *block, const Queries *queries, int head,
                                                              const int chunks, float *scores) {
    for (int first = 0; first < block->count; first += VECTOR) {
        __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                           _mm512_setzero_si512()}; /* four chains of dependent instructions, not one */
        for (int c = 0; c < chunks; c++)
            for (int j = 0; j < DWORDS; j++)
                dots[j % 4] = _mm512_dpbusd_epi32(dots[j % 4], block->keys[first / VECTOR][c][j],
                                                  _mm512_set1_epi32(queries->dwords[head * chunks + c][j]));
        /* exact: |dots| < 2^24 */
        const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(dots[0], dots[1]), _mm512_add_epi32(dots[2], dots[3]));
        const __m512 dot = _mm512_sub_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(queries->offsets[head]));
        _mm512_storeu_ps(scores + first, _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(queries->scales[head])),
                                                       block->key_scales[first / VECTOR]));
    }
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

/* One query head's online softmax: the running max of its scores and sum of its weights. */
typedef struct {
    float max, total;
} Softmax;

/* A block's softmax weights of one query head, times each token's value scale, as bytes
 * round(w * 255 / max w) in weights[0 .. count) (zeros up to the next multiple of 16); updates
 * the running softmax, returns the factor earlier sums are multiplied by (`*step`: what one
 * weight unit is worth). */
static inline float block_weights(const float *scores, const float *value_scales, int count, Softmax *softmax,
                                  uint8_t *weights, float *step) {
    __m512 peak = _mm512_set1_ps(-3.0e38f);
    for (int first = 0; first < count; first += VECTOR)
        peak = _mm512_mask_max_ps(peak, lanes_before(count, first), peak, _mm512_loadu_ps(scores + first));
    const float new_max = fmaxf(softmax->max, _mm512_reduce_max_ps(peak));
    const float correction = expf(softmax->max - new_max);
    float exponentials[MAX_BLOCK_SIZE];
    __m512 total = _mm512_setzero_ps(), largest = _mm512_setzero_ps();
    for (int first = 0; first < count; first += VECTOR) {
        const __mmask16 lanes = lanes_before(count, first);
        const __m512 p = _mm512_maskz_mov_ps(lanes, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + first),
                                                                                 _mm512_set1_ps(new_max))));
        total = _mm512_add_ps(total, p);
        const __m512 w = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(lanes, value_scales + first));
        largest = _mm512_max_ps(largest, w);
        _mm512_storeu_ps(exponentials + first, w);
    }
    softmax->total = softmax->total * correction + _mm512_reduce_add_ps(total);
    softmax->max = new_max;
    const float peak_weight = _mm512_reduce_max_ps(largest);
    *step = peak_weight * (1.0f / WEIGHT_MAX);
    const __m512 inverse = _mm512_set1_ps(peak_weight > 0.0f ? 1.0f / *step : 0.0f);
    for (int first = 0; first < count; first += VECTOR) {
        const __m512i units = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(exponentials + first), inverse));
        _mm_storeu_si128((__m128i *)(weights + first),
                         _mm512_maskz_cvtusepi32_epi8(lanes_before(count, first), units));
    }
    return correction;
}

/* One query head's sums (sums[c * 4 + j] lane 4 L + i: dimension 64 c + 16 L + 4 j + i) times
 * `correction`, plus the block's value rows times its 8-bit weights. */
static inline __attribute__((always_inline)) void add_values(const Block *block, const uint8_t *weights, float step,
                                                             float correction, const int chunks, __m512 *sums) {
    for (int c = 0; c < chunks; c++) {
        __m512i block_sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                                 _mm512_setzero_si512()};
        for (int t = 0; t < block->count; t += 4) {
            int32_t four;
            memcpy(&four, weights + t, sizeof four);
            const __m512i units = _mm512_set1_epi32(four);
            for (int j = 0; j < 4; j++) block_sums[j] = _mm512_dpbusd_epi32(block_sums[j], units, block->values[c][t / 4][j]);
        }
        for (int j = 0; j < 4; j++)
            sums[c * 4 + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_sums[j]), _mm512_set1_ps(step),
                                              _mm512_mul_ps(sums[c * 4 + j], _mm512_set1_ps(correction)));
    }
}

/* The K and V lines of a block ahead, asked for a few at a time while the current block is
 * computed (blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one;
 * asked for at once, a block's lines fill the core's miss buffers and the computing waits). */
typedef struct {
    const char *keys, *values;
    int64_t offset, bytes;               /* the next line; the block's bytes */
} Ahead;

static inline Ahead plan_block(const Item *item, int32_t block) {
    const int64_t bytes = (int64_t)item->block_size * item->token_stride;
    return (Ahead){(const char *)item->k_cache + block * bytes, (const char *)item->v_cache + block * bytes, 0, bytes};
}

/* Asks for the next `lines` K lines and as many V lines (those left when fewer). */
static inline void fetch_ahead(Ahead *ahead, int lines) {
    for (; lines > 0 && ahead->offset < ahead->bytes; lines--, ahead->offset += 64) {
        _mm_prefetch(ahead->keys + ahead->offset, _MM_HINT_T0);
        _mm_prefetch(ahead->values + ahead->offset, _MM_HINT_T0);
    }
}

/* sums / total as bf16 dimensions, un-interleaving add_values' order. */
static inline void store_head(const __m512 *sums, float total, int head_dim, uint16_t *out) {
    const __m512 inverse = _mm512_set1_ps(1.0f / total);
    for (int c = 0; c * CHUNK < head_dim; c++) {
        /* dimensions 64 c + 16 L .. + 15 are lane L of sums[4 c .. 4 c + 3] */
        const __m512 *a = sums + 4 * c;
        const __m512 x0 = _mm512_shuffle_f32x4(a[0], a[1], 0x44), x1 = _mm512_shuffle_f32x4(a[0], a[1], 0xEE);
        const __m512 x2 = _mm512_shuffle_f32x4(a[2], a[3], 0x44), x3 = _mm512_shuffle_f32x4(a[2], a[3], 0xEE);
        const __m512 ordered[4] = {_mm512_shuffle_f32x4(x0, x2, 0x88), _mm512_shuffle_f32x4(x0, x2, 0xDD),
                                   _mm512_shuffle_f32x4(x1, x3, 0x88), _mm512_shuffle_f32x4(x1, x3, 0xDD)};
        for (int L = 0; L < 4 && c * CHUNK + L * VECTOR < head_dim; L++)
            _mm256_storeu_si256((__m256i *)(out + c * CHUNK + L * VECTOR),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(ordered[L], inverse)));
    }
}

/* An item's softmax state: each query head's running softmax and its sums (head h's at
 * sums[h * chunks * 4 ..], add_values' order). */
typedef struct {
    Queries queries;
    Softmax softmax[ITEM_HEAD_CHUNKS];
    __m512 sums[ITEM_HEAD_CHUNKS * 4];
    Block block;
} ItemState;

/* Positions [from_block * block_size, context) of the sequence with `table`, attended by the
 * query heads of the item's members first_member .. end_member - 1, block by block, every kv head
 * of a block in turn (a token's heads share lines, read once), each laid out once for all of
 * them; the lines FETCH_DISTANCE blocks ahead asked for meanwhile. */
static inline __attribute__((always_inline)) void attend_positions(const Item *item, const int32_t *table,
                                                                   int from_block, int context, int first_member,
                                                                   int end_member, const int chunks, ItemState *state) {
    const int row_bytes = item->head_dim + SCALE_BYTES, heads = item->kv_heads * item->group;
    float scores[MAX_BLOCK_SIZE];
    uint8_t weights[MAX_BLOCK_SIZE + 16];
    for (int start = from_block * item->block_size; start < context; start += item->block_size) {
        const int count = context - start < item->block_size ? context - start : item->block_size;
        const int64_t first_byte = (int64_t)table[start / item->block_size] * item->block_size * item->token_stride;
        Ahead ahead = {0};
        if (start + FETCH_DISTANCE * item->block_size < context)
            ahead = plan_block(item, table[start / item->block_size + FETCH_DISTANCE]);
        const int calls = heads * (end_member - first_member); /* one fetch_ahead per query head */
        const int lines = (int)((ahead.bytes / 64 + calls) / calls);
        for (int h = 0; h < item->kv_heads; h++) {
            lay_out_block(item, item->k_cache + first_byte + h * row_bytes, item->v_cache + first_byte + h * row_bytes,
                          count, chunks, &state->block);
            for (int m = first_member; m < end_member; m++)
                for (int g = 0; g < item->group; g++) {
                    const int head = m * heads + h * item->group + g;
                    float step;
                    head_scores(&state->block, &state->queries, head, chunks, scores);
                    const float correction = block_weights(scores, state->block.value_scales, count,
                                                           &state->softmax[head], weights, &step);
                    add_values(&state->block, weights, step, correction, chunks, state->sums + head * chunks * 4);
                    fetch_ahead(&ahead, lines);
                }
        }
    }
}

/* One work item's attention into out (bf16): the shared blocks once for every member's query
 * heads, then each member's own positions. A member's heads see the same blocks in the same order
 * as they would alone, so its output is the same as without the group. Inlined where `chunks`
 * (head_dim / 64 rounded up) is a constant. */
static inline __attribute__((always_inline)) void attend_shape(const Item *item, const Work *work,
                                                               const int32_t *block_tables, int max_blocks,
                                                               const int32_t *context_lens, int num_heads,
                                                               const uint16_t *q, uint16_t *out, const int chunks,
                                                               ItemState *state) {
    const int heads = item->kv_heads * item->group;
    for (int m = 0; m < work->count; m++) {
        const int64_t rows = ((int64_t)(work->first + m) * num_heads + (int64_t)work->first_head * item->group) * item->head_dim;
        quantize_queries(q + rows, heads, item->head_dim, chunks, item->scale, m * heads, &state->queries);
    }
    for (int h = 0; h < work->count * heads; h++) {
        state->softmax[h] = (Softmax){-3.0e38f, 0.0f};
        for (int i = 0; i < chunks * 4; i++) state->sums[h * chunks * 4 + i] = _mm512_setzero_ps();
    }
    const int32_t *tables = block_tables + (int64_t)work->first * max_blocks;
    if (work->shared_blocks > 0)
        attend_positions(item, tables, 0, work->shared_blocks * item->block_size, 0, work->count, chunks, state);
    for (int m = 0; m < work->count; m++)
        attend_positions(item, tables + (int64_t)m * max_blocks, work->shared_blocks, context_lens[work->first + m], m,
                         m + 1, chunks, state);
    for (int m = 0; m < work->count; m++)
        for (int g = 0; g < heads; g++) {
            const int64_t row = (int64_t)(work->first + m) * num_heads + (int64_t)work->first_head * item->group + g;
            store_head(state->sums + (m * heads + g) * chunks * 4, state->softmax[m * heads + g].total, item->head_dim,
                       out + row * item->head_dim);
        }
}

/* `attend_shape` compiled for head_dim 64 and 128, else for any. */
static void attend(const Item *item, const Work *work, const int32_t *block_tables, int max_blocks,
                   const int32_t *context_lens, int num_heads, const uint16_t *q, uint16_t *out, ItemState *state) {
    const int chunks = (item->head_dim + CHUNK - 1) / CHUNK;
    if (chunks == 1) attend_shape(item, work, block_tables, max_blocks, context_lens, num_heads, q, out, 1, state);
    else if (chunks == 2) attend_shape(item, work, block_tables, max_blocks, context_lens, num_heads, q, out, 2, state);
    else attend_shape(item, work, block_tables, max_blocks, context_lens, num_heads, q, out, chunks, state);
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

/* Whether group (first, end, prefix) keeps its invariants: at least two members, each holding
 * the first member's blocks for positions [0, prefix) and a position past them. */
static int is_group(const int32_t *block_tables, const int32_t *context_lens, int num_seqs, int block_size,
                    int max_blocks, int first, int end, int prefix) {
    if (end > num_seqs || end - first < 2 || prefix < 1) return 0;
    for (int member = first; member < end; member++)
        if (prefix >= context_lens[member] ||
            memcmp(block_tables + (int64_t)member * max_blocks, block_tables + (int64_t)first * max_blocks,
                   sizeof(int32_t) * (size_t)((prefix + block_size - 1) / block_size)))
            return 0;
    return 1;
}

/* The work items (as many as returned, into `works`, which holds num_seqs * num_kv_heads): a
 * group's members in runs whose query heads fit an item, each run over as many kv heads as fit;
 * every other sequence's kv heads in as few items as give every thread one. Returns
 * -STATUS_BAD_GROUP for a group out of order, overlapping or breaking its invariants. */
static int plan_work(const int32_t *block_tables, const int32_t *context_lens, const int32_t *groups, int num_groups,
                     int num_seqs, int num_kv_heads, int group, int chunks, int block_size, int max_blocks,
                     int num_threads, Work *works) {
    const int item_heads = ITEM_HEAD_CHUNKS / chunks; /* query heads an item holds */
    int lone_heads = item_heads / group < num_kv_heads ? item_heads / group : num_kv_heads;
    const int splits_wanted = num_seqs >= num_threads ? 1 : (num_threads + num_seqs - 1) / num_seqs;
    if (splits_wanted > 1) {
        const int split = (num_kv_heads + splits_wanted - 1) / splits_wanted;
        lone_heads = split < lone_heads ? split : lone_heads;
    }
    int num_works = 0, g = 0;
    for (int seq = 0; seq < num_seqs;) {
        if (g == num_groups || groups[3 * g] != seq) {
            for (int h = 0; h < num_kv_heads; h += lone_heads)
                works[num_works++] = (Work){seq, 1, 0, h, num_kv_heads - h < lone_heads ? num_kv_heads - h : lone_heads};
            seq++;
            continue;
        }
        const int end = groups[3 * g + 1], prefix = groups[3 * g + 2];
        if (!is_group(block_tables, context_lens, num_seqs, block_size, max_blocks, seq, end, prefix))
            return -STATUS_BAD_GROUP;
        const int most_members = item_heads / group;
        for (int first = seq; first < end; first += most_members) {
            const int count = end - first < most_members ? end - first : most_members;
            const int kv_heads = item_heads / (count * group) < num_kv_heads ? item_heads / (count * group) : num_kv_heads;
            for (int h = 0; h < num_kv_heads; h += kv_heads)
                works[num_works++] = (Work){first, count, prefix / block_size, h,
                                            num_kv_heads - h < kv_heads ? num_kv_heads - h : kv_heads};
        }
        seq = end, g++;
    }
    return g == num_groups ? num_works : -STATUS_BAD_GROUP;
}

int bg_kv_int8_decode_attention(uint16_t *out, const uint16_t *q, const int8_t *k_cache, const int8_t *v_cache,
                                const int32_t *block_tables, const int32_t *context_lens, const int32_t *groups,
                                int num_groups, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                int num_blocks, int block_size, int max_blocks, float scale, int num_threads) {
    const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (group < 1 || group > MAX_GROUP || num_heads % num_kv_heads != 0 || head_dim % VECTOR != 0
            || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE)
        return STATUS_UNSUPPORTED;
    const int status = check_layout(block_tables, context_lens, num_seqs, num_blocks, block_size, max_blocks);
    if (status != STATUS_OK) return status;
    const int chunks = (head_dim + CHUNK - 1) / CHUNK;
    Work *works = (Work *)malloc(sizeof(Work) * (size_t)(num_seqs > 0 ? num_seqs * num_kv_heads : 1));
    if (works == NULL) return STATUS_NO_MEMORY;
    const int num_works = plan_work(block_tables, context_lens, groups, num_groups, num_seqs, num_kv_heads, group,
                                    chunks, block_size, max_blocks, num_threads, works);
    int result = num_works < 0 ? -num_works : STATUS_OK;
    const int64_t row_bytes = head_dim + SCALE_BYTES;
#pragma omp parallel num_threads(num_threads) if (num_works > 1)
    {
        ItemState *state = (ItemState *)aligned_alloc(64, sizeof(ItemState));
        if (state == NULL) {
#pragma omp atomic write
            result = STATUS_NO_MEMORY;
        }
#pragma omp for schedule(dynamic)
        for (int i = 0; i < (state ? num_works : 0); i++) {
            const Work *work = &works[i];
            const Item item = {k_cache + work->first_head * row_bytes, v_cache + work->first_head * row_bytes,
                               num_kv_heads * row_bytes, head_dim, block_size, group, work->kv_heads, scale};
            attend(&item, work, block_tables, max_blocks, context_lens, num_heads, q, out, state);
        }
        free(state);
    }
    free(works);
    return result;
}

/* One (token, head) row of head_dim bf16 values as an int8 cache row. */
static void quantize_row(const uint16_t *x, int head_dim, int8_t *row) {
    __m512 peak = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += VECTOR)
        peak = _mm512_max_ps(peak, _mm512_abs_ps(bf16_vector(x + d)));
    const float absmax = _mm512_reduce_max_ps(peak), scale = absmax / 127.0f;
    const __m512 inverse = _mm512_set1_ps(absmax > 0.0f ? 127.0f / absmax : 0.0f);
    for (int d = 0; d < head_dim; d += VECTOR) {
        const __m512i values = _mm512_cvtps_epi32(_mm512_mul_ps(bf16_vector(x + d), inverse)); /* nearest even */
        _mm_storeu_si128((__m128i *)(row + d), _mm512_cvtsepi32_epi8(values));
    }
    memcpy(row + head_dim, &scale, sizeof scale);
}

int bg_kv_int8_store(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride, int8_t *k_cache,
                     int8_t *v_cache, const int64_t *slots, int num_tokens, int num_kv_heads, int head_dim,
                     int64_t num_slots, int num_threads) {
    if (head_dim % VECTOR != 0) return STATUS_UNSUPPORTED;
    for (int t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return STATUS_BAD_SLOT;
    const int64_t row_bytes = head_dim + SCALE_BYTES;
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= 256)
    for (int t = 0; t < num_tokens; t++)
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t row = (slots[t] * num_kv_heads + h) * row_bytes;
            quantize_row(k + t * k_stride + h * head_dim, head_dim, k_cache + row);
            quantize_row(v + t * v_stride + h * head_dim, head_dim, v_cache + row);
        }
    return STATUS_OK;
}

int bg_kv_int8_dequantize(const int8_t *cache, const int64_t *blocks, int num_blocks, int64_t num_pool_blocks,
                          int64_t rows_per_block, int head_dim, uint16_t *out, int num_threads) {
    if (head_dim % VECTOR != 0) return STATUS_UNSUPPORTED;
    for (int b = 0; b < num_blocks; b++)
        if (blocks[b] < 0 || blocks[b] >= num_pool_blocks) return STATUS_BAD_BLOCK_ID;
    const int64_t row_bytes = head_dim + SCALE_BYTES;
#pragma omp parallel for num_threads(num_threads) if (num_blocks >= 16)
    for (int b = 0; b < num_blocks; b++)
        for (int64_t r = 0; r < rows_per_block; r++) {
            const int8_t *row = cache + (blocks[b] * rows_per_block + r) * row_bytes;
            uint16_t *target = out + ((int64_t)b * rows_per_block + r) * head_dim;
            const __m512 scale = _mm512_set1_ps(row_scale(row, head_dim));
            for (int d = 0; d < head_dim; d += VECTOR) {
                const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
                _mm256_storeu_si256((__m256i *)(target + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(x, scale)));
            }
        }
    return STATUS_OK;
}

int bg_kv_int8_attention_available(void) { return 1; }

#else

int bg_kv_int8_decode_attention(uint16_t *out, const uint16_t *q, const int8_t *k_cache, const int8_t *v_cache,
                                const int32_t *block_tables, const int32_t *context_lens, const int32_t *groups,
                                int num_groups, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                int num_blocks, int block_size, int max_blocks, float scale, int num_threads) {
    return STATUS_UNSUPPORTED;
}

int bg_kv_int8_store(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride, int8_t *k_cache,
                     int8_t *v_cache, const int64_t *slots, int num_tokens, int num_kv_heads, int head_dim,
                     int64_t num_slots, int num_threads) {
    return STATUS_UNSUPPORTED;
}

int bg_kv_int8_dequantize(const int8_t *cache, const int64_t *blocks, int num_blocks, int64_t num_pool_blocks,
                          int64_t rows_per_block, int head_dim, uint16_t *out, int num_threads) {
    return STATUS_UNSUPPORTED;
}

int bg_kv_int8_attention_available(void) { return 0; }

#endif
