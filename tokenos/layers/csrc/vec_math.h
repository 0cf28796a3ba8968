/* Scalar and AVX-512 helpers shared by the C kernels (paged_attention.c, prefill_attention.c,
 * step_ops.c): bf16 <-> float32 (round to nearest even, NaN kept) and a vectorizable exp for x <= 0
 * (softmax exponents). */
#ifndef TOKENOS_VEC_MATH_H
#define TOKENOS_VEC_MATH_H
#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)h) << 16;
    return x.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } x;
    x.f = f;
    const uint32_t rounded = (x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16; /* nearest, ties to even */
    const uint32_t nan = (x.u >> 16) | 0x40u;                              /* stays a quiet NaN */
    return (uint16_t)((x.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* exp(x) for x <= 0 (scores minus their max), vectorizable: 2^(x log2 e) = 2^n * 2^f with a
 * degree-6 polynomial for 2^f on [-0.5, 0.5] (relative error ~2e-7); x < -87 gives 0. */
static inline void exp_tile(float *restrict x, int n) {
    for (int i = 0; i < n; i++) {
        float t = x[i] * 1.44269504088896341f;
        t = t < -126.f ? -126.f : t;
        float fn = __builtin_roundf(t);
        float f = t - fn;
        float p = 1.535336188319500e-4f;
        p = p * f + 1.339887440266574e-3f;
        p = p * f + 9.618437357674640e-3f;
        p = p * f + 5.550332471162809e-2f;
        p = p * f + 2.402264791363012e-1f;
        p = p * f + 6.931472028550421e-1f;
        p = p * f + 1.0f;
        union { int32_t i; float f; } s;
        s.i = ((int32_t)fn + 127) << 23;
        float r = p * s.f;
        x[i] = x[i] < -87.f ? 0.f : r;
    }
}

#ifdef __AVX512F__
#include <immintrin.h>

/* exp of 16 lanes (x <= 0), the same polynomial as exp_tile. */
static inline __m512 exp16(__m512 x) {
    __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.f));
    __m512 fn = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, fn);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fn), _mm512_set1_epi32(127)), 23);
    __m512 r = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    return _mm512_maskz_mov_ps((__mmask16)~under, r);
}

#endif
#endif
