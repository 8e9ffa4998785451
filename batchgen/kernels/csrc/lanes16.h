/*
 * 16-lane float32 helpers on AVX-512 (F, BW, VL), shared by the kernels that must compute alike
 * (decoder_ops.c's gated activation passes and int8_gemm.c's gated epilogue give the same bits;
 * kv_int8_attention.c's block dequantize and amx_attention.c's staging of an int8 pool give the
 * same rows): bfloat16 conversions, an int8 K/V row's dequantization, a 16 x 16 dword transpose and
 * attention's 2^x (amx_attention.c, kv_int8_attention.c), exp, tanh, SiLU(gate) * up and
 * tanh-GELU(gate) * up. Include after immintrin.h, where those are enabled.
 */
#ifndef BATCHGEN_LANES16_H
#define BATCHGEN_LANES16_H

/* float_to_bf16 on 16 lanes: the CPU's convert instruction where it has one (it flushes subnormal
 * values, below 1.2e-38, to zero), else the same integer rounding. */
static inline __m256i to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, is_nan, bits, _mm512_set1_epi32(0x400000)); /* quiet NaN */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

/* 16 bfloat16 values as float32 (exact). */
static inline __m512 from_bf16x16(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* The 16 bfloat16 values at `at` (lanes in `mask`; the others 0) as float32. */
static inline __m512 load_bf16x16(const uint16_t *at, __mmask16 mask) {
    return from_bf16x16(_mm256_maskz_loadu_epi16(mask, at));
}

/* 16 int8 values of a K/V pool row times the row's scale, rounded to bfloat16 (kv_int8.dequantize). */
static inline __m256i dequantize16(const int8_t *values, __m512 scale) {
    __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)values)));
    return to_bf16x16(_mm512_mul_ps(x, scale));
}

/* v rounded to bfloat16 where is_bf16 (as float32), else v. */
static inline __m512 round16(__m512 v, int is_bf16) {
    return is_bf16 ? from_bf16x16(to_bf16x16(v)) : v;
}

/* 16 vectors of 16 dwords transposed in place: afterwards lane t of r[j] is what lane j of r[t]
 * was. Pairs of dwords, then of qwords, are interleaved within 128-bit lanes; then 128-bit lanes
 * are gathered across vectors. */
static inline void transpose_dwords(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* b[4i + m]: lane L holds rows 4i .. 4i + 3's dword 4L + m */
    for (int i = 0; i < 16; i += 4) {
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

/* 2^x for 16 finite floats: x = n + f with n = floor(x) and 0 <= f < 1 (vreduceps), 2^f by a
 * degree-3 polynomial fitted for relative error (< 7.5e-5, far below the bf16 rounding of
 * attention's probabilities and the 8-bit rounding of the int8 K/V cache's weights), times 2^n
 * exactly (vscalefps floors x itself; 0 far below the float range). */
static inline __m512 exp2_16(__m512 x) {
    __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 poly = _mm512_set1_ps(0.0780244916677475f);
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.2260672003030777f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.6958335041999817f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.9999251961708069f));
    return _mm512_scalef_ps(poly, x);
}

/* exp(x) on 16 lanes within 2 ulp of expf, half the operations of vector_expf: x = n ln2 + r
 * (n an integer, |r| <= ln2 / 2, Cody-Waite with fused multiply-adds), e^r by its degree-6 Taylor
 * polynomial, times 2^n exactly (scalef: 0 below the float range, inf above it). NaN stays NaN. */
static inline __m512 expf16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    static const float coefficients[] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m512 poly = _mm512_set1_ps(1.0f / 720);
    for (int c = 0; c < 6; c++) poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(coefficients[c]));
    return _mm512_scalef_ps(poly, n);
}

/* round(silu(gate)) * up (silu rounded to bfloat16 where is_bf16), unrounded. */
static inline __m512 silu_mul16(__m512 gate, __m512 up, int is_bf16) {
    __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 negated = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gate), sign));
    __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), expf16(negated)));
    return _mm512_mul_ps(round16(silu, is_bf16), up);
}

/* tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|), on 16 lanes (vector_tanhf's steps). */
static inline __m512 tanh16(__m512 y) {
    __m512 magnitude = _mm512_abs_ps(y);
    __m512 e = expf16(_mm512_mul_ps(magnitude, _mm512_set1_ps(-2.0f)));
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 result = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(result), sign));
}

/* round(gelu_tanh(gate)) * up (the GELU rounded to bfloat16 where is_bf16), unrounded: torch's tanh
 * GELU, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in float32. */
static inline __m512 gelu_tanh_mul16(__m512 gate, __m512 up, int is_bf16) {
    const __m512 root = _mm512_set1_ps(0.7978845608028654f), cubic = _mm512_set1_ps(0.044715f);
    __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(cubic, gate), gate), gate);
    __m512 tanh = tanh16(_mm512_mul_ps(root, _mm512_add_ps(gate, cube)));
    __m512 gelu = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), gate), _mm512_add_ps(_mm512_set1_ps(1.0f), tanh));
    return _mm512_mul_ps(round16(gelu, is_bf16), up);
}

#endif
