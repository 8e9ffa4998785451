/*
 * Scalar helpers written so that the loops calling them vectorize: bfloat16 conversions,
 * a clamp and an exp without branches or libm calls. Included by every kernel source.
 */
#ifndef BATCHGEN_VECTOR_MATH_H
#define BATCHGEN_VECTOR_MATH_H

#include <stdint.h>

#define LOG2E 1.4426950408889634f /* log2(e): scores in log2 units take exp2 */

typedef union {
    float f;
    uint32_t u;
} Bits;

/* bfloat16 bits -> float32 (exact). */
static inline float bf16_to_float(uint16_t x) {
    Bits b = {.u = (uint32_t)x << 16};
    return b.f;
}

/* float32 -> bfloat16 bits, rounding to nearest even; NaN stays NaN. Branch-free, so loops
 * calling it vectorize. */
static inline uint16_t float_to_bf16(float x) {
    Bits b = {.f = x};
    uint32_t rounded = (b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (b.u >> 16) | 0x40u;
    uint32_t is_nan = -(uint32_t)((b.u & 0x7fffffffu) > 0x7f800000u);
    return (uint16_t)((quiet_nan & is_nan) | (rounded & ~is_nan));
}

/* x clamped to [lo, hi] by bit selects (a float compare-and-branch keeps the loop scalar). */
static inline float clamp(float x, float lo, float hi) {
    Bits v = {.f = x}, low = {.f = lo}, high = {.f = hi};
    uint32_t below = -(uint32_t)(x < lo), above = -(uint32_t)(x > hi);
    v.u = (v.u & ~below) | (low.u & below);
    v.u = (v.u & ~above) | (high.u & above);
    return v.f;
}

/* exp(x) in float32 within a few ulp (Cephes' range reduction and polynomial), written so the
 * loops that call it vectorize (libm's expf is one call per element). */
static inline float vector_expf(float x) {
    x = clamp(x, -87.0f, 88.0f);
    float n = (float)(int32_t)(x * 1.44269504088896341f + 88.5f) - 88.0f; /* round(x / ln 2) */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    Bits scale = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return p * scale.f;
}

#endif
