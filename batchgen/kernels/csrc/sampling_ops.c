/*
 * The sampler's row-wise argmax on CPU, one pass over float32 or bfloat16 logits.
 *
 *   bg_argmax_rows       out[r] = torch.argmax(x[r]) for float32 x: the first index of the row's
 *                        largest value; in a row holding a NaN, its first NaN's index (torch
 *                        orders NaN above every number, so its argmax returns the first NaN)
 *   bg_argmax_rows_bf16  the same for bfloat16 x, read as the float32 values it holds (each
 *                        bf16 value widens to float32 exactly, so the order and the result are
 *                        those of argmax over `x.float()`, without that copy)
 *
 * torch's CPU argmax is a scalar loop, many times slower than the row's max. With AVX-512 each row is scanned 16 lanes at a time, each lane keeping its first largest
 * value and that value's index; else a scalar loop. Rows are split over `num_threads` OpenMP
 * threads when the call holds at least MIN_PARALLEL_ELEMENTS values.
 */
#include <stdint.h>

#include "vector_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MIN_PARALLEL_ELEMENTS 262144

/* Element i of a float32 (is_bf16 0) or bfloat16 row, as float32. */
static inline float value_at(const void *row, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* The first NaN's index, or -1 when the row holds none. */
static int64_t first_nan(const void *row, int64_t cols, int is_bf16) {
    for (int64_t i = 0; i < cols; i++)
        if (value_at(row, i, is_bf16) != value_at(row, i, is_bf16)) return i;
    return -1;
}

/* torch.argmax of one row from element `start` on, given the best value and index before it
 * (-1 for none): scalar. */
static int64_t argmax_scalar(const void *row, int64_t start, int64_t cols, float best, int64_t best_index,
                             int is_bf16) {
    for (int64_t i = start; i < cols; i++) {
        float value = value_at(row, i, is_bf16);
        if (value != value) return first_nan(row, cols, is_bf16);
        if (best_index < 0 || value > best) best = value, best_index = i;
    }
    return best_index;
}

#if defined(__AVX512F__)
/* Elements i .. i + 15 of the row as float32. */
static inline __m512 load_16(const void *row, int64_t i, int is_bf16) {
    if (!is_bf16) return _mm512_loadu_ps((const float *)row + i);
    __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

static inline int64_t argmax_row(const void *row, int64_t cols, int is_bf16) {
#if defined(__AVX512F__)
    if (cols >= 16 && cols <= INT32_MAX) {
        __m512 best = load_16(row, 0, is_bf16);
        __m512i best_index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        __m512i index = best_index;
        __mmask16 has_nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
        int64_t i = 16;
        for (; i + 16 <= cols; i += 16) {
            __m512 values = load_16(row, i, is_bf16);
            index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
            __mmask16 greater = _mm512_cmp_ps_mask(values, best, _CMP_GT_OQ); /* ties keep the earlier */
            has_nan |= _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
            best = _mm512_mask_mov_ps(best, greater, values);
            best_index = _mm512_mask_mov_epi32(best_index, greater, index);
        }
        if (has_nan) return first_nan(row, cols, is_bf16);
        /* each lane holds its first largest value: the row's is the lowest index among the lanes at the max */
        float max = _mm512_reduce_max_ps(best);
        __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(max), _CMP_EQ_OQ);
        int64_t result = _mm512_mask_reduce_min_epi32(at_max, best_index);
        return argmax_scalar(row, i, cols, max, result, is_bf16);
    }
#endif
    return argmax_scalar(row, 0, cols, 0.0f, -1, is_bf16);
}

/* Every row's argmax; element size 2 (bf16) or 4 (float32). */
static void argmax_rows(const char *x, int64_t rows, int64_t cols, int64_t *out, int num_threads, int is_bf16) {
    int64_t row_bytes = cols * (is_bf16 ? 2 : 4);
    int is_parallel = num_threads > 1 && rows > 1 && rows * cols >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_bytes, cols, is_bf16);
}

void bg_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads) {
    argmax_rows((const char *)x, rows, cols, out, num_threads, 0);
}

void bg_argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t cols, int64_t *out, int num_threads) {
    argmax_rows((const char *)x, rows, cols, out, num_threads, 1);
}
