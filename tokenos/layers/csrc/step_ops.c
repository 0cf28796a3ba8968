/* The small per-layer operations of a step, fused: residual add + RMSNorm, SiLU-and-mul, and rotary
 * embedding in place. Each is a handful of eager torch ops (one pass over memory, one dispatch and
 * one temporary each); at decode sizes (tens of rows) that overhead is most of their time.
 *
 * Every result is rounded exactly where the torch reference rounds (tokenos/layers/layernorm.py,
 * activation.py, rotary.py, the way transformers computes them), so greedy tokens do not move: for
 * bf16, each torch op computes in float32 and rounds its result to bf16 (round to nearest even);
 * we do the same op by op. Sums are float32 (their order differs from torch's, by an ulp at most).
 *
 * Rows are contiguous [rows, width]; rotary takes a token stride, since q and k are views into the
 * fused qkv projection's output. */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

typedef uint16_t bf16;

/* Rounding of a float32 result to the tensor's dtype: none for float32. */
static inline float round_f32(float f) { return f; }
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static inline float load_f32(const float *p) { return *p; }
static inline float load_bf16(const bf16 *p) { return bf16_to_f32(*p); }
static inline void store_f32(float *p, float f) { *p = f; }
static inline void store_bf16(bf16 *p, float f) { *p = f32_to_bf16(f); }

/* Parallel only where the work pays for waking the threads (about a microsecond). A norm's rows mostly
 * come from a GEMM whose column halves sit in the two threads' caches, so it splits from a batch-64
 * decode's 64 x 576; rotary's elements are rotated pairs, each several times a norm's or silu's element. */
#define PARALLEL_MIN_ELEMENTS (1 << 16)
#define NORM_PARALLEL_MIN_ELEMENTS (1 << 13)
#define ROTARY_PARALLEL_MIN_PAIRS (1 << 12)

/* out = norm(h) with h = x (+ residual); residual_out = h. float32: F.rms_norm, weight applied in
 * float32. bf16: h rounded (the add), normalized in float32, rounded, times the weight, rounded. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                              \
void NAME(const T *x, const T *residual, const T *weight, T *out, T *residual_out, int64_t rows,  \
          int hidden, float eps) {                                                                 \
    _Pragma("omp parallel for schedule(static) if (rows * hidden >= NORM_PARALLEL_MIN_ELEMENTS)") \
    for (int64_t r = 0; r < rows; r++) {                                                           \
        const T *xr = x + r * hidden;                                                              \
        float h[hidden];                                                                           \
        float ss = 0.f;                                                                            \
        if (residual) {                                                                            \
            const T *rr = residual + r * hidden;                                                   \
            T *ro = residual_out + r * hidden;                                                     \
            for (int i = 0; i < hidden; i++) {                                                     \
                h[i] = ROUND(LOAD(xr + i) + LOAD(rr + i));                                         \
                STORE(ro + i, h[i]);                                                               \
            }                                                                                      \
        } else {                                                                                   \
            for (int i = 0; i < hidden; i++) h[i] = LOAD(xr + i);                                  \
        }                                                                                          \
        for (int i = 0; i < hidden; i++) ss += h[i] * h[i];                                        \
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);                                   \
        T *o = out + r * hidden;                                                                   \
        for (int i = 0; i < hidden; i++) STORE(o + i, ROUND(h[i] * inv) * LOAD(weight + i));       \
    }                                                                                              \
}

/* out[r] = silu(x[r, :d]) * x[r, d:]; the silu and the product each rounded (two torch ops). */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                                          \
void NAME(const T *x, T *out, int64_t rows, int d) {                                               \
    _Pragma("omp parallel for schedule(static) if (rows * d >= PARALLEL_MIN_ELEMENTS)")           \
    for (int64_t r = 0; r < rows; r++) {                                                           \
        const T *gate = x + r * 2 * d, *up = gate + d;                                             \
        T *o = out + r * d;                                                                        \
        for (int i = 0; i < d; i++) {                                                              \
            const float g = LOAD(gate + i);                                                        \
            const float s = ROUND(g / (1.f + exp_approx(-g)));                                     \
            STORE(o + i, s * LOAD(up + i));                                                        \
        }                                                                                          \
    }                                                                                              \
}

/* Rotary over every token of q and of k, around the per-token rotation NAME##_token that each definition
 * of DEFINE_ROTARY below (scalar, AVX-512) writes. */
#define DEFINE_ROTARY_CALLS(NAME, T)                                                              \
static void NAME##_one(T *x, int64_t stride, int heads, int head_dim, int half, const T *cos,      \
                       const T *sin, int64_t tokens) {                                             \
    _Pragma("omp parallel for schedule(static) if (tokens * heads * half >= ROTARY_PARALLEL_MIN_PAIRS)") \
    for (int64_t t = 0; t < tokens; t++)                                                           \
        NAME##_token(x + t * stride, heads, head_dim, half, cos + t * half, sin + t * half);       \
}                                                                                                  \
void NAME(T *q, int64_t q_stride, int q_heads, T *k, int64_t k_stride, int k_heads, int head_dim, \
          int rotary_dim, const T *cos, const T *sin, int64_t tokens) {                            \
    NAME##_one(q, q_stride, q_heads, head_dim, rotary_dim / 2, cos, sin, tokens);                 \
    NAME##_one(k, k_stride, k_heads, head_dim, rotary_dim / 2, cos, sin, tokens);                 \
}

/* In place, NeoX halves: over the first rotary_dim of each head, (x1, x2) -> (x1 c - x2 s,
 * x2 c + x1 s) with every product and sum rounded, as the torch ops do. x is [tokens, heads,
 * head_dim] with a token stride; cos and sin are this step's [tokens, rotary_dim / 2], already in
 * the dtype (gathered once per step for every layer). */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                                \
void NAME##_token(T *x, int heads, int head_dim, int half, const T *c, const T *s) {               \
    for (int h = 0; h < heads; h++) {                                                              \
        T *x1 = x + (int64_t)h * head_dim, *x2 = x1 + half;                                        \
        for (int i = 0; i < half; i++) {                                                           \
            const float ci = LOAD(c + i), si = LOAD(s + i);                                        \
            const float a = LOAD(x1 + i), b = LOAD(x2 + i);                                        \
            STORE(x1 + i, ROUND(a * ci) - ROUND(b * si));                                          \
            STORE(x2 + i, ROUND(b * ci) + ROUND(a * si));                                          \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
DEFINE_ROTARY_CALLS(NAME, T)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The same operations 16 lanes at a time (the scalar code above is what a CPU without AVX-512
 * runs); a masked final vector takes the remainder. */
#include <immintrin.h>

static inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
/* Masked memory access only for a final partial vector: masked stores are slow on AMD Zen 4. */
static inline __m512 vload_f32(const float *p, __mmask16 m) {
    return m == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}
static inline __m512 widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 vload_bf16(const bf16 *p, __mmask16 m) {
    return widen16(m == 0xffff ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p));
}
#ifdef __AVX512BF16__
/* vcvtneps2bf16: round to nearest even, NaN stays NaN, in one instruction. */
static inline __m256i narrow16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
static inline __m256i narrow16(__m512 v) { /* f32_to_bf16 on 16 lanes */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    /* The low halves of the 16 words, by a word permute: vpmovdw, which the compiler would fuse
     * with a masked store, is microcoded and several times slower on AMD Zen 4. */
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi16(even, r));
}
#endif
static inline void vstore_f32(float *p, __m512 v, __mmask16 m) {
    if (m == 0xffff) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, m, v);
}
static inline void vstore_bf16(bf16 *p, __m512 v, __mmask16 m) {
    if (m == 0xffff) _mm256_storeu_si256((__m256i *)p, narrow16(v));
    else _mm256_mask_storeu_epi16(p, m, narrow16(v));
}
static inline __m512 vround_f32(__m512 v) { return v; }
static inline __m512 vround_bf16(__m512 v) { return widen16(narrow16(v)); }


#undef DEFINE_RMS_NORM
#undef DEFINE_SILU_AND_MUL
#undef DEFINE_ROTARY

#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                              \
void NAME(const T *x, const T *residual, const T *weight, T *out, T *residual_out, int64_t rows,  \
          int hidden, float eps) {                                                                 \
    _Pragma("omp parallel for schedule(static) if (rows * hidden >= NORM_PARALLEL_MIN_ELEMENTS)") \
    for (int64_t r = 0; r < rows; r++) {                                                           \
        const T *xr = x + r * hidden;                                                              \
        float h[hidden + 16];                                                                      \
        __m512 ss = _mm512_setzero_ps();                                                           \
        for (int i = 0; i < hidden; i += 16) {                                                     \
            const __mmask16 m = lanes(hidden - i);                                                 \
            __m512 v = v##LOAD(xr + i, m);                                                         \
            if (residual) {                                                                        \
                v = v##ROUND(_mm512_add_ps(v, v##LOAD(residual + r * hidden + i, m)));             \
                v##STORE(residual_out + r * hidden + i, v, m);                                     \
            }                                                                                      \
            _mm512_storeu_ps(h + i, v);                                                            \
            ss = _mm512_fmadd_ps(v, v, ss);                                                        \
        }                                                                                          \
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hidden + eps)); \
        for (int i = 0; i < hidden; i += 16) {                                                     \
            const __mmask16 m = lanes(hidden - i);                                                 \
            const __m512 n = v##ROUND(_mm512_mul_ps(_mm512_loadu_ps(h + i), inv));                 \
            v##STORE(out + r * hidden + i, _mm512_mul_ps(n, v##LOAD(weight + i, m)), m);           \
        }                                                                                          \
    }                                                                                              \
}

#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                                          \
void NAME(const T *x, T *out, int64_t rows, int d) {                                               \
    _Pragma("omp parallel for schedule(static) if (rows * d >= PARALLEL_MIN_ELEMENTS)")           \
    for (int64_t r = 0; r < rows; r++) {                                                           \
        const T *gate = x + r * 2 * d, *up = gate + d;                                             \
        for (int i = 0; i < d; i += 16) {                                                          \
            const __mmask16 m = lanes(d - i);                                                      \
            const __m512 g = v##LOAD(gate + i, m);                                                 \
            const __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), g));                          \
            const __m512 s = v##ROUND(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));    \
            v##STORE(out + r * d + i, _mm512_mul_ps(s, v##LOAD(up + i, m)), m);                    \
        }                                                                                          \
    }                                                                                              \
}

#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                                \
void NAME##_token(T *x, int heads, int head_dim, int half, const T *c, const T *s) {               \
    for (int h = 0; h < heads; h++) {                                                              \
        T *x1 = x + (int64_t)h * head_dim, *x2 = x1 + half;                                        \
        for (int i = 0; i < half; i += 16) {                                                       \
            const __mmask16 m = lanes(half - i);                                                   \
            const __m512 ci = v##LOAD(c + i, m), si = v##LOAD(s + i, m);                           \
            const __m512 a = v##LOAD(x1 + i, m), b = v##LOAD(x2 + i, m);                           \
            v##STORE(x1 + i, _mm512_sub_ps(v##ROUND(_mm512_mul_ps(a, ci)),                         \
                                           v##ROUND(_mm512_mul_ps(b, si))), m);                    \
            v##STORE(x2 + i, _mm512_add_ps(v##ROUND(_mm512_mul_ps(b, ci)),                         \
                                           v##ROUND(_mm512_mul_ps(a, si))), m);                    \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
DEFINE_ROTARY_CALLS(NAME, T)
#endif

DEFINE_RMS_NORM(rms_norm_f32, float, load_f32, store_f32, round_f32)
DEFINE_RMS_NORM(rms_norm_bf16, bf16, load_bf16, store_bf16, round_bf16)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, load_f32, store_f32, round_f32)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, bf16, load_bf16, store_bf16, round_bf16)
DEFINE_ROTARY(rotary_f32, float, load_f32, store_f32, round_f32)
DEFINE_ROTARY(rotary_bf16, bf16, load_bf16, store_bf16, round_bf16)
