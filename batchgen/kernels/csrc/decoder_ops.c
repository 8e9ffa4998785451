/*
 * Fused elementwise work of one decoder layer, for CPUs: the parts of a Llama-family step
 * between its matrix products, each one pass over memory.
 *
 * Every function takes row-major, contiguous tensors of `dtype` (float32 or bfloat16) and
 * computes in float32, rounding to `dtype` exactly where transformers' own layers round, so a
 * float32 step equals transformers' up to the order of the RMSNorm sum, and a bfloat16 step
 * rounds the same intermediates.
 *
 *   bg_add_rms_norm  residual += x (when x is given), then out = weight * rmsnorm(residual)
 *   bg_rope_write_kv q/k of a fused qkv row get rotary embeddings; q and k are written out,
 *                    k and v are stored at their slots of the paged K/V pool
 *   bg_silu_mul      out = silu(gate) * up for a fused gate|up row
 *
 * Rows are split over `num_threads` OpenMP threads only when a call holds at least
 * MIN_PARALLEL_ELEMENTS elements: waking threads for a decode step's few rows costs more than
 * the work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

#define MIN_PARALLEL_ELEMENTS 65536

/* `value` rounded to bfloat16 when `is_bf16`, else unchanged. */
static inline float round_to(float value, int is_bf16) {
    return is_bf16 ? bf16_to_float(float_to_bf16(value)) : value;
}

/* `n` elements of `src` as float32: `src` itself for float32, else converted into `buf`. */
static inline const float *as_float(const void *src, float *restrict buf, int n, int is_bf16) {
    if (!is_bf16) return (const float *)src;
    const uint16_t *s = (const uint16_t *)src;
    for (int i = 0; i < n; i++) buf[i] = bf16_to_float(s[i]);
    return buf;
}

/* Store `n` float32 values into a row of the tensor's dtype. */
static inline void store_row(void *dst, const float *restrict src, int n, int is_bf16) {
    if (!is_bf16) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int i = 0; i < n; i++) d[i] = float_to_bf16(src[i]);
}

static inline void *row_at(const void *base, int64_t row, int64_t width, int is_bf16) {
    return (char *)base + row * width * (is_bf16 ? 2 : 4);
}

/* residual[r] += x[r] (rounded to dtype) when x is not NULL; then
 * out[r] = weight * round(residual[r] * (1 / sqrt(mean(residual[r]^2) + eps))). */
void bg_add_rms_norm(void *out, void *residual, const void *x, const void *weight, int num_rows,
                     int hidden, float eps, int dtype, int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    float weight_buf[hidden];
    const float *w = as_float(weight, weight_buf, hidden, is_bf16);
    int is_parallel = num_threads > 1 && (int64_t)num_rows * hidden >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int r = 0; r < num_rows; r++) {
        float sum_buf[hidden], add_buf[hidden], out_buf[hidden];
        void *res_row = row_at(residual, r, hidden, is_bf16);
        const float *res = as_float(res_row, sum_buf, hidden, is_bf16);
        if (x) {
            const float *add = as_float(row_at(x, r, hidden, is_bf16), add_buf, hidden, is_bf16);
            for (int i = 0; i < hidden; i++) sum_buf[i] = round_to(res[i] + add[i], is_bf16);
            store_row(res_row, sum_buf, hidden, is_bf16);
            res = sum_buf;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < hidden; i++) sum += res[i] * res[i];
        float inverse = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int i = 0; i < hidden; i++) out_buf[i] = w[i] * round_to(res[i] * inverse, is_bf16);
        store_row(row_at(out, r, hidden, is_bf16), out_buf, hidden, is_bf16);
    }
}

/* x * cos + rotate_half(x) * sin for one head (rotate_half(x) = [-x2, x1]), each product
 * rounded to dtype as transformers' tensor ops round them. */
static inline void rotate_head(float *restrict dst, const float *restrict x, const float *restrict cos,
                               const float *restrict sin, int head_dim, int is_bf16) {
    int half = head_dim / 2;
    for (int i = 0; i < half; i++)
        dst[i] = round_to(x[i] * cos[i], is_bf16) + round_to(-x[i + half] * sin[i], is_bf16);
    for (int i = half; i < head_dim; i++)
        dst[i] = round_to(x[i] * cos[i], is_bf16) + round_to(x[i - half] * sin[i], is_bf16);
}

/* qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] (q heads, then k, then v);
 * cos/sin: [num_tokens, head_dim]; slots: [num_tokens] int64.
 * Writes q_out [num_tokens, num_heads, head_dim] and k_out [num_tokens, num_kv_heads, head_dim]
 * (rotated), and stores rotated k and plain v at k_cache/v_cache row `slots[t]`
 * ([num_slots, num_kv_heads, head_dim]). */
void bg_rope_write_kv(void *q_out, void *k_out, void *k_cache, void *v_cache, const void *qkv,
                      const void *cos, const void *sin, const int64_t *slots, int num_tokens, int num_heads,
                      int num_kv_heads, int head_dim, int dtype, int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    int64_t width = (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
    int qk_width = (num_heads + num_kv_heads) * head_dim, kv_width = num_kv_heads * head_dim;
    size_t element = is_bf16 ? 2 : 4;
    int is_parallel = num_threads > 1 && (int64_t)num_tokens * width >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        float row_buf[qk_width], cos_buf[head_dim], sin_buf[head_dim], rotated[qk_width];
        const char *row = row_at(qkv, t, width, is_bf16);
        const float *x = as_float(row, row_buf, qk_width, is_bf16);
        const float *c = as_float(row_at(cos, t, head_dim, is_bf16), cos_buf, head_dim, is_bf16);
        const float *s = as_float(row_at(sin, t, head_dim, is_bf16), sin_buf, head_dim, is_bf16);
        for (int h = 0; h < num_heads + num_kv_heads; h++)
            rotate_head(rotated + h * head_dim, x + h * head_dim, c, s, head_dim, is_bf16);
        store_row(row_at(q_out, t, num_heads * head_dim, is_bf16), rotated, num_heads * head_dim, is_bf16);
        void *k_row = row_at(k_out, t, kv_width, is_bf16);
        store_row(k_row, rotated + num_heads * head_dim, kv_width, is_bf16);
        memcpy(row_at(k_cache, slots[t], kv_width, is_bf16), k_row, kv_width * element);
        memcpy(row_at(v_cache, slots[t], kv_width, is_bf16), row + qk_width * element, kv_width * element);
    }
}

/* gate_up: [num_rows, 2 * width] (gate, then up); out: [num_rows, width] =
 * round(silu(gate)) * up. */
void bg_silu_mul(void *out, const void *gate_up, int num_rows, int width, int dtype, int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    int is_parallel = num_threads > 1 && (int64_t)num_rows * width >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int r = 0; r < num_rows; r++) {
        float row_buf[2 * width], out_buf[width];
        const float *row = as_float(row_at(gate_up, r, 2 * (int64_t)width, is_bf16), row_buf, 2 * width, is_bf16);
        for (int i = 0; i < width; i++) {
            float gate = row[i];
            out_buf[i] = round_to(gate / (1.0f + vector_expf(-gate)), is_bf16) * row[width + i];
        }
        store_row(row_at(out, r, width, is_bf16), out_buf, width, is_bf16);
    }
}
