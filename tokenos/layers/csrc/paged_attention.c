/* Paged decode attention for CPUs: one query token per request, keys and values read in place
 * from the paged KV cache (no gather, no padding), one pass over them (online softmax).
 *
 * Cache layout per layer (see tokenos/layers/attention.py): page b starts at element
 * b * page_stride; its K rows are [block_size, num_kv_heads, head_size], its V rows follow at
 * + block_size * num_kv_heads * head_size.
 *
 * Work items are (request, KV head, split): the query heads sharing a KV head (GQA) are processed
 * together, so each K and V row is read once; a long context is cut into splits (flash-decoding)
 * so that few long requests still keep every thread busy, and the splits are merged with their
 * log-sum-exp. Inside an item, tokens go in tiles of TILE: scores for the tile (K read once), an
 * online-softmax update with a vectorized exp, then the tile's V rows (read once) accumulate into
 * float32 outputs. bf16 rows are widened to float32 on the fly; every product and sum is float32.
 * fp8 pages (float8 e4m3fn bytes, the caller folding its per-tensor scales into `scale` and the
 * output) are widened the same way: exactly, by integer operations (portable path) or through
 * float16 and vcvtph2ps (AVX-512 path).
 *
 * The inner loops over the head dimension are plain C written for the compiler's vectorizer: the
 * library is compiled on first use with -march=native (see tokenos/layers/cpu_kernels.py), so they
 * become AVX-512, AVX2 or SSE code for the CPU it runs on. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "vec_math.h"

#define TILE 16
#define MAX_GROUP 16   /* query heads per KV head handled in one item */
#define MAX_HEAD 512   /* head sizes above this take the caller's fallback */

static inline void widen_f32(const float *restrict src, float *restrict dst, int d) {
    memcpy(dst, src, sizeof(float) * (size_t)d);
}

static inline void widen_bf16(const uint16_t *restrict src, float *restrict dst, int d) {
    for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
}

/* float8 e4m3fn (sign, 4 exponent bits of bias 7, 3 mantissa bits) -> float32, exact. Normal values
 * re-bias the exponent (+120) into float32 fields; subnormals (exponent 0) are m * 2^-9, built as a
 * normal float32 so no denormal float arithmetic is involved. Branch-free so it vectorizes. The
 * NaN bytes (0x7F, 0xFF) come out as +-480: writers clamp to +-448, so pages never hold them. */
static inline float fp8_to_f32(uint8_t x) {
    const uint32_t e = (x >> 3) & 0xF, m = x & 7;
    const uint32_t bits = ((e + 120) << 23) | (m << 20);
    float normal;
    memcpy(&normal, &bits, sizeof normal);
    const float v = e ? normal : (float)m * 0x1p-9f;
    return (x & 0x80) ? -v : v;
}

static inline void widen_fp8(const uint8_t *restrict src, float *restrict dst, int d) {
    for (int i = 0; i < d; i++) dst[i] = fp8_to_f32(src[i]);
}

static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float s = 0.f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* Attend query heads [h0, h0 + g) of request r, which share KV head kh, over tokens [t0, t1) of
 * the request's visible range (positions start + t). Writes unnormalized outputs o[g][d] and the
 * running max m[g] and sum l[g] (the caller normalizes or merges splits). */
#define DEFINE_ITEM(NAME, T, WIDEN)                                                               \
static void NAME(const float *restrict q, const T *restrict cache, int64_t page_stride,          \
                 int block_size, const int32_t *restrict blocks, int start, int t0, int t1,       \
                 int kh, int g, int d, int64_t row, int64_t v_offset, float scale,               \
                 float *restrict o, float *restrict m, float *restrict l) {                      \
    float qs[MAX_GROUP][MAX_HEAD];                                                                \
    float s[MAX_GROUP][TILE];                                                                     \
    float kv[TILE][MAX_HEAD];                                                                     \
    for (int h = 0; h < g; h++) {                                                                 \
        for (int i = 0; i < d; i++) qs[h][i] = q[(int64_t)h * d + i] * scale;                    \
        m[h] = -INFINITY;                                                                         \
        l[h] = 0.f;                                                                               \
        memset(o + (int64_t)h * d, 0, sizeof(float) * (size_t)d);                                \
    }                                                                                             \
    const T *rows[TILE];                                                                          \
    for (int tile = t0; tile < t1; tile += TILE) {                                                \
        const int n = t1 - tile < TILE ? t1 - tile : TILE;                                        \
        for (int i = 0; i < n; i++) {                                                             \
            const int pos = start + tile + i;                                                     \
            rows[i] = cache + (int64_t)blocks[pos / block_size] * page_stride                     \
                      + (int64_t)(pos % block_size) * row + (int64_t)kh * d;                      \
            WIDEN(rows[i], kv[i], d);                                                             \
        }                                                                                         \
        for (int h = 0; h < g; h++)                                                               \
            for (int i = 0; i < n; i++) s[h][i] = dot(qs[h], kv[i], d);                           \
        for (int i = 0; i < n; i++) WIDEN(rows[i] + v_offset, kv[i], d);                          \
        for (int h = 0; h < g; h++) {                                                             \
            float mt = m[h];                                                                      \
            for (int i = 0; i < n; i++) mt = s[h][i] > mt ? s[h][i] : mt;                         \
            float alpha = m[h] - mt; /* -inf on the first tile: the old sum and outputs are 0 */ \
            exp_tile(&alpha, 1);                                                                  \
            for (int i = 0; i < n; i++) s[h][i] -= mt;                                            \
            exp_tile(s[h], n);                                                                    \
            float sum = 0.f;                                                                      \
            for (int i = 0; i < n; i++) sum += s[h][i];                                           \
            l[h] = l[h] * alpha + sum;                                                            \
            m[h] = mt;                                                                            \
            float *restrict oh = o + (int64_t)h * d;                                              \
            for (int j = 0; j < d; j++) oh[j] *= alpha;                                           \
            for (int i = 0; i < n; i++) {                                                         \
                const float p = s[h][i];                                                          \
                const float *restrict v = kv[i];                                                  \
                for (int j = 0; j < d; j++) oh[j] += p * v[j];                                    \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_ITEM(item_f32, float, widen_f32)
DEFINE_ITEM(item_bf16, uint16_t, widen_bf16)
DEFINE_ITEM(item_fp8, uint8_t, widen_fp8)


#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* 16 e4m3fn bytes -> float32: each byte's exponent and mantissa shifted into a float16 (exponent bias
 * 15, so the value is 2^-8 of the fp8 one, subnormals included), widened exactly by vcvtph2ps, then
 * times 2^8. */
static inline __m512 load16_fp8(const uint8_t *p) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

#define AVX_MAX_G 4
#define AVX_MAX_DV 16 /* head sizes up to 256 */
#define AVX_MAX_HEADS 128

/* 16 vectors -> one vector of their 16 horizontal sums (lane i = sum of v[i]'s lanes), by a
 * transpose-and-add tree: 45 shuffles and adds where 16 separate reductions take about 130. */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* b[i], 128-bit lane L, element e: partial (lane L) sum of token 4i + e. */
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* One tile of up to 16 tokens for one KV head and its G query heads (head size 16 * DV), with the
 * queries and outputs of those heads in registers; G and DV are compile-time constants so the loops
 * unroll. The online-softmax state m, l of the G heads is updated in place. */
#define DEFINE_TILE(NAME, T, LOAD, G, DV)                                                          \
static inline void NAME(const float *restrict qk, float *restrict ok, const T *const *rows, int n, \
                        int64_t k_off, int64_t v_off, float scale, float *restrict m,             \
                        float *restrict l) {                                                      \
    /* The tile's K rows widened once into float32 (rows past n are zeros: their scores are      \
     * masked), then one pass per query head with its 16 per-token accumulators in registers.   */\
    float kbuf[TILE][16 * DV] __attribute__((aligned(64)));                                       \
    for (int i = 0; i < TILE; i++)                                                                \
        for (int j = 0; j < DV; j++)                                                              \
            _mm512_store_ps(kbuf[i] + 16 * j, i < n ? LOAD(rows[i] + k_off + 16 * j) : _mm512_setzero_ps()); \
    __m512 scores[G];                                                                             \
    for (int h = 0; h < G; h++) {                                                                 \
        __m512 qh[DV], acc[TILE];                                                                 \
        for (int j = 0; j < DV; j++) qh[j] = _mm512_load_ps(qk + (h * DV + j) * 16);             \
        for (int i = 0; i < TILE; i++) {                                                          \
            acc[i] = _mm512_mul_ps(qh[0], _mm512_load_ps(kbuf[i]));                               \
            for (int j = 1; j < DV; j++)                                                          \
                acc[i] = _mm512_fmadd_ps(qh[j], _mm512_load_ps(kbuf[i] + 16 * j), acc[i]);         \
        }                                                                                         \
        scores[h] = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));                             \
    }                                                                                             \
    TILE_SOFTMAX_AND_V(T, LOAD, G, DV)                                                            \
}

/* The online-softmax update of a tile for the G heads from their scores: each head's new max and
 * sum, its outputs in ok rescaled, and STORE_P(h, e) handed its probabilities (zero past n). */
#define TILE_ONLINE_SOFTMAX(G, DV, STORE_P)                                                       \
    const __mmask16 live = (__mmask16)((1u << n) - 1);                                            \
    for (int h = 0; h < G; h++) {                                                                 \
        const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, scores[h]);          \
        const float mt = fmaxf(m[h], _mm512_reduce_max_ps(s));                                    \
        const float alpha = m[h] == -INFINITY ? 0.f : expf(m[h] - mt);                            \
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mt))));  \
        l[h] = l[h] * alpha + _mm512_reduce_add_ps(e);                                            \
        m[h] = mt;                                                                                \
        STORE_P(h, e);                                                                            \
        if (alpha != 1.f)                                                                         \
            for (int j = 0; j < DV; j++)                                                          \
                _mm512_store_ps(ok + (h * DV + j) * 16,                                           \
                                _mm512_mul_ps(_mm512_load_ps(ok + (h * DV + j) * 16), _mm512_set1_ps(alpha))); \
    }
#define STORE_P_F32(h, e) _mm512_store_ps(p[h], e)
#define STORE_P_BF16(h, e) _mm256_store_si256((__m256i *)pp[h], (__m256i)_mm512_cvtneps_pbh(e))

/* The second half of a tile, shared by both kinds: the online-softmax update of the G heads from
 * their scores, then the V rows (widened to float32) accumulated with the probabilities. */
#define TILE_SOFTMAX_AND_V(T, LOAD, G, DV)                                                        \
    float p[G][TILE] __attribute__((aligned(64)));                                                \
    TILE_ONLINE_SOFTMAX(G, DV, STORE_P_F32)                                                       \
    __m512 o[G][DV];                                                                              \
    for (int h = 0; h < G; h++)                                                                   \
        for (int j = 0; j < DV; j++) o[h][j] = _mm512_load_ps(ok + (h * DV + j) * 16);            \
    for (int i = 0; i < n; i++) {                                                                 \
        const T *v = rows[i] + v_off;                                                             \
        __m512 pi[G];                                                                             \
        for (int h = 0; h < G; h++) pi[h] = _mm512_set1_ps(p[h][i]);                              \
        for (int j = 0; j < DV; j++) {                                                            \
            const __m512 vj = LOAD(v + 16 * j);                                                   \
            for (int h = 0; h < G; h++) o[h][j] = _mm512_fmadd_ps(pi[h], vj, o[h][j]);            \
        }                                                                                         \
    }                                                                                             \
    for (int h = 0; h < G; h++)                                                                   \
        for (int j = 0; j < DV; j++) _mm512_store_ps(ok + (h * DV + j) * 16, o[h][j]);

#ifdef __AVX512BF16__
/* bf16 K on a CPU with AVX512-BF16: the scores straight from the bf16 rows by vdpbf16ps (pairs of
 * bf16 products, exact in float32, accumulated in float32), with q in bf16 as the model made it:
 * no widening of K. qk holds the G heads' q as bf16 (16 * DV each), unscaled. */
#define DEFINE_TILE_DP(NAME, G, DV)                                                               \
static inline void NAME(const float *restrict qk, float *restrict ok, const uint16_t *const *rows, \
                        int n, int64_t k_off, int64_t v_off, float scale, float *restrict m,      \
                        float *restrict l) {                                                      \
    const uint16_t *qb = (const uint16_t *)qk;                                                    \
    __m512 scores[G];                                                                             \
    for (int h = 0; h < G; h++) {                                                                 \
        __m512bh qh[(DV + 1) / 2];                                                                \
        for (int j = 0; j < DV / 2; j++) qh[j] = (__m512bh)_mm512_loadu_si512(qb + h * 16 * DV + 32 * j); \
        if (DV % 2) qh[DV / 2] = (__m512bh)_mm512_zextsi256_si512(                                \
            _mm256_loadu_si256((const __m256i *)(qb + h * 16 * DV + 32 * (DV / 2))));             \
        __m512 acc[TILE];                                                                         \
        for (int i = 0; i < TILE; i++) {                                                          \
            acc[i] = _mm512_setzero_ps();                                                         \
            if (i >= n) continue;                                                                 \
            const uint16_t *k = rows[i] + k_off;                                                  \
            for (int j = 0; j < DV / 2; j++)                                                      \
                acc[i] = _mm512_dpbf16_ps(acc[i], qh[j], (__m512bh)_mm512_loadu_si512(k + 32 * j)); \
            if (DV % 2)                                                                           \
                acc[i] = _mm512_dpbf16_ps(acc[i], qh[DV / 2], (__m512bh)_mm512_zextsi256_si512(   \
                    _mm256_loadu_si256((const __m256i *)(k + 32 * (DV / 2)))));                   \
        }                                                                                         \
        scores[h] = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));                             \
    }                                                                                             \
    if (DV % 2) {                                                                                 \
        TILE_SOFTMAX_AND_V(uint16_t, load16_bf16, G, DV)                                          \
    } else {                                                                                      \
        TILE_SOFTMAX_AND_V_DP(G, DV)                                                              \
    }                                                                                             \
}

/* The second half for bf16 V on AVX512-BF16 (even DV): the probabilities rounded to bf16 (as torch's
 * bf16 attention rounds them for its P V product) and V taken two tokens at a time by vdpbf16ps on
 * the rows interleaved by unpacklo/hi_epi16, so no row is widened. That interleave leaves each
 * accumulator's lanes in a fixed permuted order of dimensions (see unpermute_dp), undone once per
 * item. Rows past n have probability 0 (their V is read but contributes nothing). */
#define TILE_SOFTMAX_AND_V_DP(G, DV)                                                              \
    uint32_t pp[G][TILE / 2] __attribute__((aligned(64)));                                        \
    TILE_ONLINE_SOFTMAX(G, DV, STORE_P_BF16)                                                      \
    __m512 o[G][DV];                                                                              \
    for (int h = 0; h < G; h++)                                                                   \
        for (int j = 0; j < DV; j++) o[h][j] = _mm512_load_ps(ok + (h * DV + j) * 16);            \
    for (int i = 0; i < n; i += 2) {                                                              \
        const uint16_t *va = rows[i] + v_off;                                                     \
        const uint16_t *vb = (i + 1 < n ? rows[i + 1] : rows[i]) + v_off;                         \
        __m512bh pi[G];                                                                           \
        for (int h = 0; h < G; h++) pi[h] = (__m512bh)_mm512_set1_epi32((int)pp[h][i / 2]);      \
        for (int c = 0; c < DV / 2; c++) {                                                        \
            const __m512i a = _mm512_loadu_si512(va + 32 * c), b = _mm512_loadu_si512(vb + 32 * c); \
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);                            \
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);                            \
            for (int h = 0; h < G; h++) {                                                         \
                o[h][2 * c] = _mm512_dpbf16_ps(o[h][2 * c], pi[h], lo);                           \
                o[h][2 * c + 1] = _mm512_dpbf16_ps(o[h][2 * c + 1], pi[h], hi);                   \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (int h = 0; h < G; h++)                                                                   \
        for (int j = 0; j < DV; j++) _mm512_store_ps(ok + (h * DV + j) * 16, o[h][j]);

#endif

#define DEFINE_TILES(T, LOAD)                                                                     \
    DEFINE_TILE(tile_##T##_1_4, T, LOAD, 1, 4) DEFINE_TILE(tile_##T##_2_4, T, LOAD, 2, 4)        \
    DEFINE_TILE(tile_##T##_3_4, T, LOAD, 3, 4) DEFINE_TILE(tile_##T##_4_4, T, LOAD, 4, 4)        \
    DEFINE_TILE(tile_##T##_1_8, T, LOAD, 1, 8) DEFINE_TILE(tile_##T##_2_8, T, LOAD, 2, 8)        \
    DEFINE_TILE(tile_##T##_3_8, T, LOAD, 3, 8) DEFINE_TILE(tile_##T##_4_8, T, LOAD, 4, 8)        \
    DEFINE_TILE(tile_##T##_1_16, T, LOAD, 1, 16) DEFINE_TILE(tile_##T##_2_16, T, LOAD, 2, 16)    \
    DEFINE_TILE(tile_##T##_1_2, T, LOAD, 1, 2) DEFINE_TILE(tile_##T##_2_2, T, LOAD, 2, 2)        \
    DEFINE_TILE(tile_##T##_3_2, T, LOAD, 3, 2) DEFINE_TILE(tile_##T##_4_2, T, LOAD, 4, 2)        \
    DEFINE_TILE(tile_##T##_1_1, T, LOAD, 1, 1) DEFINE_TILE(tile_##T##_2_1, T, LOAD, 2, 1)        \
    DEFINE_TILE(tile_##T##_3_1, T, LOAD, 3, 1) DEFINE_TILE(tile_##T##_4_1, T, LOAD, 4, 1)

typedef void (*tile_f32_fn)(const float *, float *, const float *const *, int, int64_t, int64_t, float,
                            float *, float *);
typedef void (*tile_bf16_fn)(const float *, float *, const uint16_t *const *, int, int64_t, int64_t, float,
                             float *, float *);
DEFINE_TILES(float, load16_f32)
DEFINE_TILES(uint16_t, load16_bf16)
typedef void (*tile_fp8_fn)(const float *, float *, const uint8_t *const *, int, int64_t, int64_t, float,
                            float *, float *);
DEFINE_TILES(uint8_t, load16_fp8)
#ifdef __AVX512BF16__
DEFINE_TILE_DP(tile_bf16dp_1_4, 1, 4) DEFINE_TILE_DP(tile_bf16dp_2_4, 2, 4)
DEFINE_TILE_DP(tile_bf16dp_3_4, 3, 4) DEFINE_TILE_DP(tile_bf16dp_4_4, 4, 4)
DEFINE_TILE_DP(tile_bf16dp_1_8, 1, 8) DEFINE_TILE_DP(tile_bf16dp_2_8, 2, 8)
DEFINE_TILE_DP(tile_bf16dp_3_8, 3, 8) DEFINE_TILE_DP(tile_bf16dp_4_8, 4, 8)
DEFINE_TILE_DP(tile_bf16dp_1_16, 1, 16) DEFINE_TILE_DP(tile_bf16dp_2_16, 2, 16)
DEFINE_TILE_DP(tile_bf16dp_1_2, 1, 2) DEFINE_TILE_DP(tile_bf16dp_2_2, 2, 2)
DEFINE_TILE_DP(tile_bf16dp_3_2, 3, 2) DEFINE_TILE_DP(tile_bf16dp_4_2, 4, 2)
DEFINE_TILE_DP(tile_bf16dp_1_1, 1, 1) DEFINE_TILE_DP(tile_bf16dp_2_1, 2, 1)
DEFINE_TILE_DP(tile_bf16dp_3_1, 3, 1) DEFINE_TILE_DP(tile_bf16dp_4_1, 4, 1)
#endif

#define TILE_TABLE(T)                                                                             \
static __attribute__((unused)) void *tile_fn_##T(int g, int dv) {                                \
    switch (dv * 8 + g) {                                                                         \
    case 4 * 8 + 1: return (void *)tile_##T##_1_4;  case 4 * 8 + 2: return (void *)tile_##T##_2_4; \
    case 4 * 8 + 3: return (void *)tile_##T##_3_4;  case 4 * 8 + 4: return (void *)tile_##T##_4_4; \
    case 8 * 8 + 1: return (void *)tile_##T##_1_8;  case 8 * 8 + 2: return (void *)tile_##T##_2_8; \
    case 8 * 8 + 3: return (void *)tile_##T##_3_8;  case 8 * 8 + 4: return (void *)tile_##T##_4_8; \
    case 16 * 8 + 1: return (void *)tile_##T##_1_16; case 16 * 8 + 2: return (void *)tile_##T##_2_16; \
    case 2 * 8 + 1: return (void *)tile_##T##_1_2;  case 2 * 8 + 2: return (void *)tile_##T##_2_2; \
    case 2 * 8 + 3: return (void *)tile_##T##_3_2;  case 2 * 8 + 4: return (void *)tile_##T##_4_2; \
    case 1 * 8 + 1: return (void *)tile_##T##_1_1;  case 1 * 8 + 2: return (void *)tile_##T##_2_1; \
    case 1 * 8 + 3: return (void *)tile_##T##_3_1;  case 1 * 8 + 4: return (void *)tile_##T##_4_1; \
    default: return 0;                                                                            \
    }                                                                                             \
}
TILE_TABLE(float)
TILE_TABLE(uint16_t)
TILE_TABLE(uint8_t)
#ifdef __AVX512BF16__
TILE_TABLE(bf16dp)
#endif

/* Back to dimension order: vectors 2c and 2c + 1 of a head came from unpacklo / unpackhi of its
 * dimensions [32c, 32c + 32): lane k of the first holds dimension 32c + 8 (k / 4) + k % 4, of the
 * second that + 4. */
static void unpermute_dp(float *o, int heads, int d) {
    float tmp[MAX_HEAD];
    for (int h = 0; h < heads; h++) {
        float *oh = o + (int64_t)h * d;
        for (int c = 0; c < d / 32; c++)
            for (int k = 0; k < 16; k++) {
                tmp[32 * c + 8 * (k / 4) + k % 4] = oh[32 * c + k];
                tmp[32 * c + 8 * (k / 4) + 4 + k % 4] = oh[32 * c + 16 + k];
            }
        memcpy(oh, tmp, sizeof(float) * (size_t)(d / 32 * 32));
    }
}
/* Ask for the next tile's K and V rows (positions [p0, min(p0 + TILE, p1))) while this one is
 * computed: pages are scattered, so the hardware prefetcher loses the stream at every page edge. */
static inline void prefetch_rows(const char *cache, int64_t page_bytes, int block_size, const int32_t *blocks,
                                 int p0, int p1, int64_t row_bytes, int64_t v_bytes) {
    const int end = p0 + TILE < p1 ? p0 + TILE : p1;
    for (int pos = p0; pos < end; pos++) {
        const char *k = cache + (int64_t)blocks[pos / block_size] * page_bytes + (int64_t)(pos % block_size) * row_bytes;
        for (int64_t off = 0; off < row_bytes; off += 64) {
            _mm_prefetch(k + off, _MM_HINT_T1);
            _mm_prefetch(k + v_bytes + off, _MM_HINT_T1);
        }
    }
}

/* The item for the vector path, over ALL KV heads of one request (a tile's K and V rows are then
 * read as contiguous runs of memory): per tile, each KV head's tile kernel. */
/* Q_BF16: the tiles take q as bf16 (the vdpbf16ps tiles), else as float32; either way unscaled. */
/* V_DP: the tiles leave even-DV outputs in the permuted order of TILE_SOFTMAX_AND_V_DP. */
#define DEFINE_ITEM_AVX(NAME, T, FNTYPE, TABLE, Q_BF16, V_DP)                                     \
static void NAME(const float *restrict q, const T *restrict cache, int64_t page_stride,          \
                 int block_size, const int32_t *restrict blocks, int start, int t0, int t1,       \
                 int num_kv_heads, int g, int d, int64_t row, int64_t v_offset, float scale,     \
                 float *restrict o, float *restrict m, float *restrict l) {                      \
    const int heads = num_kv_heads * g;                                                           \
    const FNTYPE fn = (FNTYPE)tile_fn_##TABLE(g, d / 16);                                         \
    float qs[AVX_MAX_HEADS * 16 * AVX_MAX_DV] __attribute__((aligned(64)));                       \
    float os[AVX_MAX_HEADS * 16 * AVX_MAX_DV] __attribute__((aligned(64)));                       \
    uint16_t *qb = (uint16_t *)qs;                                                                \
    for (int i = 0; i < heads * d; i++) {                                                         \
        if (Q_BF16) qb[i] = f32_to_bf16(q[i]); else qs[i] = q[i];                                 \
        os[i] = 0.f;                                                                              \
    }                                                                                             \
    for (int h = 0; h < heads; h++) { m[h] = -INFINITY; l[h] = 0.f; }                             \
    const T *rows[TILE];                                                                          \
    for (int tile = t0; tile < t1; tile += TILE) {                                                \
        const int n = t1 - tile < TILE ? t1 - tile : TILE;                                        \
        for (int i = 0; i < n; i++) {                                                             \
            const int pos = start + tile + i;                                                     \
            rows[i] = cache + (int64_t)blocks[pos / block_size] * page_stride                     \
                      + (int64_t)(pos % block_size) * row;                                        \
        }                                                                                         \
        prefetch_rows((const char *)cache, page_stride * (int64_t)sizeof(T), block_size, blocks,  \
                      start + tile + 2 * TILE, start + t1, row * (int64_t)sizeof(T),                  \
                      v_offset * (int64_t)sizeof(T));                                             \
        for (int kh = 0; kh < num_kv_heads; kh++) {                                               \
            const float *qk = Q_BF16 ? (const float *)(qb + (int64_t)kh * g * d) : qs + (int64_t)kh * g * d; \
            fn(qk, os + (int64_t)kh * g * d, rows, n, (int64_t)kh * d, v_offset + (int64_t)kh * d, \
               scale, m + kh * g, l + kh * g);                                                    \
        }                                                                                         \
    }                                                                                             \
    if (V_DP && (d / 16) % 2 == 0) unpermute_dp(os, heads, d);                                    \
    memcpy(o, os, sizeof(float) * (size_t)heads * d);                                             \
}

DEFINE_ITEM_AVX(item_avx_f32, float, tile_f32_fn, float, 0, 0)
DEFINE_ITEM_AVX(item_avx_fp8, uint8_t, tile_fp8_fn, uint8_t, 0, 0)
#ifdef __AVX512BF16__
DEFINE_ITEM_AVX(item_avx_bf16, uint16_t, tile_bf16_fn, bf16dp, 1, 1)
#else
DEFINE_ITEM_AVX(item_avx_bf16, uint16_t, tile_bf16_fn, uint16_t, 0, 0)
#endif
#endif

#ifdef __AVX512F__
static int whole_request_items(int group, int num_kv_heads, int d) {
    return d % 16 == 0 && group * num_kv_heads * d <= AVX_MAX_HEADS * 16 * AVX_MAX_DV
           && tile_fn_float(group, d / 16) != 0;
}
#else
static int whole_request_items(int group, int num_kv_heads, int d) { (void)group; (void)num_kv_heads; (void)d; return 0; }
#define item_avx_f32 item_f32
#define item_avx_bf16 item_bf16
#define item_avx_fp8 item_fp8
#endif

/* How many splits a request of n visible tokens gets: enough items for every thread, but splits
 * of at least MIN_SPLIT tokens (merging costs a little per split). */
#define MIN_SPLIT 256
static int num_splits(int n, int base_items, int threads) {
    int want = (4 * threads + base_items - 1) / base_items;
    int most = (n + MIN_SPLIT - 1) / MIN_SPLIT;
    if (want > most) want = most;
    return want < 1 ? 1 : want;
}

#define DEFINE_DECODE(NAME, T, ITEM, WHOLE)                                                       \
void NAME(const float *q, const T *cache, int64_t page_stride, int block_size,                   \
          const int32_t *block_table, int max_blocks, const int32_t *seq_lens, int num_reqs,     \
          int num_heads, int num_kv_heads, int head_size, float scale, int window, float *out) { \
    const int group = num_heads / num_kv_heads;                                                   \
    const int d = head_size;                                                                      \
    const int64_t row = (int64_t)num_kv_heads * head_size;                                        \
    const int64_t v_offset = (int64_t)block_size * row;                                           \
    const int threads = omp_get_max_threads();                                                    \
    /* Items: (request, split) with every KV head when the vector item applies, else (request, KV \
     * head, head chunk of <= MAX_GROUP, split); splits of one request are consecutive so their  \
     * partials can be merged afterwards. */                                                      \
    const int whole = whole_request_items(group, num_kv_heads, d);                                \
    const int per_split = whole ? 1 : num_kv_heads * ((group + MAX_GROUP - 1) / MAX_GROUP);       \
    const int chunks = (group + MAX_GROUP - 1) / MAX_GROUP;                                       \
    const int base = num_reqs * per_split;                                                        \
    int *first = (int *)malloc(sizeof(int) * (size_t)(num_reqs + 1));                             \
    first[0] = 0;                                                                                 \
    for (int r = 0; r < num_reqs; r++) {                                                          \
        const int len = seq_lens[r];                                                              \
        const int n = (window > 0 && len > window) ? window : len;                                \
        first[r + 1] = first[r] + num_splits(n, base, threads);                                   \
    }                                                                                             \
    const int total_splits = first[num_reqs];                                                     \
    const int64_t items = (int64_t)total_splits * per_split;                                      \
    /* Partial results per (split, query head): max, sum, unnormalized output. */                \
    float *pm = (float *)malloc(sizeof(float) * (size_t)total_splits * num_heads);                \
    float *pl = (float *)malloc(sizeof(float) * (size_t)total_splits * num_heads);                \
    float *po = (float *)malloc(sizeof(float) * (size_t)total_splits * num_heads * d);            \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                              \
    for (int64_t it = 0; it < items; it++) {                                                      \
        const int split_index = (int)(it / per_split);                                            \
        const int rest = (int)(it % per_split);                                                   \
        const int kh = rest / chunks, c = rest % chunks;                                          \
        int r = 0; /* the request owning this split */                                           \
        { int lo = 0, hi = num_reqs - 1;                                                          \
          while (lo < hi) { int mid = (lo + hi + 1) / 2;                                          \
                            if (first[mid] <= split_index) lo = mid; else hi = mid - 1; }         \
          r = lo; }                                                                               \
        const int nsplit = first[r + 1] - first[r], k = split_index - first[r];                  \
        const int len = seq_lens[r];                                                              \
        const int start = (window > 0 && len > window) ? len - window : 0;                        \
        const int n = len - start;                                                                \
        const int t0 = (int)((int64_t)n * k / nsplit), t1 = (int)((int64_t)n * (k + 1) / nsplit); \
        const int32_t *blocks = block_table + (int64_t)r * max_blocks;                            \
        if (whole) {                                                                              \
            const int64_t slot = (int64_t)split_index * num_heads;                                \
            WHOLE(q + (int64_t)r * num_heads * d, cache, page_stride, block_size, blocks, start,  \
                  t0, t1, num_kv_heads, group, d, row, v_offset, scale, po + slot * d, pm + slot, \
                  pl + slot);                                                                     \
            continue;                                                                             \
        }                                                                                         \
        const int h0 = kh * group + c * MAX_GROUP;                                                \
        const int g = group - c * MAX_GROUP < MAX_GROUP ? group - c * MAX_GROUP : MAX_GROUP;      \
        const int64_t slot = (int64_t)split_index * num_heads + h0;                               \
        ITEM(q + ((int64_t)r * num_heads + h0) * d, cache, page_stride, block_size, blocks,       \
             start, t0, t1, kh, g, d, row, v_offset, scale, po + slot * d, pm + slot, pl + slot); \
    }                                                                                             \
    /* Merge each request's splits: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s. */      \
    _Pragma("omp parallel for schedule(static)")                                                  \
    for (int r = 0; r < num_reqs; r++) {                                                          \
        for (int h = 0; h < num_heads; h++) {                                                     \
            float M = -INFINITY;                                                                  \
            for (int sp = first[r]; sp < first[r + 1]; sp++)                                      \
                if (pm[(int64_t)sp * num_heads + h] > M) M = pm[(int64_t)sp * num_heads + h];     \
            float *restrict oh = out + ((int64_t)r * num_heads + h) * d;                          \
            memset(oh, 0, sizeof(float) * (size_t)d);                                             \
            float L = 0.f;                                                                        \
            for (int sp = first[r]; sp < first[r + 1]; sp++) {                                    \
                const int64_t slot = (int64_t)sp * num_heads + h;                                 \
                float w = pm[slot] - M;                                                           \
                exp_tile(&w, 1);                                                                  \
                L += w * pl[slot];                                                                \
                const float *restrict os = po + slot * d;                                         \
                for (int j = 0; j < d; j++) oh[j] += w * os[j];                                   \
            }                                                                                     \
            const float inv = L > 0.f ? 1.f / L : 0.f;                                            \
            for (int j = 0; j < d; j++) oh[j] *= inv;                                             \
        }                                                                                         \
    }                                                                                             \
    free(first); free(pm); free(pl); free(po);                                                    \
}

DEFINE_DECODE(paged_decode_f32, float, item_f32, item_avx_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, item_bf16, item_avx_bf16)
DEFINE_DECODE(paged_decode_fp8, uint8_t, item_fp8, item_avx_fp8)

int paged_decode_max_head_size(void) { return MAX_HEAD; }
