/* Scalar and AVX-512 helpers shared by the C kernels (paged_attention.c, prefill_attention.c,
 * step_ops.c, lora.c): bf16 <-> float32 (round to nearest even, NaN kept), a vectorizable exp (and
 * its x <= 0 form for softmax exponents), the attention-logit soft cap (tanh) and the attention-sink
 * fold. */
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

/* exp(x) for any float: 2^(x log2 e) = 2^n * 2^f, a degree-6 polynomial for 2^f on [-0.5, 0.5]
 * (relative error ~2e-7). Below 2^-126 it stays at 2^-126; from 2^127.5 it is inf (n = 128 makes
 * the exponent field all ones), as expf overflows, so silu of a very negative gate is -0 as in torch. */
static inline float exp_approx(float x) {
    float t = x * 1.44269504088896341f;
    t = t < -126.f ? -126.f : (t > 128.f ? 128.f : t);
    const float fn = __builtin_rintf(t);
    const float f = t - fn;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } s;
    s.i = ((int32_t)fn + 127) << 23;
    return p * s.f;
}

/* exp(x) for x <= 0 (scores minus their max), vectorizable; x < -87 gives 0 (a softmax weight that
 * small is nothing, where exp_approx would stop at 2^-126). */
static inline float exp_le0(float x) {
    const float r = exp_approx(x);
    return x < -87.f ? 0.f : r;
}

static inline void exp_tile(float *restrict x, int n) {
    for (int i = 0; i < n; i++) x[i] = exp_le0(x[i]);
}

/* Attention-logit soft cap, cap * tanh(s / cap), with -inf (masked) kept -inf. tanh as Cephes' tanhf
 * (relative error ~1e-7): an odd polynomial below |x| = 0.625, where (1 - e) / (1 + e) with
 * e = exp(-2|x|) would lose digits to cancellation, and that quotient above it (e <= 0.29 there, so
 * exp_le0's range suffices). Branch-free so the loops over a tile vectorize. */
static inline float softcap1(float s, float cap, float inv_cap) {
    const float x = s * inv_cap, a = fabsf(x), z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const float small = p * z * x + x;
    const float e = exp_le0(-2.f * a);
    const float large = copysignf((1.f - e) / (1.f + e), x);
    const float t = a < 0.625f ? small : large;
    return s == -INFINITY ? s : cap * t;
}

static inline void softcap_tile(float *restrict x, int n, float cap) {
    const float inv = 1.f / cap;
    for (int i = 0; i < n; i++) x[i] = softcap1(x[i], cap, inv);
}

/* Fold an attention sink (a logit with no value, gpt-oss) into a finished softmax of running max m and
 * sum l: returns the factor the unnormalized outputs take, exp(m - M) / (l exp(m - M) + exp(sink - M))
 * with M = max(m, sink) so neither exponent overflows; 0 when nothing is visible (l = 0). */
static inline float sink_factor(float m, float l, float sink) {
    if (!(l > 0.f)) return 0.f;
    const float M = m > sink ? m : sink;
    const float w = expf(m - M);
    return w / (l * w + expf(sink - M));
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 2^f for f in [-0.5, 0.5], exp_approx's polynomial on 16 lanes. */
static inline __m512 exp2_poly16(__m512 f) {
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    return _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
}

/* exp_approx on 16 lanes. */
static inline __m512 vexp(__m512 x) {
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-126.f)), _mm512_set1_ps(128.f));
    const __m512 fn = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 p = exp2_poly16(_mm512_sub_ps(t, fn));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fn), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* exp_le0 on 16 lanes. */
static inline __m512 exp16(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    return _mm512_maskz_mov_ps((__mmask16)~under, vexp(x));
}

/* softcap1 on 16 lanes: the same polynomial, quotient and -inf rule. */
static inline __m512 softcap16(__m512 s, __m512 cap, __m512 inv_cap) {
    const __m512 x = _mm512_mul_ps(s, inv_cap), a = _mm512_abs_ps(x), z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 q = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    /* copysign: the sign bit of x onto the (non-negative) quotient. */
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    const __m512 large = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(q), sign));
    const __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
    const __mmask16 dead = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    const __m512 t = _mm512_mask_mov_ps(large, is_small, small);
    return _mm512_mask_mov_ps(_mm512_mul_ps(cap, t), dead, s);
}

/* 16 vectors -> one vector of their 16 horizontal reductions (lane i = OP over v[i]'s lanes), by a
 * transpose-and-reduce tree: 45 shuffles and OPs where 16 separate reductions take about 130. */
#define DEFINE_REDUCE16(NAME, OP)                                                                      \
    static inline __m512 NAME(const __m512 *v) {                                                       \
        __m512 a[8], b[4], c[2];                                                                       \
        for (int i = 0; i < 8; i++)                                                                    \
            a[i] = OP(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1])); \
        for (int i = 0; i < 4; i++) {                                                                  \
            __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);                \
            b[i] = OP(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y))); \
        }                                                                                              \
        /* b[i], 128-bit lane L, element e: partial (lane L) result of vector 4i + e. */               \
        for (int i = 0; i < 2; i++)                                                                    \
            c[i] = OP(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),                              \
                      _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));                             \
        return OP(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));     \
    }
DEFINE_REDUCE16(sum16, _mm512_add_ps)
DEFINE_REDUCE16(max16, _mm512_max_ps)

#endif
#endif
