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
 * A block's rows of a kv head are laid out so once (Layouts) for every query head that attends
 * them. The softmax step runs on 16 query heads at a time, a head a lane (their scores transposed
 * so that a vector holds one token's), so it needs no reductions across lanes.
 *
 * Where the CPU has AMX-INT8 and a segment gives each kv head at least 16 query heads (a group's
 * shared blocks; a model with 16 query heads a kv head everywhere), each kv head's heads fill
 * lane sets of their own, and both products run on
 * tiles: the block's key rows as they lie in the pool times the lanes' queries (tokens x lanes),
 * and the lanes' 8-bit weights times the interleaved value rows. They are the same exact int32
 * sums as VNNI's, so the output is the same, bit for bit. The next score product (the next block's
 * first after a block's last) is issued before the current one is taken, and each 32 dims' value
 * sums are scaled while the tiles compute the next 32's: the tiles work while the core scales and
 * steps the softmax.
 *
 * Shared-prefix groups (`groups`: rows (first, end, prefix), in order and disjoint; members
 * first .. end - 1, at least two, hold the same blocks for positions [0, prefix), each past it):
 * the whole blocks of the prefix are attended once for all the members' query heads (cascade),
 * then each member's own positions for its own. Every query head sees the same blocks in the same
 * order with or without its group, so its output is the same, bit for bit.
 *
 * A work item is a group's members (as many as an item's query heads hold) or one other sequence,
 * over its kv heads (a lone sequence's split over items only where sequences are fewer than
 * threads), computed block by block, every kv head of a block in turn: a token's heads share cache
 * lines, read from memory once. The next blocks' lines are asked for a few at a time while a
 * block is computed (blocks sit anywhere in the pool; asked for at once, a block's lines fill the
 * core's miss buffers and the computing waits; measured in docs/performance.md).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_kernel.h"
#include "vector_math.h"

#define MAX_GROUP 16                      /* query heads per kv head */
#define ITEM_HEAD_CHUNKS 128              /* query heads x 64-dim chunks one work item attends for */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "lanes16.h"

#define VECTOR 16
#define CHUNK 64                          /* int8 values a vector */
#define MAX_CHUNKS (MAX_HEAD_DIM / CHUNK)
#define DWORDS (CHUNK / 4)                /* four-byte groups a vector */
#define WEIGHT_MAX 255.0f                 /* the softmax weights' 8-bit range */
#define FETCH_DISTANCE 2                  /* blocks ahead */
/* Lane sets of a segment, and their chunks' query tiles: at most ITEM_HEAD_CHUNKS / (16 chunks)
 * sets of heads, and on tiles as many part-filled ones (a kv head's heads, at least 16, fill sets
 * of their own). */
#define MAX_LANE_SETS (2 * ITEM_HEAD_CHUNKS / VECTOR)

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include "amx.h"
#define HAS_TILES 1
#else
#define HAS_TILES 0
#endif

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
 * (zeros past head_dim), head h's chunk c at dwords[h * chunks + c]; `scales` is each head's scale
 * times log2(e), so that scores come in log2 units; `offsets` is 128 times each head's sum of
 * values: vpdpbusd reads every key value with its sign bit flipped, as value + 128.
 * Head (m * kv_heads + h) * group + g is member m's query head g of the item's kv head h. */
typedef struct {
    int32_t dwords[ITEM_HEAD_CHUNKS][DWORDS];
    float scales[ITEM_HEAD_CHUNKS], offsets[ITEM_HEAD_CHUNKS];
} Queries;

/* head_dim bf16 values x, times `factor`, quantized as kv_int8.quantize does (round to nearest
 * even of y * (127 / max|y|)) into `values`; returns max|y|, and the sum of the values in `sum`. */
static float quantize_values(const uint16_t *x, int head_dim, float factor, int8_t *values, int32_t *sum) {
    __m512 peak = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += VECTOR)
        peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_mul_ps(load_bf16x16(x + d, 0xffff), _mm512_set1_ps(factor))));
    const float absmax = _mm512_reduce_max_ps(peak);
    const __m512 inverse = _mm512_set1_ps(absmax > 0.0f ? 127.0f / absmax : 0.0f);
    __m512i total = _mm512_setzero_si512();
    for (int d = 0; d < head_dim; d += VECTOR) {
        const __m512 y = _mm512_mul_ps(load_bf16x16(x + d, 0xffff), _mm512_set1_ps(factor));
        const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(y, inverse)); /* nearest even */
        total = _mm512_add_epi32(total, rounded);
        _mm_storeu_si128((__m128i *)(values + d), _mm512_cvtsepi32_epi8(rounded));
    }
    *sum = _mm512_reduce_add_epi32(total);
    return absmax;
}

/* Query heads q[0 .. num_heads) (times `scale`) into the item's heads at, .. + num_heads - 1. */
static void quantize_queries(const uint16_t *q, int num_heads, int head_dim, int chunks, float scale, int at,
                             Queries *queries) {
    for (int g = 0; g < num_heads; g++) {
        int8_t values[MAX_CHUNKS * CHUNK] = {0};
        int32_t sum;
        const float absmax = quantize_values(q + g * head_dim, head_dim, scale, values, &sum);
        memcpy(queries->dwords[(at + g) * chunks], values, (size_t)chunks * CHUNK);
        queries->scales[at + g] = absmax / 127.0f * LOG2E;
        queries->offsets[at + g] = 128.0f * (float)sum;
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

/* Where one block's rows of each of an item's kv heads lie once laid out for the products, every
 * query head that attends them reading the same layout: per kv head `stride` vectors, holding
 * - keys (for VNNI's score products; tiles read them as they lie in the pool): per 16-token group
 *   and 64-dim chunk, the 16 rows (sign bits flipped; zero rows past the block's count) transposed
 *   as 16 x 16 dwords, so that lane t of vector j holds token t's bytes 4 j .. 4 j + 3;
 * - key scales: per 16-token group, each token's;
 * - values: per chunk and 4 tokens, the 4 rows interleaved (interleave_rows);
 * - value scales: per 16-token group, each token's (0 past the count). */
typedef struct {
    __m512i *vectors;
    int64_t stride;
    int token_groups, quads, chunks; /* of a whole block: ceil(block_size / 16), ceil(block_size / 4);
                                        64-dim chunks of a row */
    int count;                       /* the block's tokens */
} Layouts;

static inline Layouts plan_layouts(int block_size, int chunks) {
    const int token_groups = (block_size + VECTOR - 1) / VECTOR, quads = (block_size + 3) / 4;
    return (Layouts){NULL, (int64_t)token_groups * (chunks * DWORDS + 2) + (int64_t)chunks * quads * 4, token_groups,
                     quads, chunks, 0};
}

static inline __m512i *key_vectors(const Layouts *l, int kv, int token_group, int c) {
    return l->vectors + kv * l->stride + (token_group * l->chunks + c) * DWORDS;
}

static inline __m512 *key_scales(const Layouts *l, int kv) {
    return (__m512 *)(l->vectors + kv * l->stride + l->token_groups * l->chunks * DWORDS);
}

static inline __m512i *value_vectors(const Layouts *l, int kv, int c, int quad) {
    return l->vectors + kv * l->stride + l->token_groups * (l->chunks * DWORDS + 1) + (c * l->quads + quad) * 4;
}

static inline float *value_scales(const Layouts *l, int kv) {
    return (float *)(l->vectors + kv * l->stride + l->token_groups * (l->chunks * DWORDS + 1) + l->chunks * l->quads * 4);
}

static inline __attribute__((always_inline)) void lay_out_block(const Item *item, const int8_t *keys,
                                                                const int8_t *values, const int chunks, int kv,
                                                                int keys_on_tiles, Layouts *l) {
    const int count = l->count;
    const __m512i sign_bits = _mm512_set1_epi8((char)0x80);
    const __m512i scale_offsets = _mm512_mullo_epi32(_mm512_set1_epi32((int)item->token_stride),
                                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int first = 0; first < count; first += VECTOR) {
        const int8_t *rows = keys + first * item->token_stride;
        for (int c = 0; c < (keys_on_tiles ? 0 : chunks); c++) { /* tiles read the keys as they lie */
            const __mmask64 mask = chunk_mask(item->head_dim, c);
            __m512i *groups = key_vectors(l, kv, first / VECTOR, c);
            for (int t = 0; t < VECTOR; t++)
                groups[t] = _mm512_xor_si512(t < count - first ? _mm512_maskz_loadu_epi8(mask, rows + t * item->token_stride + c * CHUNK)
                                                              : _mm512_setzero_si512(), sign_bits);
            transpose_dwords(groups);
        }
        const __mmask16 lanes = lanes_before(count, first);
        key_scales(l, kv)[first / VECTOR] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, scale_offsets,
                                                                     rows + item->head_dim, 1);
        _mm512_storeu_ps(value_scales(l, kv) + first,
                         _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, scale_offsets,
                                                  values + first * item->token_stride + item->head_dim, 1));
    }
    for (int c = 0; c < chunks; c++) {
        const __mmask64 mask = chunk_mask(item->head_dim, c);
        for (int t = 0; t < count; t += 4) {
            __m512i rows[4];
            for (int r = 0; r < 4; r++)
                rows[r] = t + r < count ? _mm512_maskz_loadu_epi8(mask, values + (t + r) * item->token_stride + c * CHUNK)
                                        : _mm512_setzero_si512();
            interleave_rows(rows, value_vectors(l, kv, c, t / 4));
        }
    }
}

/* One query head's scores of a 16-token group of the block (its kv head's layout): exact int8 dot
 * products, times the query's and the key row's scales (lanes past the block's count are left
 * over, never used). */
static inline __attribute__((always_inline)) __m512 head_scores(const Layouts *l, int kv, int token_group,
                                                                const Queries *queries, int head, const int chunks) {
    __m512i dots[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                       _mm512_setzero_si512()}; /* four chains of dependent instructions, not one */
    for (int c = 0; c < chunks; c++) {
        const __m512i *keys = key_vectors(l, kv, token_group, c);
        for (int j = 0; j < DWORDS; j++)
            dots[j % 4] = _mm512_dpbusd_epi32(dots[j % 4], keys[j], _mm512_set1_epi32(queries->dwords[head * chunks + c][j]));
    }
    /* exact: |dots| < 2^24 */
    const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(dots[0], dots[1]), _mm512_add_epi32(dots[2], dots[3]));
    const __m512 dot = _mm512_sub_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(queries->offsets[head]));
    return _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(queries->scales[head])), key_scales(l, kv)[token_group]);
}

/* Up to 16 query heads attending blocks together, one a lane: their head indices (in the item's
 * state) and kv heads, and while they attend (`gather_lanes` .. `scatter_lanes`) each one's
 * running softmax (the max of its scores, the sum of its weights) and query scale, lanes past n
 * 0. */
typedef struct {
    int heads[VECTOR], kvs[VECTOR];
    int n;
    _Alignas(64) float max[VECTOR];
    _Alignas(64) float total[VECTOR];
    _Alignas(64) float query_scales[VECTOR];
} Lanes;

/* An item's state: its queries, each query head's running softmax (the max of its scores, the
 * sum of its weights) and sums (head h's at sums[h * chunks * 4 ..], add_values' order), and a
 * block's scratch for one set of lanes: scores and value scales a token a vector, then the
 * 8-bit weights of 4 tokens a dword, each head's step (what one weight unit is worth) and the
 * factor of its earlier sums. */
typedef struct {
    Queries queries;
    _Alignas(64) float max[ITEM_HEAD_CHUNKS];
    _Alignas(64) float total[ITEM_HEAD_CHUNKS];
    __m512 sums[ITEM_HEAD_CHUNKS * 4];
    __m512 scores[MAX_BLOCK_SIZE], scales[MAX_BLOCK_SIZE];
    __m512i words[MAX_BLOCK_SIZE / 4];
    _Alignas(64) float steps[VECTOR], corrections[VECTOR];
    Layouts layouts;
    int tiles;                                        /* this thread's tiles are configured */
    _Alignas(64) int32_t query_tiles[MAX_LANE_SETS][DWORDS][VECTOR]; /* set s's chunk c at s * chunks + c */
    _Alignas(64) int32_t products[MAX_CHUNKS * 4][VECTOR][VECTOR];  /* a tile product's int32 sums, a row a vector */
    __m512i weight_rows[VECTOR];                      /* a lane's 8-bit weights of the block, a row */
} ItemState;

/* Each lane's running softmax and query scale from its head's in the item's state. */
static void gather_lanes(Lanes *lanes, const ItemState *state) {
    for (int i = 0; i < VECTOR; i++) lanes->max[i] = lanes->total[i] = lanes->query_scales[i] = 0.0f;
    for (int i = 0; i < lanes->n; i++) {
        const int head = lanes->heads[i];
        lanes->max[i] = state->max[head], lanes->total[i] = state->total[head];
        lanes->query_scales[i] = state->queries.scales[head];
    }
}

/* Each lane's running softmax back into its head's in the item's state. */
static void scatter_lanes(const Lanes *lanes, ItemState *state) {
    for (int i = 0; i < lanes->n; i++) state->max[lanes->heads[i]] = lanes->max[i], state->total[lanes->heads[i]] = lanes->total[i];
}

/* The block's scores and value scales of the lanes' heads, transposed so that token t's are
 * state->scores[t] and state->scales[t], a head a lane (lanes past n zero). */
static inline __attribute__((always_inline)) void lane_scores(const Lanes *lanes, const int chunks, ItemState *state) {
    const Layouts *l = &state->layouts;
    for (int first = 0; first < l->count; first += VECTOR) {
        __m512i scores[VECTOR], scales[VECTOR];
        for (int i = 0; i < VECTOR; i++) {
            scores[i] = i < lanes->n ? _mm512_castps_si512(head_scores(l, lanes->kvs[i], first / VECTOR, &state->queries,
                                                                       lanes->heads[i], chunks))
                                     : _mm512_setzero_si512();
            scales[i] = i < lanes->n ? _mm512_loadu_si512(value_scales(l, lanes->kvs[i]) + first) : _mm512_setzero_si512();
        }
        transpose_dwords(scores);
        transpose_dwords(scales);
        for (int t = 0; t < VECTOR; t++)
            state->scores[first + t] = _mm512_castsi512_ps(scores[t]), state->scales[first + t] = _mm512_castsi512_ps(scales[t]);
    }
}

/* The online softmax step of the lanes' heads over the block, a head a lane, on scores in log2
 * units (exp2_16: its error is far below the weights' 8-bit rounding): each weight (its
 * softmax weight times its value row's scale) rounded to 8 bits against the head's largest of the
 * block, round(w * 255 / max w), into state->words (4 tokens a dword, zeros past the count); each
 * head's step and correction of its earlier sums into state->steps and state->corrections. */
static inline void lane_weights(Lanes *lanes, ItemState *state) {
    const int count = state->layouts.count;
    const __m512 old_max = _mm512_load_ps(lanes->max);
    __m512 peak = _mm512_set1_ps(-3.0e38f);
    for (int t = 0; t < count; t++) peak = _mm512_max_ps(peak, state->scores[t]);
    const __m512 new_max = _mm512_max_ps(old_max, peak), correction = exp2_16(_mm512_sub_ps(old_max, new_max));
    __m512 total = _mm512_setzero_ps(), largest = _mm512_setzero_ps();
    for (int t = 0; t < count; t++) {
        const __m512 p = exp2_16(_mm512_sub_ps(state->scores[t], new_max));
        total = _mm512_add_ps(total, p);
        state->scores[t] = _mm512_mul_ps(p, state->scales[t]); /* the weight */
        largest = _mm512_max_ps(largest, state->scores[t]);
    }
    for (int t = count; t % 4; t++) state->scores[t] = _mm512_setzero_ps();
    const __m512 step = _mm512_mul_ps(largest, _mm512_set1_ps(1.0f / WEIGHT_MAX));
    const __m512 inverse = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(largest, _mm512_setzero_ps(), _CMP_GT_OQ),
                                               _mm512_set1_ps(1.0f), step);
    for (int t = 0; t < count; t += 4) {
        __m512i word = _mm512_setzero_si512();
        for (int r = 0; r < 4; r++)
            word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(state->scores[t + r], inverse)),
                                                           8 * r));
        state->words[t / 4] = word;
    }
    _mm512_store_ps(lanes->max, new_max);
    _mm512_store_ps(lanes->total, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(lanes->total), correction), total));
    _mm512_store_ps(state->steps, step);
    _mm512_store_ps(state->corrections, correction);
}

/* A head's float32 sums times `correction`, plus a block's int32 sums times `step`: the one update
 * of both products' paths, so that they give the same bits. */
static inline __m512 rescaled(__m512 sums, __m512i block_sums, __m512 step, __m512 correction) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_sums), step, _mm512_mul_ps(sums, correction));
}

/* Lane i's head's sums (sums[c * 4 + j] lane 4 L + i': dimension 64 c + 16 L + 4 j + i') times
 * its correction, plus its kv head's value rows of the block times its 8-bit weights. */
static inline __attribute__((always_inline)) void add_values(const Lanes *lanes, int i, const int chunks,
                                                             ItemState *state) {
    const Layouts *l = &state->layouts;
    __m512 *sums = state->sums + lanes->heads[i] * chunks * 4;
    const __m512 step = _mm512_set1_ps(state->steps[i]), correction = _mm512_set1_ps(state->corrections[i]);
    for (int c = 0; c < chunks; c++) {
        __m512i block_sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                                 _mm512_setzero_si512()};
        for (int quad = 0; quad * 4 < l->count; quad++) {
            const __m512i units = _mm512_set1_epi32(((const int32_t *)&state->words[quad])[i]);
            const __m512i *values = value_vectors(l, lanes->kvs[i], c, quad);
            for (int j = 0; j < 4; j++) block_sums[j] = _mm512_dpbusd_epi32(block_sums[j], units, values[j]);
        }
        for (int j = 0; j < 4; j++) sums[c * 4 + j] = rescaled(sums[c * 4 + j], block_sums[j], step, correction);
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

#if HAS_TILES
/* Tile registers of the products on tiles: a score product's sums (tokens x lanes), its keys (16
 * rows of the pool, 64 bytes of one chunk each) and queries (a chunk's 16 dwords x the lanes);
 * then the weights (lanes x the block's tokens), two value products' sums (lanes x 16 dims) and
 * a value operand (the block's 4-token groups x 16 dims); and the next score product's sums,
 * issued while the core works on the current one's. */
#define SCORE_SUMS 0
#define KEY_ROWS 1
#define QUERY_COLUMNS 2
#define WEIGHT_ROWS 3
#define VALUE_SUMS 4
#define NEXT_VALUE_SUMS 5
#define VALUE_ROWS 6
#define NEXT_SCORE_SUMS 7

static void configure_int8_tiles(int block_size) {
    TileConfig config = {.palette_id = 1};
    for (int t = 0; t < 8; t++) config.rows[t] = VECTOR, config.bytes_per_row[t] = 64;
    config.bytes_per_row[WEIGHT_ROWS] = (uint16_t)block_size;
    config.rows[VALUE_ROWS] = (uint8_t)(block_size / 4);
    _tile_loadconfig(&config);
}

/* The lanes' queries as the score product's B operands, per chunk: row j holds each lane's dword j. */
static void lane_query_tiles(const Lanes *lanes, const Queries *queries, const int chunks,
                             int32_t (*tiles)[DWORDS][VECTOR]) {
    for (int c = 0; c < chunks; c++) {
        __m512i rows[VECTOR];
        for (int i = 0; i < VECTOR; i++)
            rows[i] = i < lanes->n ? _mm512_loadu_si512(queries->dwords[lanes->heads[i] * chunks + c]) : _mm512_setzero_si512();
        transpose_dwords(rows);
        for (int j = 0; j < DWORDS; j++) _mm512_storeu_si512(tiles[c][j], rows[j]);
    }
}

/* The score product of lanes of one kv head with 16 tokens of a block (from `first`; its rows
 * start at `keys`) into tile `sums` (SCORE_SUMS or NEXT_SCORE_SUMS): the keys as they lie times the
 * lanes' queries, exact int8 dot products (tokens x lanes). Only issued: `take_scores` stores it,
 * so the tiles compute it while the core does other work. */
static inline __attribute__((always_inline)) void issue_scores(const Item *item, const int8_t *keys, int first,
                                                               int32_t (*query_tiles)[DWORDS][VECTOR], const int chunks,
                                                               int sums) {
    if (sums == SCORE_SUMS) _tile_zero(SCORE_SUMS);
    else _tile_zero(NEXT_SCORE_SUMS);
    for (int c = 0; c < chunks; c++) {
        _tile_loadd(KEY_ROWS, keys + first * item->token_stride + c * CHUNK, item->token_stride);
        _tile_loadd(QUERY_COLUMNS, query_tiles[c], 64);
        if (sums == SCORE_SUMS) _tile_dpbssd(SCORE_SUMS, KEY_ROWS, QUERY_COLUMNS);
        else _tile_dpbssd(NEXT_SCORE_SUMS, KEY_ROWS, QUERY_COLUMNS);
    }
}

/* An issued score product (tile `sums`) of the lanes with the block's tokens first .. first + 15,
 * times each lane's query scale and each token's key scale, into state->scores, as lane_scores
 * computes them, and the tokens' value scales (the kv head's) into state->scales. */
static inline __attribute__((always_inline)) void take_scores(const Lanes *lanes, int first, int sums,
                                                              ItemState *state) {
    const Layouts *l = &state->layouts;
    const __m512 scales = _mm512_load_ps(lanes->query_scales);
    const float *key_scale = (const float *)key_scales(l, lanes->kvs[0]), *value_scale = value_scales(l, lanes->kvs[0]);
    if (sums == SCORE_SUMS) _tile_stored(SCORE_SUMS, state->products[0], 64);
    else _tile_stored(NEXT_SCORE_SUMS, state->products[0], 64);
    for (int t = 0; t < VECTOR && first + t < l->count; t++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(state->products[0][t]));
        state->scores[first + t] = _mm512_mul_ps(_mm512_mul_ps(dot, scales), _mm512_set1_ps(key_scale[first + t]));
        state->scales[first + t] = _mm512_set1_ps(value_scale[first + t]);
    }
}

/* Each lane's sums k and k + 1 (add_values' order) times its correction, plus the int32 sums of
 * those dims' value products (state->products[k], [k + 1], a row a lane) times its step. */
static inline __attribute__((always_inline)) void rescale_pair(const Lanes *lanes, int k, const int chunks,
                                                               ItemState *state) {
    for (int i = 0; i < lanes->n; i++) {
        __m512 *sums = state->sums + lanes->heads[i] * chunks * 4;
        const __m512 step = _mm512_set1_ps(state->steps[i]), correction = _mm512_set1_ps(state->corrections[i]);
        for (int j = k; j < k + 2; j++) sums[j] = rescaled(sums[j], _mm512_load_si512(state->products[j][i]), step, correction);
    }
}

/* add_values on tiles for every lane: the lanes' 8-bit weights (lanes x tokens) times the block's
 * value rows (4 tokens x 16 dims a row), 32 dims at a time; the same int32 sums as add_values',
 * scaled into each lane's sums as it does, each 32 dims' while the tiles compute the next 32's. */
static inline __attribute__((always_inline)) void tile_values(const Lanes *lanes, const int chunks, ItemState *state) {
    const Layouts *l = &state->layouts;
    const int quads = (l->count + 3) / 4;
    for (int q = 0; q < VECTOR; q++) state->weight_rows[q] = q < quads ? state->words[q] : _mm512_setzero_si512();
    transpose_dwords(state->weight_rows); /* row i: lane i's weights, token by token */
    _tile_loadd(WEIGHT_ROWS, state->weight_rows, 64);
    for (int k = 0; k < chunks * 4; k += 2) {
        const __m512i *values = value_vectors(l, lanes->kvs[0], k / 4, 0) + k % 4;
        _tile_zero(VALUE_SUMS);
        _tile_zero(NEXT_VALUE_SUMS);
        _tile_loadd(VALUE_ROWS, values, 4 * 64);
        _tile_dpbusd(VALUE_SUMS, WEIGHT_ROWS, VALUE_ROWS);
        _tile_loadd(VALUE_ROWS, values + 1, 4 * 64);
        _tile_dpbusd(NEXT_VALUE_SUMS, WEIGHT_ROWS, VALUE_ROWS);
        if (k > 0) rescale_pair(lanes, k - 2, chunks, state);
        _tile_stored(VALUE_SUMS, state->products[k], 64);
        _tile_stored(NEXT_VALUE_SUMS, state->products[k + 1], 64);
    }
    rescale_pair(lanes, chunks * 4 - 2, chunks, state);
}

/* The tile of a block's score product `p` (0 its first): its first's (`first`), then the other
 * one, in turn. */
static inline int product_tile(int p, int first) {
    return (p % 2 == 0) == (first == SCORE_SUMS) ? SCORE_SUMS : NEXT_SCORE_SUMS;
}

/* A block laid out (`lay_out_block`) attended on tiles by every lane set, set by set: scores,
 * softmax step, values. The score products go in a pipeline over (set, 16 tokens) in turn, on into
 * the next block's first (its rows at `next_rows`; NULL for the last block): each is issued before
 * the one before it is taken, into the other of two tiles, so that the tiles compute it during
 * that one's scaling, softmax step and value products (the same products as taken one at a time).
 * `first_tile` is the tile of this block's first product where the block before issued it (else
 * -1); returns the tile of the next block's. The lines of `ahead` are asked for between the steps. */
static inline __attribute__((always_inline)) int attend_block_on_tiles(const Item *item, Lanes *all, int num_sets,
                                                                       const int8_t *rows, const int8_t *next_rows,
                                                                       int first_tile, int row_bytes, const int chunks,
                                                                       Ahead *ahead, int lines, ItemState *state) {
    const int groups = (state->layouts.count + VECTOR - 1) / VECTOR, pairs = num_sets * groups;
    if (first_tile < 0) {
        issue_scores(item, rows + all[0].kvs[0] * row_bytes, 0, state->query_tiles, chunks, SCORE_SUMS);
        first_tile = SCORE_SUMS;
    }
    for (int s = 0; s < num_sets; s++) {
        for (int g = 0; g < groups; g++) {
            const int pair = s * groups + g, next = pair + 1;
            if (next < pairs) {
                const int next_set = next / groups;
                issue_scores(item, rows + all[next_set].kvs[0] * row_bytes, next % groups * VECTOR,
                             state->query_tiles + next_set * chunks, chunks, product_tile(next, first_tile));
            } else if (next_rows != 0) {
                issue_scores(item, next_rows + all[0].kvs[0] * row_bytes, 0, state->query_tiles, chunks,
                             product_tile(next, first_tile));
            }
            take_scores(&all[s], g * VECTOR, product_tile(pair, first_tile), state);
        }
        fetch_ahead(ahead, lines);
        lane_weights(&all[s], state);
        fetch_ahead(ahead, lines);
        tile_values(&all[s], chunks, state);
        fetch_ahead(ahead, lines * all[s].n);
    }
    return next_rows != 0 ? product_tile(pairs, first_tile) : -1;
}
#endif

/* Positions [from_block * block_size, context) of the sequence with `table`, attended by the
 * query heads of the item's members first_member .. end_member - 1, block by block: every kv
 * head's rows of a block laid out once (a token's heads share lines, read once), then the heads
 * 16 at a time, a head a lane, each one's scores, softmax step and sums; the lines FETCH_DISTANCE
 * blocks ahead asked for meanwhile. A head's numbers do not depend on which heads share its lanes. */
static inline __attribute__((always_inline)) void attend_positions(const Item *item, const int32_t *table,
                                                                   int from_block, int context, int first_member,
                                                                   int end_member, const int chunks, ItemState *state) {
    const int row_bytes = item->head_dim + SCALE_BYTES, heads = item->kv_heads * item->group;
    const int num_heads = heads * (end_member - first_member);
    /* a kv head's heads fill lanes of their own on tiles where they fill a set; else sets pack them */
    const int on_tiles = state->tiles && (end_member - first_member) * item->group >= VECTOR;
    Lanes all[MAX_LANE_SETS];
    int num_sets = 0;
    for (int h = 0, i = 0; h < item->kv_heads; h++) {
        if (on_tiles && i % VECTOR) i += VECTOR - i % VECTOR;
        for (int m = first_member; m < end_member; m++)
            for (int g = 0; g < item->group; g++, i++) {
                Lanes *lanes = &all[i / VECTOR];
                lanes->heads[i % VECTOR] = m * heads + h * item->group + g, lanes->kvs[i % VECTOR] = h;
                lanes->n = i % VECTOR + 1, num_sets = i / VECTOR + 1;
            }
    }
    for (int s = 0; s < num_sets; s++) gather_lanes(&all[s], state);
#if HAS_TILES
    for (int s = 0; s < num_sets && on_tiles; s++)
        lane_query_tiles(&all[s], &state->queries, chunks, state->query_tiles + s * chunks);
    int first_tile = -1; /* on tiles: where the block before issued this block's first score product */
#endif
    for (int start = from_block * item->block_size; start < context; start += item->block_size) {
        state->layouts.count = context - start < item->block_size ? context - start : item->block_size;
        const int64_t first_byte = (int64_t)table[start / item->block_size] * item->block_size * item->token_stride;
        Ahead ahead = {0};
        if (start + FETCH_DISTANCE * item->block_size < context)
            ahead = plan_block(item, table[start / item->block_size + FETCH_DISTANCE]);
        /* spread over the block's work: after each kv head's layout, each set's scores and softmax
         * step, and each head's values */
        const int calls = item->kv_heads + 2 * num_sets + num_heads;
        const int lines = (int)((ahead.bytes / 64 + calls - 1) / calls);
        for (int h = 0; h < item->kv_heads; h++) {
            lay_out_block(item, item->k_cache + first_byte + h * row_bytes, item->v_cache + first_byte + h * row_bytes,
                          chunks, h, on_tiles, &state->layouts);
            fetch_ahead(&ahead, lines);
        }
#if HAS_TILES
        if (on_tiles) {
            const int next_start = start + item->block_size;
            const int8_t *next_rows = next_start < context ? item->k_cache + (int64_t)table[next_start / item->block_size]
                                                                                * item->block_size * item->token_stride
                                                           : 0;
            first_tile = attend_block_on_tiles(item, all, num_sets, item->k_cache + first_byte, next_rows, first_tile,
                                               row_bytes, chunks, &ahead, lines, state);
            continue;
        }
#endif
        for (int s = 0; s < num_sets; s++) {
            lane_scores(&all[s], chunks, state);
            fetch_ahead(&ahead, lines);
            lane_weights(&all[s], state);
            fetch_ahead(&ahead, lines);
            for (int i = 0; i < all[s].n; i++) {
                add_values(&all[s], i, chunks, state);
                fetch_ahead(&ahead, lines);
            }
        }
    }
    for (int s = 0; s < num_sets; s++) scatter_lanes(&all[s], state);
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
        state->max[h] = -3.0e38f, state->total[h] = 0.0f;
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
            store_head(state->sums + (m * heads + g) * chunks * 4, state->total[m * heads + g], item->head_dim,
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
        if (!decode_group_holds(block_tables, context_lens, num_seqs, block_size, max_blocks, seq, end, prefix))
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
            || head_dim < VECTOR || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE)
        return STATUS_UNSUPPORTED;
    const int status = check_layout(block_tables, context_lens, num_seqs, num_blocks, block_size, max_blocks);
    if (status != STATUS_OK) return status;
    const int chunks = (head_dim + CHUNK - 1) / CHUNK;
    Work *works = (Work *)malloc(sizeof(Work) * (size_t)(num_seqs > 0 ? num_seqs * num_kv_heads : 1));
    if (works == NULL) return STATUS_NO_MEMORY;
    const int num_works = plan_work(block_tables, context_lens, groups, num_groups, num_seqs, num_kv_heads, group,
                                    chunks, block_size, max_blocks, num_threads, works);
    if (num_works < 0) {
        free(works);
        return -num_works;
    }
    int result = STATUS_OK;
#if HAS_TILES
    const int tiles = block_size % VECTOR == 0 && head_dim % CHUNK == 0 && amx_tiles_granted();
#endif
    const int64_t row_bytes = head_dim + SCALE_BYTES;
    int most_kv_heads = 1;
    for (int i = 0; i < num_works; i++)
        most_kv_heads = works[i].kv_heads > most_kv_heads ? works[i].kv_heads : most_kv_heads;
    const Layouts layouts = plan_layouts(block_size, chunks);
#pragma omp parallel num_threads(num_threads) if (num_works > 1)
    {
        ItemState *state = (ItemState *)aligned_alloc(64, sizeof(ItemState));
        __m512i *vectors = (__m512i *)aligned_alloc(64, sizeof(__m512i) * (size_t)(layouts.stride * most_kv_heads));
        if (state == NULL || vectors == NULL) {
            free(state), free(vectors);
            state = NULL;
#pragma omp atomic write
            result = STATUS_NO_MEMORY;
        }
        if (state) state->layouts = layouts, state->layouts.vectors = vectors, state->tiles = 0;
#if HAS_TILES
        if (state && tiles) {
            configure_int8_tiles(block_size);
            state->tiles = 1;
        }
#endif
#pragma omp for schedule(dynamic)
        for (int i = 0; i < num_works; i++) {
            if (state == NULL) continue;
            const Work *work = &works[i];
            const Item item = {k_cache + work->first_head * row_bytes, v_cache + work->first_head * row_bytes,
                               num_kv_heads * row_bytes, head_dim, block_size, group, work->kv_heads, scale};
            attend(&item, work, block_tables, max_blocks, context_lens, num_heads, q, out, state);
        }
#if HAS_TILES
        if (state && state->tiles) _tile_release();
#endif
        if (state) free(state->layouts.vectors);
        free(state);
    }
    free(works);
    return result;
}

/* One (token, head) row of head_dim bf16 values as an int8 cache row (x times 1 is x). */
static void quantize_row(const uint16_t *x, int head_dim, int8_t *row) {
    int32_t sum;
    const float scale = quantize_values(x, head_dim, 1.0f, row, &sum) / 127.0f;
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
            for (int d = 0; d < head_dim; d += VECTOR) _mm256_storeu_si256((__m256i *)(target + d), dequantize16(row + d, scale));
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
