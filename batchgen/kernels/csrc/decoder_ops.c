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
 *   bg_add_norm      the same with a float32 weight applied before the one rounding (Gemma's
 *                    (1 + w), OLMo 2's RMSNorm) or a LayerNorm (mean removed, float32 weight and bias)
 *   bg_rope_write_kv q/k of a fused qkv row get optional RMSNorms (per head or over all heads)
 *                    and rotary embeddings on their first rotary_dim dims (0: none); q and k are
 *                    written out, k and v are stored at their slots of the paged K/V pool
 *   bg_silu_mul      out = silu(gate) * up for a fused gate|up row
 *   bg_clamped_glu   out = (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit): gpt-oss'
 *                    expert activation, for a gate|up row
 *   bg_gelu_new      GPT-2's tanh GELU, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
 *   bg_gelu_tanh_mul out = gelu_tanh(gate) * up for a fused gate|up row (Gemma's MLP)
 *   bg_moe_route     a top-k routing's (row, expert) pairs sorted by expert: each pair's row and
 *                    each (row, slot)'s place in that order, and the pairs per expert
 *   bg_moe_combine   out[r] = sum over r's pairs, in expert order, of y[pair] * weight: a
 *                    mixture-of-experts layer's expert outputs added into their rows
 *
 * Rows are split over `num_threads` OpenMP threads only when a call holds at least
 * MIN_PARALLEL_ELEMENTS elements: a call of a row or two runs on one thread. In a step the other
 * threads are awake (they just ran the GEMM before the call), and each core holds in its cache
 * the half of the rows it wrote, so from about 16 decode rows on both threads win (measured in
 * docs/performance.md).
 *
 * With AVX-512 (F, BW, VL) a row of the norms, of the activations and of the rotary pass over
 * whole heads (after per-head q/k norms, if any) is one pass of 16-lane intrinsics (HAS_ROW16),
 * faster than the portable loops, which gcc vectorizes through temporary rows. Both compute the
 * same operations except the exponential (expf16: its own polynomial, within a few ulp of
 * vector_expf), the order of the norms' sums and, with AVX512-BF16, the bfloat16 rounding (the
 * convert instruction flushes subnormal values to zero).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };
enum { NORM_RMS_SCALED = 0, NORM_LAYER = 1 };      /* bg_add_norm's kinds */
enum { QK_NORM_RMS = 0, QK_NORM_RMS_SCALED = 1 };  /* bg_rope_write_kv's: Llama's rounding, or one rounding */

#define MIN_PARALLEL_ELEMENTS 8192

/* The RMSNorms of q and k before their rotation: weights q (float32, `width` values) and k, or
 * NULL for none; `width` is head_dim (one norm per head) or 0 (one over all q heads, one over all
 * k heads); QK_NORM_RMS rounds the normalized value then its product with the weight (Llama's
 * RMSNorm), QK_NORM_RMS_SCALED only the product (Gemma's, with (1 + w) given, and OLMo 2's). */
typedef struct {
    const float *q, *k;
    int width, kind;
    float eps;
} QKNorm;

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

/* res_row += x_row (rounded to dtype) when x_row is not NULL; returns res_row's `hidden` values
 * as float32 (in sum_buf where converted or summed; add_buf is scratch). */
static const float *add_residual(void *res_row, const void *x_row, float *restrict sum_buf, float *restrict add_buf,
                                 int hidden, int is_bf16) {
    const float *res = as_float(res_row, sum_buf, hidden, is_bf16);
    if (!x_row) return res;
    const float *add = as_float(x_row, add_buf, hidden, is_bf16);
    for (int i = 0; i < hidden; i++) sum_buf[i] = round_to(res[i] + add[i], is_bf16);
    store_row(res_row, sum_buf, hidden, is_bf16);
    return sum_buf;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAS_ROW16 1

#include "lanes16.h"

/* The lanes of elements i .. i + 16 that lie before n. */
static inline __mmask16 lanes_before(int i, int n) { return n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1); }

/* Elements i .. i + 16 of a row (lanes past n are 0), as float32. */
static inline __m512 load16(const void *row, int i, int n, int is_bf16) {
    __mmask16 lanes = lanes_before(i, n);
    if (!is_bf16) return _mm512_maskz_loadu_ps(lanes, (const float *)row + i);
    return load_bf16x16((const uint16_t *)row + i, lanes);
}

/* Store elements i .. i + 16 of a row, those before n, in its dtype. */
static inline void store16(void *row, int i, int n, __m512 v, int is_bf16) {
    __mmask16 lanes = lanes_before(i, n);
    if (!is_bf16) {
        _mm512_mask_storeu_ps((float *)row + i, lanes, v);
        return;
    }
    _mm256_mask_storeu_epi16((uint16_t *)row + i, lanes, to_bf16x16(v));
}

/* residual_row += x_row (rounded to dtype) when x_row is not NULL; then
 * out = w * round(residual_row * (1 / sqrt(mean(residual_row^2) + eps))), on 16 lanes (the sum
 * of squares in another order than the portable loop's: transformers' differs from both). */
static void add_rms_norm_row(void *out, void *res_row, const void *x_row, const float *w, int hidden, float eps,
                             int is_bf16) {
    __m512 squares = _mm512_setzero_ps();
    for (int i = 0; i < hidden; i += 16) {
        __m512 res = load16(res_row, i, hidden, is_bf16);
        if (x_row) {
            res = round16(_mm512_add_ps(res, load16(x_row, i, hidden, is_bf16)), is_bf16);
            store16(res_row, i, hidden, res, is_bf16);
        }
        squares = _mm512_add_ps(squares, _mm512_mul_ps(res, res));
    }
    float inverse = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps);
    for (int i = 0; i < hidden; i += 16) {
        __m512 normed = round16(_mm512_mul_ps(load16(res_row, i, hidden, is_bf16), _mm512_set1_ps(inverse)), is_bf16);
        store16(out, i, hidden, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes_before(i, hidden), w + i), normed), is_bf16);
    }
}

/* One head's RMSNorm (QKNorm's, per head: `w` over n values) on 16 lanes, into the float32 `dst`. */
static void qk_norm_head16(float *dst, const void *head, const float *w, int n, const QKNorm *norm, int is_bf16) {
    __m512 squares = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __m512 x = load16(head, i, n, is_bf16);
        squares = _mm512_add_ps(squares, _mm512_mul_ps(x, x));
    }
    __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + norm->eps));
    for (int i = 0; i < n; i += 16) {
        __m512 normed = _mm512_mul_ps(load16(head, i, n, is_bf16), inverse);
        if (norm->kind == QK_NORM_RMS) normed = round16(normed, is_bf16);
        _mm512_storeu_ps(dst + i, round16(_mm512_mul_ps(_mm512_loadu_ps(w + i), normed), is_bf16));
    }
}

/* rotate_heads on 16 lanes for a rotation over whole heads, after per-head norms where `norm`
 * has them; head_dim a multiple of 32. */
static void rotate_heads16(void *q_row, void *k_row, const void *x, const void *cos, const void *sin, int num_heads,
                           int num_kv_heads, int head_dim, const QKNorm *norm, int is_bf16) {
    int half = head_dim / 2;
    float normed[head_dim];
    for (int h = 0; h < num_heads + num_kv_heads; h++) {
        const void *head = row_at(x, h, head_dim, is_bf16);
        int head_is_bf16 = is_bf16;
        if (norm->q) {
            qk_norm_head16(normed, head, h < num_heads ? norm->q : norm->k, head_dim, norm, is_bf16);
            head = normed;
            head_is_bf16 = 0;
        }
        void *dst = h < num_heads ? row_at(q_row, h, head_dim, is_bf16) : row_at(k_row, h - num_heads, head_dim, is_bf16);
        for (int i = 0; i < half; i += 16) {
            __m512 low = load16(head, i, head_dim, head_is_bf16);
        __m512 high = load16(head, i + half, head_dim, head_is_bf16);
            __m512 cos_low = load16(cos, i, head_dim, is_bf16), cos_high = load16(cos, i + half, head_dim, is_bf16);
            __m512 sin_low = load16(sin, i, head_dim, is_bf16), sin_high = load16(sin, i + half, head_dim, is_bf16);
            __m512 out_low = _mm512_sub_ps(round16(_mm512_mul_ps(low, cos_low), is_bf16),
                                           round16(_mm512_mul_ps(high, sin_low), is_bf16));
            __m512 out_high = _mm512_add_ps(round16(_mm512_mul_ps(high, cos_high), is_bf16),
                                            round16(_mm512_mul_ps(low, sin_high), is_bf16));
            store16(dst, i, head_dim, out_low, is_bf16);
            store16(dst, i + half, head_dim, out_high, is_bf16);
        }
    }
}

/* out = round(silu(gate)) * up for one gate|up row of 2 * width, on 16 lanes. */
static void silu_mul_row(void *out, const void *gate_up, int width, int is_bf16) {
    const char *up = (const char *)row_at(gate_up, 1, width, is_bf16);
    for (int i = 0; i < width; i += 16)
        store16(out, i, width, silu_mul16(load16(gate_up, i, width, is_bf16), load16(up, i, width, is_bf16), is_bf16),
                is_bf16);
}
#endif

#ifndef HAS_ROW16
/* residual_row += x_row (rounded to dtype) when x_row is not NULL; then
 * out = w * round(residual_row * (1 / sqrt(mean(residual_row^2) + eps))). */
static void add_rms_norm_row(void *out, void *res_row, const void *x_row, const float *w, int hidden, float eps,
                             int is_bf16) {
    float sum_buf[hidden], add_buf[hidden], out_buf[hidden];
    const float *res = add_residual(res_row, x_row, sum_buf, add_buf, hidden, is_bf16);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < hidden; i++) sum += res[i] * res[i];
    float inverse = 1.0f / sqrtf(sum / (float)hidden + eps);
    for (int i = 0; i < hidden; i++) out_buf[i] = w[i] * round_to(res[i] * inverse, is_bf16);
    store_row(out, out_buf, hidden, is_bf16);
}

#endif

/* add_rms_norm_row for every row: residual[r] += x[r] when x is not NULL, then out[r] = the norm. */
void bg_add_rms_norm(void *out, void *residual, const void *x, const void *weight, int num_rows,
                     int hidden, float eps, int dtype, int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    float weight_buf[hidden];
    const float *w = as_float(weight, weight_buf, hidden, is_bf16);
    int is_parallel = num_threads > 1 && (int64_t)num_rows * hidden >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int r = 0; r < num_rows; r++) {
        void *out_row = row_at(out, r, hidden, is_bf16), *res_row = row_at(residual, r, hidden, is_bf16);
        const void *x_row = x ? row_at(x, r, hidden, is_bf16) : NULL;
        add_rms_norm_row(out_row, res_row, x_row, w, hidden, eps, is_bf16);
    }
}

#ifdef HAS_ROW16
/* residual_row += x_row (rounded to dtype) when x_row is not NULL; then out = round(w * c * inv + b)
 * in float32, where c = residual - mean (NORM_LAYER) or residual (NORM_RMS_SCALED), and
 * inv = 1 / sqrt(mean(c^2) + eps); b is 0 when NULL; on 16 lanes (the sums in another order than
 * the portable loop's). `out` may be the residual row. */
static void add_norm_row(void *out, void *res_row, const void *x_row, const float *w, const float *b, int hidden,
                         float eps, int kind, int is_bf16) {
    __m512 sums = _mm512_setzero_ps();
    for (int i = 0; i < hidden; i += 16) {
        __m512 res = load16(res_row, i, hidden, is_bf16);
        if (x_row) {
            res = round16(_mm512_add_ps(res, load16(x_row, i, hidden, is_bf16)), is_bf16);
            store16(res_row, i, hidden, res, is_bf16);
        }
        sums = _mm512_add_ps(sums, res);
    }
    __m512 mean = _mm512_set1_ps(kind == NORM_LAYER ? _mm512_reduce_add_ps(sums) / (float)hidden : 0.0f);
    __m512 squares = _mm512_setzero_ps();
    for (int i = 0; i < hidden; i += 16) {
        __m512 centered = _mm512_maskz_sub_ps(lanes_before(i, hidden), load16(res_row, i, hidden, is_bf16), mean);
        squares = _mm512_add_ps(squares, _mm512_mul_ps(centered, centered));
    }
    __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps));
    for (int i = 0; i < hidden; i += 16) {
        __mmask16 lanes = lanes_before(i, hidden);
        __m512 centered = _mm512_sub_ps(load16(res_row, i, hidden, is_bf16), mean);
        __m512 normed = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, w + i), _mm512_mul_ps(centered, inverse));
        if (b) normed = _mm512_add_ps(normed, _mm512_maskz_loadu_ps(lanes, b + i));
        store16(out, i, hidden, normed, is_bf16);
    }
}
#else
/* residual_row += x_row (rounded to dtype) when x_row is not NULL; then out = round(w * c * inv + b)
 * in float32, where c = residual - mean (NORM_LAYER) or residual (NORM_RMS_SCALED), and
 * inv = 1 / sqrt(mean(c^2) + eps); b is 0 when NULL. `out` may be the residual row. */
static void add_norm_row(void *out, void *res_row, const void *x_row, const float *w, const float *b, int hidden,
                         float eps, int kind, int is_bf16) {
    float sum_buf[hidden], add_buf[hidden], out_buf[hidden];
    const float *res = add_residual(res_row, x_row, sum_buf, add_buf, hidden, is_bf16);
    float mean = 0.0f;
    if (kind == NORM_LAYER) {
#pragma omp simd reduction(+ : mean)
        for (int i = 0; i < hidden; i++) mean += res[i];
        mean /= (float)hidden;
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int i = 0; i < hidden; i++) squares += (res[i] - mean) * (res[i] - mean);
    float inverse = 1.0f / sqrtf(squares / (float)hidden + eps);
    for (int i = 0; i < hidden; i++) out_buf[i] = w[i] * ((res[i] - mean) * inverse) + (b ? b[i] : 0.0f);
    store_row(out, out_buf, hidden, is_bf16);
}
#endif

/* add_norm_row for every row; weight and bias (or NULL) are float32. */
void bg_add_norm(void *out, void *residual, const void *x, const float *weight, const float *bias, int num_rows,
                 int hidden, float eps, int kind, int dtype, int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    int is_parallel = num_threads > 1 && (int64_t)num_rows * hidden >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int r = 0; r < num_rows; r++) {
        void *out_row = row_at(out, r, hidden, is_bf16), *res_row = row_at(residual, r, hidden, is_bf16);
        const void *x_row = x ? row_at(x, r, hidden, is_bf16) : NULL;
        add_norm_row(out_row, res_row, x_row, weight, bias, hidden, eps, kind, is_bf16);
    }
}

/* x * cos + rotate_half(x) * sin on a head's first rotary_dim dims (rotate_half(x) = [-x2, x1]),
 * each product rounded to dtype as transformers' tensor ops round them; the other dims copied. */
static inline void rotate_head(float *restrict dst, const float *restrict x, const float *restrict cos,
                               const float *restrict sin, int head_dim, int rotary_dim, int is_bf16) {
    int half = rotary_dim / 2;
    for (int i = 0; i < half; i++)
        dst[i] = round_to(x[i] * cos[i], is_bf16) + round_to(-x[i + half] * sin[i], is_bf16);
    for (int i = half; i < rotary_dim; i++)
        dst[i] = round_to(x[i] * cos[i], is_bf16) + round_to(x[i - half] * sin[i], is_bf16);
    for (int i = rotary_dim; i < head_dim; i++) dst[i] = x[i];
}

/* One RMSNorm of `n` values in place (see QKNorm). */
static void rms_norm_in_place(float *x, const float *w, int n, const QKNorm *norm, int is_bf16) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int i = 0; i < n; i++) squares += x[i] * x[i];
    float inverse = 1.0f / sqrtf(squares / (float)n + norm->eps);
    if (norm->kind == QK_NORM_RMS)
        for (int i = 0; i < n; i++) x[i] = round_to(w[i] * round_to(x[i] * inverse, is_bf16), is_bf16);
    else
        for (int i = 0; i < n; i++) x[i] = round_to(w[i] * (x[i] * inverse), is_bf16);
}

/* The q and k heads of one qkv row, normalized (`norm`) then rotated in their first rotary_dim
 * dims, into q_row and k_row. */
static void rotate_heads(void *q_row, void *k_row, const void *x_row, const void *cos_row, const void *sin_row,
                         int num_heads, int num_kv_heads, int head_dim, int rotary_dim, const QKNorm *norm,
                         int is_bf16) {
    int q_width = num_heads * head_dim, qk_width = (num_heads + num_kv_heads) * head_dim;
    int cos_width = rotary_dim > 0 ? rotary_dim : 1;
    float row_buf[qk_width], cos_buf[cos_width], sin_buf[cos_width], rotated[qk_width];
    const float *x = as_float(x_row, row_buf, qk_width, is_bf16);
    if (norm->q) {
        if (x != row_buf) memcpy(row_buf, x, sizeof(float) * (size_t)qk_width);
        int q_step = norm->width ? norm->width : q_width, k_step = norm->width ? norm->width : qk_width - q_width;
        for (int i = 0; i < q_width; i += q_step) rms_norm_in_place(row_buf + i, norm->q, q_step, norm, is_bf16);
        for (int i = q_width; i < qk_width; i += k_step) rms_norm_in_place(row_buf + i, norm->k, k_step, norm, is_bf16);
        x = row_buf;
    }
    const float *c = rotary_dim ? as_float(cos_row, cos_buf, rotary_dim, is_bf16) : cos_buf;
    const float *s = rotary_dim ? as_float(sin_row, sin_buf, rotary_dim, is_bf16) : sin_buf;
    for (int h = 0; h < num_heads + num_kv_heads; h++)
        rotate_head(rotated + h * head_dim, x + h * head_dim, c, s, head_dim, rotary_dim, is_bf16);
    store_row(q_row, rotated, q_width, is_bf16);
    store_row(k_row, rotated + q_width, qk_width - q_width, is_bf16);
}

/* qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] (q heads, then k, then v);
 * cos/sin: [num_tokens, rotary_dim] (rotary_dim even, at most head_dim; 0: no rotation);
 * slots: [num_tokens] int64; q_norm / k_norm, norm_width, norm_kind, eps: the QKNorm (q_norm NULL:
 * none). Writes q_out [num_tokens, num_heads, head_dim] and k_out [num_tokens, num_kv_heads,
 * head_dim] (normalized, rotated), and stores that k and plain v at k_cache/v_cache row `slots[t]`
 * ([num_slots, num_kv_heads, head_dim]). */
void bg_rope_write_kv(void *q_out, void *k_out, void *k_cache, void *v_cache, const void *qkv,
                      const void *cos, const void *sin, const int64_t *slots, int num_tokens, int num_heads,
                      int num_kv_heads, int head_dim, int rotary_dim, const float *q_norm, const float *k_norm,
                      int norm_width, int norm_kind, float eps, int dtype, int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    QKNorm norm = {q_norm, k_norm, norm_width, norm_kind, eps};
    int64_t width = (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
    int qk_width = (num_heads + num_kv_heads) * head_dim, kv_width = num_kv_heads * head_dim;
    size_t element = is_bf16 ? 2 : 4;
    int is_parallel = num_threads > 1 && (int64_t)num_tokens * width >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        const char *row = row_at(qkv, t, width, is_bf16);
        void *q_row = row_at(q_out, t, num_heads * head_dim, is_bf16), *k_row = row_at(k_out, t, kv_width, is_bf16);
        const void *cos_row = row_at(cos, t, rotary_dim, is_bf16), *sin_row = row_at(sin, t, rotary_dim, is_bf16);
#ifdef HAS_ROW16
        if (head_dim % 32 == 0 && rotary_dim == head_dim && (!q_norm || norm_width == head_dim))
            rotate_heads16(q_row, k_row, row, cos_row, sin_row, num_heads, num_kv_heads, head_dim, &norm, is_bf16);
        else
#endif
            rotate_heads(q_row, k_row, row, cos_row, sin_row, num_heads, num_kv_heads, head_dim, rotary_dim, &norm,
                         is_bf16);
        memcpy(row_at(k_cache, slots[t], kv_width, is_bf16), k_row, kv_width * element);
        memcpy(row_at(v_cache, slots[t], kv_width, is_bf16), row + qk_width * element, kv_width * element);
    }
}

#ifndef HAS_ROW16
/* out = round(silu(gate)) * up for one gate|up row of 2 * width. */
static void silu_mul_row(void *out, const void *gate_up, int width, int is_bf16) {
    float row_buf[2 * width], out_buf[width];
    const float *row = as_float(gate_up, row_buf, 2 * width, is_bf16);
    for (int i = 0; i < width; i++) {
        float gate = row[i];
        out_buf[i] = round_to(gate / (1.0f + vector_expf(-gate)), is_bf16) * row[width + i];
    }
    store_row(out, out_buf, width, is_bf16);
}

#endif

/* gate_up: [num_rows, 2 * width] (gate, then up); out: [num_rows, width] =
 * round(silu(gate)) * up. */
typedef void GatedRow(void *out, const void *gate_up, int width, int is_bf16);

/* row(out row r, gate|up row r) for every row r of [num_rows, 2 * width] gate_up, rows in parallel
 * where the step is large enough. */
static void each_gated_row(GatedRow *row, void *out, const void *gate_up, int num_rows, int width, int dtype,
                           int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    int is_parallel = num_threads > 1 && (int64_t)num_rows * width >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int r = 0; r < num_rows; r++)
        row(row_at(out, r, width, is_bf16), row_at(gate_up, r, 2 * (int64_t)width, is_bf16), width, is_bf16);
}

void bg_silu_mul(void *out, const void *gate_up, int num_rows, int width, int dtype, int num_threads) {
    each_gated_row(silu_mul_row, out, gate_up, num_rows, width, dtype, num_threads);
}

#ifdef HAS_ROW16
/* out = round(round(up' + 1) * round(g * round(sigmoid(round(alpha * g))))) for one gate|up row of
 * 2 * width, where g = min(gate, limit) and up' = clamp(up, -limit, limit), on 16 lanes: the
 * portable loop's operations and roundings (a NaN gate gives g = limit, a NaN up stays NaN). */
static void clamped_glu_row(void *out, const void *gate_up, int width, float alpha, float limit, int is_bf16) {
    const char *up_row = (const char *)row_at(gate_up, 1, width, is_bf16);
    const __m512 high = _mm512_set1_ps(limit), low = _mm512_set1_ps(-limit), one = _mm512_set1_ps(1.0f);
    const __m512 scale = _mm512_set1_ps(alpha);
    const __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u);
    for (int i = 0; i < width; i += 16) {
        __m512 gate = _mm512_min_ps(load16(gate_up, i, width, is_bf16), high);
        __m512 up = _mm512_max_ps(low, _mm512_min_ps(high, load16(up_row, i, width, is_bf16)));
        __m512 scaled = round16(_mm512_mul_ps(gate, scale), is_bf16);
        __m512 negated = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(scaled), sign_bit));
        __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, expf16(negated)));
        __m512 glu = round16(_mm512_mul_ps(gate, round16(sigmoid, is_bf16)), is_bf16);
        store16(out, i, width, _mm512_mul_ps(round16(_mm512_add_ps(up, one), is_bf16), glu), is_bf16);
    }
}
#else
/* out = round(round(up' + 1) * round(g * round(sigmoid(round(alpha * g))))) for one gate|up row of
 * 2 * width, where g = min(gate, limit) and up' = clamp(up, -limit, limit): each product rounded to
 * dtype as gpt-oss' tensor ops round it. */
static void clamped_glu_row(void *out, const void *gate_up, int width, float alpha, float limit, int is_bf16) {
    float row_buf[2 * width], out_buf[width];
    const float *row = as_float(gate_up, row_buf, 2 * width, is_bf16);
    for (int i = 0; i < width; i++) {
        float gate = row[i] < limit ? row[i] : limit, up = clamp(row[width + i], -limit, limit);
        float scaled = round_to(gate * alpha, is_bf16);
        float glu = round_to(gate * round_to(1.0f / (1.0f + vector_expf(-scaled)), is_bf16), is_bf16);
        out_buf[i] = round_to(up + 1.0f, is_bf16) * glu;
    }
    store_row(out, out_buf, width, is_bf16);
}
#endif

/* gate_up: [num_rows, 2 * width] (gate, then up); out: [num_rows, width] (clamped_glu_row). */
void bg_clamped_glu(void *out, const void *gate_up, int num_rows, int width, float alpha, float limit, int dtype,
                    int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    int is_parallel = num_threads > 1 && (int64_t)num_rows * width >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int r = 0; r < num_rows; r++)
        clamped_glu_row(row_at(out, r, width, is_bf16), row_at(gate_up, r, 2 * (int64_t)width, is_bf16), width, alpha,
                        limit, is_bf16);
}

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2 |x|), through vector_expf, so loops calling it
 * vectorize; within a few ulp of tanhf. */
static inline float vector_tanhf(float x) {
    float e = vector_expf(-2.0f * fabsf(x));
    return copysignf((1.0f - e) / (1.0f + e), x);
}

#ifdef HAS_ROW16
/* GPT-2's tanh GELU of `count` elements of x into out (out may be x), on 16 lanes: the portable
 * loop's operations and roundings in its order. */
static void gelu_new_part(void *out, const void *x, int count, int is_bf16) {
    const __m512 root = _mm512_set1_ps(0.7978845608028654f), cubic = _mm512_set1_ps(0.044715f);
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < count; i += 16) {
        __m512 v = load16(x, i, count, is_bf16);
        __m512 cube = round16(_mm512_mul_ps(round16(_mm512_mul_ps(v, v), is_bf16), v), is_bf16);
        __m512 inner = round16(_mm512_add_ps(v, round16(_mm512_mul_ps(cubic, cube), is_bf16)), is_bf16);
        __m512 tanh = round16(tanh16(round16(_mm512_mul_ps(root, inner), is_bf16)), is_bf16);
        __m512 halved = round16(_mm512_mul_ps(half, v), is_bf16);
        store16(out, i, count, _mm512_mul_ps(halved, round16(_mm512_add_ps(one, tanh), is_bf16)), is_bf16);
    }
}
#else
/* GPT-2's tanh GELU of `count` elements of x into out (out may be x), each step rounded to dtype
 * as transformers' NewGELUActivation's tensor ops round it. */
static void gelu_new_part(void *out, const void *x, int count, int is_bf16) {
    const float root = 0.7978845608028654f; /* sqrt(2 / pi) */
    float buf[count], result[count];
    const float *v = as_float(x, buf, count, is_bf16);
    for (int i = 0; i < count; i++) {
        float cube = round_to(round_to(v[i] * v[i], is_bf16) * v[i], is_bf16); /* torch.pow(x, 3): x * x, then * x */
        float inner = round_to(v[i] + round_to(0.044715f * cube, is_bf16), is_bf16);
        float tanh = round_to(vector_tanhf(round_to(root * inner, is_bf16)), is_bf16);
        result[i] = round_to(0.5f * v[i], is_bf16) * round_to(1.0f + tanh, is_bf16);
    }
    store_row(out, result, count, is_bf16);
}
#endif

/* out = GPT-2's tanh GELU of x (n elements, out may be x), in parts of 4,096 (gelu_new_part). */
void bg_gelu_new(void *out, const void *x, int64_t n, int dtype, int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    int is_parallel = num_threads > 1 && n >= MIN_PARALLEL_ELEMENTS;
    int64_t step = 4096;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int64_t start = 0; start < n; start += step) {
        int count = (int)(n - start < step ? n - start : step);
        gelu_new_part(row_at(out, start, 1, is_bf16), row_at(x, start, 1, is_bf16), count, is_bf16);
    }
}

#ifdef HAS_ROW16
/* out = round(gelu_tanh(gate)) * up for one gate|up row of 2 * width, on 16 lanes: the portable
 * loop's operations in its order. */
static void gelu_tanh_mul_row(void *out, const void *gate_up, int width, int is_bf16) {
    const char *up = (const char *)row_at(gate_up, 1, width, is_bf16);
    for (int i = 0; i < width; i += 16)
        store16(out, i, width,
                gelu_tanh_mul16(load16(gate_up, i, width, is_bf16), load16(up, i, width, is_bf16), is_bf16), is_bf16);
}
#else
/* out = round(gelu_tanh(gate)) * up for one gate|up row of 2 * width: torch's tanh GELU in
 * float32, rounded once as torch rounds it, then the product. */
static void gelu_tanh_mul_row(void *out, const void *gate_up, int width, int is_bf16) {
    float row_buf[2 * width], out_buf[width];
    const float *row = as_float(gate_up, row_buf, 2 * width, is_bf16);
    const float root = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int i = 0; i < width; i++) {
        float x = row[i];
        float gelu = 0.5f * x * (1.0f + vector_tanhf(root * (x + 0.044715f * x * x * x)));
        out_buf[i] = round_to(gelu, is_bf16) * row[width + i];
    }
    store_row(out, out_buf, width, is_bf16);
}
#endif

/* gate_up: [num_rows, 2 * width] (gate, then up); out: [num_rows, width] (gelu_tanh_mul_row). */
void bg_gelu_tanh_mul(void *out, const void *gate_up, int num_rows, int width, int dtype, int num_threads) {
    each_gated_row(gelu_tanh_mul_row, out, gate_up, num_rows, width, dtype, num_threads);
}

/* expert_ids: [num_rows, k] int64, each below num_experts, a row's k distinct. The pairs (r, j)
 * sorted by expert, rows in order within an expert (a stable counting sort, as a stable argsort
 * of the flattened ids): counts[e] = the pairs of expert e; pair_rows[m] = the row of the m-th
 * pair in that order; positions[r * k + j] = m of pair (r, j). */
void bg_moe_route(const int64_t *expert_ids, int num_rows, int k, int num_experts, int64_t *counts,
                  int64_t *pair_rows, int64_t *positions) {
    int num_pairs = num_rows * k;
    int64_t next[num_experts];
    memset(counts, 0, sizeof(int64_t) * (size_t)num_experts);
    for (int p = 0; p < num_pairs; p++) counts[expert_ids[p]]++;
    for (int e = 0, start = 0; e < num_experts; start += (int)counts[e], e++) next[e] = start;
    for (int p = 0; p < num_pairs; p++) {
        int64_t m = next[expert_ids[p]]++;
        pair_rows[m] = p / k;
        positions[p] = m;
    }
}

/* order = the row's k slots by ascending position (expert order): an insertion sort. */
static void expert_order(const int64_t *positions, int k, int *order) {
    for (int j = 0; j < k; j++) {
        int i = j;
        for (; i > 0 && positions[order[i - 1]] > positions[j]; i--) order[i] = order[i - 1];
        order[i] = j;
    }
}

#ifdef HAS_ROW16
/* One row of bg_moe_combine: its k pairs' outputs (y rows `positions`, times `weights`) added in
 * expert order from 0, each product and sum rounded to dtype, on 16 lanes: the portable loop's
 * operations and roundings. */
static void moe_combine_row(void *out_row, const void *y, const int64_t *positions, const float *weights, int k,
                            int hidden, int is_bf16) {
    int order[k];
    expert_order(positions, k, order);
    for (int i = 0; i < hidden; i += 16) {
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < k; j++) {
            __m512 source = load16(row_at(y, positions[order[j]], hidden, is_bf16), i, hidden, is_bf16);
            __m512 scaled = round16(_mm512_mul_ps(source, _mm512_set1_ps(weights[order[j]])), is_bf16);
            sum = round16(_mm512_add_ps(sum, scaled), is_bf16);
        }
        store16(out_row, i, hidden, sum, is_bf16);
    }
}
#else
/* One row of bg_moe_combine: its k pairs' outputs (y rows `positions`, times `weights`) added in
 * expert order from 0, each product and sum rounded to dtype. */
static void moe_combine_row(void *out_row, const void *y, const int64_t *positions, const float *weights, int k,
                            int hidden, int is_bf16) {
    int order[k];
    expert_order(positions, k, order);
    float sum[hidden], buf[hidden];
    for (int i = 0; i < hidden; i++) sum[i] = 0.0f;
    for (int j = 0; j < k; j++) {
        const float *source = as_float(row_at(y, positions[order[j]], hidden, is_bf16), buf, hidden, is_bf16);
        float weight = weights[order[j]];
        for (int i = 0; i < hidden; i++) sum[i] = round_to(sum[i] + round_to(source[i] * weight, is_bf16), is_bf16);
    }
    store_row(out_row, sum, hidden, is_bf16);
}
#endif

/* y: [num_pairs, hidden] (expert outputs, pairs sorted by expert); positions: [num_rows, k] int64
 * (`bg_moe_route`'s: each (row, slot)'s pair); weights: [num_rows, k] float32. Row r < num_rows
 * of out [out_rows, hidden] = the sum of round(y[positions[r, j]] * weights[r, j]) over j, added
 * in expert order from 0 and rounded at each step, as transformers' loop over experts multiplies
 * then index_adds into zeros; rows from num_rows on are 0. Threads split the rows. */
void bg_moe_combine(void *out, const void *y, const int64_t *positions, const float *weights, int num_rows, int k,
                    int out_rows, int hidden, int dtype, int num_threads) {
    int is_bf16 = dtype == DTYPE_BF16;
    int is_parallel = num_threads > 1 && (int64_t)num_rows * k * hidden >= MIN_PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (is_parallel) schedule(static)
    for (int r = 0; r < num_rows; r++)
        moe_combine_row(row_at(out, r, hidden, is_bf16), y, positions + (int64_t)r * k, weights + (int64_t)r * k, k,
                        hidden, is_bf16);
    memset(row_at(out, num_rows, hidden, is_bf16), 0, (size_t)(out_rows - num_rows) * hidden * (is_bf16 ? 2 : 4));
}
