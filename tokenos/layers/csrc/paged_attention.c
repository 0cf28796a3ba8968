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
 * float32 outputs; the AVX-512 item takes chunks of up to 256 tokens instead (all their scores, one
 * softmax step, then all their V rows; see SCORE_BUF). bf16 rows are widened to float32 on the fly;
 * every product and sum is float32.
 * fp8 pages (float8 e4m3fn bytes, the caller folding its per-tensor scales into `scale` and the
 * output) are widened the same way: exactly, by integer operations (portable path) or through
 * float16 and vcvtph2ps (AVX-512 path). int8 pages (symmetric, scales folded the same way) are widened by a
 * plain int -> float conversion (vpmovsxbd + vcvtdq2ps on AVX-512), exact.
 * Gemma 2's attention-logit soft cap (cap > 0) bends each scaled score to cap * tanh(s / cap) before its
 * softmax step; gpt-oss's sinks (one logit per query head, no value) join each head's softmax sum once,
 * where it is normalized (after the split merge, so a sink counts once per request, not once per split).
 *
 * The library is compiled on first use with -march=native (see tokenos/layers/cpu_kernels.py). The
 * whole-request item has AVX-512 tiles and an AVX2 + FMA form (item_avx2_*, below the AVX-512 ones);
 * other shapes and CPUs take the generic item, plain C loops over the head dimension written for the
 * compiler's vectorizer. */
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
#define MAX_ITEM_HEADS 128 /* query heads one item may hold (>= MAX_GROUP) */
#define SCORE_BUF 16384  /* floats of scores per chunk of the whole-request items */
#define MAX_CHUNK 256    /* tokens per chunk of the whole-request items */

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

static inline void widen_int8(const int8_t *restrict src, float *restrict dst, int d) {
    for (int i = 0; i < d; i++) dst[i] = (float)src[i];
}

static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float s = 0.f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* One online-softmax step per head over n tokens, in plain loops the compiler vectorizes: the scores
 * s[h * ss + 0..n), times scale and soft-capped (cap > 0), become probabilities against the head's new
 * running max m[h]; its earlier outputs o[h * d ...] and sum l[h] are rescaled to it. */
static void softmax_step(float *restrict s, int ss, int n, int heads, int d, float scale, float cap,
                         float *restrict m, float *restrict l, float *restrict o) {
    for (int h = 0; h < heads; h++) {
        float *restrict sh = s + (int64_t)h * ss;
        if (scale != 1.f)
            for (int i = 0; i < n; i++) sh[i] *= scale;
        if (cap > 0.f) softcap_tile(sh, n, cap);
        float mt = m[h];
        for (int i = 0; i < n; i++) mt = sh[i] > mt ? sh[i] : mt;
        /* A max that did not move leaves the outputs and sum as they are (exp_le0(0) is exactly 1, so
         * this is what rescaling by it gives): with tiles of 16 most steps of a long context are so. */
        float alpha = 1.f;
        if (mt > m[h]) {
            alpha = m[h] - mt; /* -inf on the first step: the old sum and outputs are 0 */
            exp_tile(&alpha, 1);
            for (int j = 0; j < d; j++) o[(int64_t)h * d + j] *= alpha;
        }
        for (int i = 0; i < n; i++) sh[i] -= mt;
        exp_tile(sh, n);
        float sum = 0.f;
        for (int i = 0; i < n; i++) sum += sh[i];
        l[h] = l[h] * alpha + sum;
        m[h] = mt;
    }
}

/* Attend query heads [h0, h0 + g) of request r, which share KV head kh, over tokens [t0, t1) of
 * the request's visible range (positions start + t). Writes unnormalized outputs o[g][d] and the
 * running max m[g] and sum l[g] (the caller normalizes or merges splits). */
/* Aligned to 64 bytes: on Zen 4 the speed of these loops was seen to change by 15% with where an
 * unrelated edit happened to place them. */
#define DEFINE_ITEM(NAME, T, WIDEN)                                                               \
__attribute__((aligned(64)))                                                                      \
static void NAME(const float *restrict q, const T *restrict cache, int64_t page_stride,          \
                 int block_size, const int32_t *restrict blocks, int start, int t0, int t1,       \
                 int kh, int g, int d, int64_t row, int64_t v_offset, float scale, float cap,    \
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
        softmax_step(s[0], TILE, n, g, d, 1.f, cap, m, l, o); /* q is scaled already */           \
        for (int h = 0; h < g; h++) {                                                             \
            float *restrict oh = o + (int64_t)h * d;                                              \
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
DEFINE_ITEM(item_int8, int8_t, widen_int8)


/* Ask for the K rows (v_bytes 0) or the V rows of positions [p0, min(p0 + TILE, p1)) ahead of their
 * use: pages are scattered, so the hardware prefetcher loses the stream at every page edge. K and V
 * are asked for in the phases that read them, so that memory is kept busy through both. */
static inline void prefetch_span(const char *cache, int64_t page_bytes, int block_size, const int32_t *blocks,
                                 int p0, int end, int64_t row_bytes, int64_t v_bytes) {
    /* Tokens of one page are consecutive rows: one run per page, one division per run. */
    for (int pos = p0; pos < end;) {
        const int off = pos % block_size;
        const int count = end - pos < block_size - off ? end - pos : block_size - off;
        const char *k = cache + (int64_t)blocks[pos / block_size] * page_bytes + (int64_t)off * row_bytes + v_bytes;
        for (int64_t o = 0; o < (int64_t)count * row_bytes; o += 64) __builtin_prefetch(k + o, 0, 2) /* prefetcht1 */;
        pos += count;
    }
}

static inline void prefetch_rows(const char *cache, int64_t page_bytes, int block_size, const int32_t *blocks,
                                 int p0, int p1, int64_t row_bytes, int64_t v_bytes) {
    prefetch_span(cache, page_bytes, block_size, blocks, p0, p0 + TILE < p1 ? p0 + TILE : p1, row_bytes, v_bytes);
}

/* The K rows of positions [p0, p0 + n) (their V rows are v_offset further), walking the block table
 * page by page rather than dividing per token. */
#define GATHER_ROWS(T, rows, p0, n)                                                                \
    for (int i = 0, pos = (p0); i < (n);) {                                                       \
        const int off = pos % block_size;                                                         \
        const T *page = cache + (int64_t)blocks[pos / block_size] * page_stride;                  \
        for (int o = off; o < block_size && i < (n); o++, i++, pos++) rows[i] = page + (int64_t)o * row; \
    }

#define PREFETCH(T, p0, p1, v_bytes)                                                               \
    prefetch_rows((const char *)cache, page_stride * (int64_t)sizeof(T), block_size, blocks, p0, p1, \
                  row * (int64_t)sizeof(T), v_bytes)
/* Part i of n of PREFETCH's tile, asked for between the tile's kernels (per KV head; per 4 tokens on AVX2)
 * rather than in one burst: a tile's 96 lines of K (SmolLM2's 3 KV heads of 64) at once filled the miss
 * queue and stalled the core on the prefetches themselves (perf: prefetcht1 the item's hottest
 * instruction), where spread out they overlap the arithmetic. AMD EPYC (Zen 4), 2 threads, 74 decodes of
 * 35-670 tokens on scattered pages over 30 layers' caches (from memory), ctypes A/B of the library:
 * 1239 -> 971 and 1261 -> 1004 us a layer (17.5 -> 22.3 GB/s); batch 16 of 576 tokens 408 -> 309 us;
 * the x86-64-v3 build's AVX2 item 2381 -> 1583 us; one request of 300 or 1000 tokens level. */
#define PREFETCH_PART(T, p0, p1, v_bytes, i, n)                                                    \
    do {                                                                                          \
        const int _a = (p0) + TILE * (i) / (n), _b0 = (p0) + TILE * ((i) + 1) / (n);                \
        const int _b = _b0 < (p1) ? _b0 : (p1);                                                   \
        if (_a < _b) prefetch_span((const char *)cache, page_stride * (int64_t)sizeof(T), block_size, blocks, \
                                   _a, _b, row * (int64_t)sizeof(T), v_bytes);                    \
    } while (0)

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

/* 16 int8 values -> float32, exact. */
static inline __m512 load16_int8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

#define AVX_MAX_G 4
#define AVX_MAX_DV 16 /* head sizes up to 256 */
#define AVX_MAX_HEADS MAX_ITEM_HEADS
/* An item goes in chunks of tokens: first every score of the chunk (all heads), then one softmax
 * step per head, then the chunk's V rows tile by tile. A softmax per tile of 16 put a max-exp-sum
 * dependency chain and a rescale of the outputs between every tile's scores and its V products;
 * per chunk, those are paid once per 128-256 tokens and the score and V loops run without waiting.
 * The scores of a chunk are [heads][chunk] floats of SCORE_BUF, so the chunk shrinks as heads grow.
 * (The AVX2 item below goes a tile at a time instead: see there.) */

/* The scaled scores of one tile of up to 16 tokens for one KV head and its G query heads (head size
 * 16 * DV) into s[h * ss + i], -inf for i >= n so the softmax gives those tokens nothing. G and DV are
 * compile-time constants so the loops unroll. */
#define STORE_SCORES(h, acc)                                                                      \
    _mm512_storeu_ps(s + (h) * ss, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,             \
                                                      _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale))))
#define DEFINE_SCORES(NAME, T, LOAD, G, DV)                                                        \
static inline void NAME(const float *restrict qk, const T *const *rows, int n, int64_t k_off,     \
                        float scale, float *restrict s, int ss) {                                 \
    /* The tile's K rows widened once into float32 (rows past n are zeros), then one pass per     \
     * query head with its 16 per-token accumulators in registers. */                             \
    float kbuf[TILE][16 * DV] __attribute__((aligned(64)));                                       \
    for (int i = 0; i < TILE; i++)                                                                \
        for (int j = 0; j < DV; j++)                                                              \
            _mm512_store_ps(kbuf[i] + 16 * j, i < n ? LOAD(rows[i] + k_off + 16 * j) : _mm512_setzero_ps()); \
    const __mmask16 live = (__mmask16)((1u << n) - 1);                                            \
    for (int h = 0; h < G; h++) {                                                                 \
        __m512 qh[DV], acc[TILE];                                                                 \
        for (int j = 0; j < DV; j++) qh[j] = _mm512_load_ps(qk + (h * DV + j) * 16);             \
        for (int i = 0; i < TILE; i++) {                                                          \
            acc[i] = _mm512_mul_ps(qh[0], _mm512_load_ps(kbuf[i]));                               \
            for (int j = 1; j < DV; j++)                                                          \
                acc[i] = _mm512_fmadd_ps(qh[j], _mm512_load_ps(kbuf[i] + 16 * j), acc[i]);         \
        }                                                                                         \
        STORE_SCORES(h, acc);                                                                     \
    }                                                                                             \
}

/* The outputs ok of one KV head's G query heads plus the V rows of the n tokens times their
 * probabilities pf[h * ps + i], V widened to float32. */
#define PV_F32_BODY(T, LOAD, G, DV)                                                               \
    for (int i = 0; i < n; i++) {                                                                 \
        const T *v = rows[i] + v_off;                                                             \
        __m512 pi[G];                                                                             \
        for (int h = 0; h < G; h++) pi[h] = _mm512_set1_ps(pf[h * ps + i]);                       \
        for (int j = 0; j < DV; j++) {                                                            \
            const __m512 vj = LOAD(v + 16 * j);                                                   \
            for (int h = 0; h < G; h++) o[h][j] = _mm512_fmadd_ps(pi[h], vj, o[h][j]);            \
        }                                                                                         \
    }
#define PV_LOAD_O(G, DV)                                                                          \
    __m512 o[G][DV];                                                                              \
    for (int h = 0; h < G; h++)                                                                   \
        for (int j = 0; j < DV; j++)                                                              \
            o[h][j] = _mm512_load_ps(ok + (h * DV + j) * 16);
#define PV_STORE_O(G, DV)                                                                         \
    for (int h = 0; h < G; h++)                                                                   \
        for (int j = 0; j < DV; j++) _mm512_store_ps(ok + (h * DV + j) * 16, o[h][j]);
#define DEFINE_PV(NAME, T, LOAD, G, DV)                                                            \
static inline void NAME(float *restrict ok, const T *const *rows, int n, int64_t v_off,           \
                        const float *restrict pf,                                                 \
                        const uint16_t *restrict pb, int ps) {                                    \
    (void)pb;                                                                                     \
    PV_LOAD_O(G, DV)                                                                              \
    PV_F32_BODY(T, LOAD, G, DV)                                                                   \
    PV_STORE_O(G, DV)                                                                             \
}

#ifdef __AVX512BF16__
/* bf16 K on a CPU with AVX512-BF16: the scores straight from the bf16 rows by vdpbf16ps (pairs of
 * bf16 products, exact in float32, accumulated in float32), with q in bf16 as the model made it:
 * no widening of K. qk holds the G heads' q as bf16 (16 * DV each), unscaled. */
#define DEFINE_SCORES_DP(NAME, G, DV)                                                             \
static inline void NAME(const float *restrict qk, const uint16_t *const *rows, int n,             \
                        int64_t k_off, float scale, float *restrict s, int ss) {                  \
    const uint16_t *qb = (const uint16_t *)qk;                                                    \
    const __mmask16 live = (__mmask16)((1u << n) - 1);                                            \
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
        STORE_SCORES(h, acc);                                                                     \
    }                                                                                             \
}

/* bf16 V on AVX512-BF16 (even DV): the probabilities rounded to bf16 (pb, as torch's bf16 attention
 * rounds them for its P V product; zero-padded to an even count) and V taken two tokens at a time by
 * vdpbf16ps on the rows interleaved by unpacklo/hi_epi16, so no row is widened. That interleave
 * leaves each accumulator's lanes in a fixed permuted order of dimensions (see unpermute_dp),
 * undone once per item. For odd n the last pair repeats a row with probability 0. */
#define DEFINE_PV_DP(NAME, G, DV)                                                                 \
static inline void NAME(float *restrict ok, const uint16_t *const *rows, int n, int64_t v_off,    \
                        const float *restrict pf,                                                 \
                        const uint16_t *restrict pb, int ps) {                                    \
    PV_LOAD_O(G, DV)                                                                              \
    if (DV % 2) {                                                                                 \
        PV_F32_BODY(uint16_t, load16_bf16, G, DV)                                                 \
    } else {                                                                                      \
        for (int i = 0; i < n; i += 2) {                                                          \
            const uint16_t *va = rows[i] + v_off;                                                 \
            const uint16_t *vb = (i + 1 < n ? rows[i + 1] : rows[i]) + v_off;                     \
            __m512bh pi[G];                                                                       \
            for (int h = 0; h < G; h++) {                                                         \
                int32_t pair;                                                                     \
                memcpy(&pair, pb + h * ps + i, sizeof pair);                                      \
                pi[h] = (__m512bh)_mm512_set1_epi32(pair);                                        \
            }                                                                                     \
            for (int c = 0; c < DV / 2; c++) {                                                    \
                const __m512i a = _mm512_loadu_si512(va + 32 * c), b = _mm512_loadu_si512(vb + 32 * c); \
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);                        \
                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);                        \
                for (int h = 0; h < G; h++) {                                                     \
                    o[h][2 * c] = _mm512_dpbf16_ps(o[h][2 * c], pi[h], lo);                       \
                    o[h][2 * c + 1] = _mm512_dpbf16_ps(o[h][2 * c + 1], pi[h], hi);               \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    PV_STORE_O(G, DV)                                                                             \
}
#endif

/* Every (G, DV) the vector item takes, for one kernel family PREFIX (DEFINE(NAME, ..., G, DV)). */
#define DEFINE_ALL(PREFIX, DEFINE, ...)                                                            \
    DEFINE(PREFIX##_1_4, __VA_ARGS__, 1, 4) DEFINE(PREFIX##_2_4, __VA_ARGS__, 2, 4)                \
    DEFINE(PREFIX##_3_4, __VA_ARGS__, 3, 4) DEFINE(PREFIX##_4_4, __VA_ARGS__, 4, 4)                \
    DEFINE(PREFIX##_1_8, __VA_ARGS__, 1, 8) DEFINE(PREFIX##_2_8, __VA_ARGS__, 2, 8)                \
    DEFINE(PREFIX##_3_8, __VA_ARGS__, 3, 8) DEFINE(PREFIX##_4_8, __VA_ARGS__, 4, 8)                \
    DEFINE(PREFIX##_1_16, __VA_ARGS__, 1, 16) DEFINE(PREFIX##_2_16, __VA_ARGS__, 2, 16)            \
    DEFINE(PREFIX##_1_2, __VA_ARGS__, 1, 2) DEFINE(PREFIX##_2_2, __VA_ARGS__, 2, 2)                \
    DEFINE(PREFIX##_3_2, __VA_ARGS__, 3, 2) DEFINE(PREFIX##_4_2, __VA_ARGS__, 4, 2)                \
    DEFINE(PREFIX##_1_1, __VA_ARGS__, 1, 1) DEFINE(PREFIX##_2_1, __VA_ARGS__, 2, 1)                \
    DEFINE(PREFIX##_3_1, __VA_ARGS__, 3, 1) DEFINE(PREFIX##_4_1, __VA_ARGS__, 4, 1)
/* The DP kernels take no type and load arguments: a pair of dummies keeps DEFINE_ALL's shape. */
#define DEFINE_SCORES_DP_(NAME, T, LOAD, G, DV) DEFINE_SCORES_DP(NAME, G, DV)
#define DEFINE_PV_DP_(NAME, T, LOAD, G, DV) DEFINE_PV_DP(NAME, G, DV)

#define DEFINE_FAMILY(T, LOAD)                                                                    \
    typedef void (*scores_##T##_fn)(const float *, const T *const *, int, int64_t, float, float *, int); \
    typedef void (*pv_##T##_fn)(float *, const T *const *, int, int64_t, const float *, const uint16_t *, int); \
    DEFINE_ALL(scores_##T, DEFINE_SCORES, T, LOAD)                                                \
    DEFINE_ALL(pv_##T, DEFINE_PV, T, LOAD)
DEFINE_FAMILY(float, load16_f32)
DEFINE_FAMILY(uint16_t, load16_bf16)
DEFINE_FAMILY(uint8_t, load16_fp8)
DEFINE_FAMILY(int8_t, load16_int8)
#ifdef __AVX512BF16__
DEFINE_ALL(scores_bf16dp, DEFINE_SCORES_DP_, uint16_t, load16_bf16)
DEFINE_ALL(pv_bf16dp, DEFINE_PV_DP_, uint16_t, load16_bf16)
#endif

#define FN_TABLE(NAME, PREFIX)                                                                    \
static __attribute__((unused)) void *NAME(int g, int dv) {                                        \
    /* dv * 8 + g is one key per (g, dv) only for g < 8: a group of 20 with dv 2 read as (4, 4). */   \
    if (g < 1 || g > 4) return 0;                                                                 \
    switch (dv * 8 + g) {                                                                         \
    case 4 * 8 + 1: return (void *)PREFIX##_1_4;  case 4 * 8 + 2: return (void *)PREFIX##_2_4;    \
    case 4 * 8 + 3: return (void *)PREFIX##_3_4;  case 4 * 8 + 4: return (void *)PREFIX##_4_4;    \
    case 8 * 8 + 1: return (void *)PREFIX##_1_8;  case 8 * 8 + 2: return (void *)PREFIX##_2_8;    \
    case 8 * 8 + 3: return (void *)PREFIX##_3_8;  case 8 * 8 + 4: return (void *)PREFIX##_4_8;    \
    case 16 * 8 + 1: return (void *)PREFIX##_1_16; case 16 * 8 + 2: return (void *)PREFIX##_2_16; \
    case 2 * 8 + 1: return (void *)PREFIX##_1_2;  case 2 * 8 + 2: return (void *)PREFIX##_2_2;    \
    case 2 * 8 + 3: return (void *)PREFIX##_3_2;  case 2 * 8 + 4: return (void *)PREFIX##_4_2;    \
    case 1 * 8 + 1: return (void *)PREFIX##_1_1;  case 1 * 8 + 2: return (void *)PREFIX##_2_1;    \
    case 1 * 8 + 3: return (void *)PREFIX##_3_1;  case 1 * 8 + 4: return (void *)PREFIX##_4_1;    \
    default: return 0;                                                                            \
    }                                                                                             \
}
FN_TABLE(scores_fn_float, scores_float) FN_TABLE(pv_fn_float, pv_float)
FN_TABLE(scores_fn_uint16_t, scores_uint16_t) FN_TABLE(pv_fn_uint16_t, pv_uint16_t)
FN_TABLE(scores_fn_uint8_t, scores_uint8_t) FN_TABLE(pv_fn_uint8_t, pv_uint8_t)
FN_TABLE(scores_fn_int8_t, scores_int8_t) FN_TABLE(pv_fn_int8_t, pv_int8_t)
#ifdef __AVX512BF16__
FN_TABLE(scores_fn_bf16dp, scores_bf16dp) FN_TABLE(pv_fn_bf16dp, pv_bf16dp)
#endif

/* One online-softmax step per head over a chunk of n tokens: the scores s[h * ss + i] (padded with
 * -inf to a multiple of 16) become, in place, probabilities against the head's new running max, and
 * the head's earlier outputs o[h * d ...] and sum are rescaled to it. With pb, the probabilities are
 * also rounded to bf16 there (padding included, as zeros) for the vdpbf16ps V products. cap > 0: the
 * scores are soft-capped first (cap * tanh(s / cap)). */
static void chunk_softmax(float *restrict s, uint16_t *restrict pb, int ss, int n, int heads, int d, float cap,
                          float *restrict m, float *restrict l, float *restrict o) {
    const int nv = (n + 15) / 16;
    const __m512 capv = _mm512_set1_ps(cap), inv_cap = _mm512_set1_ps(cap > 0.f ? 1.f / cap : 0.f);
    for (int h = 0; h < heads; h++) {
        float *sh = s + (int64_t)h * ss;
        /* The cap goes on here rather than in the score kernels: one pass over scores still in L1, and the
         * many (G, DV) score kernels stay as they are. The -inf padding stays -inf. */
        if (cap > 0.f)
            for (int v = 0; v < nv; v++) _mm512_storeu_ps(sh + 16 * v, softcap16(_mm512_loadu_ps(sh + 16 * v), capv, inv_cap));
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int v = 0; v < nv; v++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sh + 16 * v));
        const float cmax = _mm512_reduce_max_ps(mx);
        const float mt = m[h] > cmax ? m[h] : cmax;
        const float alpha = m[h] == -INFINITY ? 0.f : expf(m[h] - mt); /* first chunk: outputs still 0 */
        for (int j = 0; j < d; j++) o[(int64_t)h * d + j] *= alpha;
        const __m512 mtv = _mm512_set1_ps(mt);
        __m512 sum = _mm512_setzero_ps();
        for (int v = 0; v < nv; v++) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + 16 * v), mtv));
            _mm512_storeu_ps(sh + 16 * v, e);
            sum = _mm512_add_ps(sum, e);
#ifdef __AVX512BF16__
            if (pb) _mm256_storeu_si256((__m256i *)(pb + (int64_t)h * ss + 16 * v), (__m256i)_mm512_cvtneps_pbh(e));
#endif
        }
        l[h] = l[h] * alpha + _mm512_reduce_add_ps(sum);
        m[h] = mt;
    }
}

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
/* The item for the vector path, over ALL KV heads of one request (a tile's K and V rows are then
 * read as contiguous runs of memory), chunk by chunk (see SCORE_BUF). */
/* Q_BF16: the score kernels take q as bf16 (the vdpbf16ps ones), else as float32; either way unscaled. */
/* V_DP: the V kernels take bf16 probabilities and leave even-DV outputs permuted (see unpermute_dp). */
#define DEFINE_ITEM_AVX(NAME, T, TABLE, Q_BF16, V_DP)                                             \
static void NAME(const float *restrict q, const T *restrict cache, int64_t page_stride,          \
                 int block_size, const int32_t *restrict blocks, int start, int t0, int t1,       \
                 int num_kv_heads, int g, int d, int64_t row, int64_t v_offset, float scale,     \
                 float cap, float *restrict o, float *restrict m, float *restrict l) {           \
    const int heads = num_kv_heads * g, dv = d / 16;                                              \
    const scores_##T##_fn score = (scores_##T##_fn)scores_fn_##TABLE(g, dv);                      \
    const pv_##T##_fn pv = (pv_##T##_fn)pv_fn_##TABLE(g, dv);                                     \
    float qs[AVX_MAX_HEADS * 16 * AVX_MAX_DV] __attribute__((aligned(64)));                       \
    float os[AVX_MAX_HEADS * 16 * AVX_MAX_DV] __attribute__((aligned(64)));                       \
    float s[SCORE_BUF] __attribute__((aligned(64)));                                              \
    uint16_t pb[SCORE_BUF] __attribute__((aligned(64)));                                          \
    const T *rows[MAX_CHUNK];                                                                     \
    /* The first two tiles' keys, asked for while q is converted (the loop below asks two tiles     \
     * ahead, so an item would otherwise start on keys still in memory). */                       \
    PREFETCH(T, start + t0, start + t1, 0);                                                       \
    PREFETCH(T, start + t0 + TILE, start + t1, 0);                                                \
    uint16_t *qb = (uint16_t *)qs;                                                                \
    for (int i = 0; i < heads * d; i++) {                                                         \
        if (Q_BF16) qb[i] = f32_to_bf16(q[i]); else qs[i] = q[i];                                 \
        os[i] = 0.f;                                                                              \
    }                                                                                             \
    for (int h = 0; h < heads; h++) { m[h] = -INFINITY; l[h] = 0.f; }                             \
    const int fit = SCORE_BUF / heads / TILE * TILE;                                              \
    const int ss = fit < MAX_CHUNK ? fit : MAX_CHUNK;                                             \
    const int bf16_p = V_DP && dv % 2 == 0;                                                       \
    const int64_t v_bytes = v_offset * (int64_t)sizeof(T);                                        \
    for (int c0 = t0; c0 < t1; c0 += ss) {                                                        \
        const int nc = t1 - c0 < ss ? t1 - c0 : ss;                                               \
        GATHER_ROWS(T, rows, start + c0, nc)                                                   \
        for (int tile = 0; tile < nc; tile += TILE) {                                             \
            const int n = nc - tile < TILE ? nc - tile : TILE;                                    \
            for (int kh = 0; kh < num_kv_heads; kh++) {                                           \
                PREFETCH_PART(T, start + c0 + tile + 2 * TILE, start + t1, 0, kh, num_kv_heads);   \
                if (tile < 2 * TILE) PREFETCH_PART(T, start + c0 + tile, start + c0 + nc, v_bytes, kh, num_kv_heads); \
                const float *qk = Q_BF16 ? (const float *)(qb + (int64_t)kh * g * d) : qs + (int64_t)kh * g * d; \
                score(qk, rows + tile, n, (int64_t)kh * d, scale, s + (int64_t)kh * g * ss + tile, ss); \
            }                                                                                     \
        }                                                                                         \
        chunk_softmax(s, bf16_p ? pb : NULL, ss, nc, heads, d, cap, m, l, os);                         \
        for (int tile = 0; tile < nc; tile += TILE) {                                             \
            const int n = nc - tile < TILE ? nc - tile : TILE;                                    \
            for (int kh = 0; kh < num_kv_heads; kh++) {                                           \
                PREFETCH_PART(T, start + c0 + tile + 2 * TILE, start + c0 + nc, v_bytes, kh, num_kv_heads); \
                const int64_t h0 = (int64_t)kh * g;                                               \
                pv(os + h0 * d, rows + tile, n, v_offset + (int64_t)kh * d, s + h0 * ss + tile,   \
                   pb + h0 * ss + tile, ss);                                                      \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    if (V_DP && dv % 2 == 0) unpermute_dp(os, heads, d);                                          \
    memcpy(o, os, sizeof(float) * (size_t)heads * d);                                             \
}

DEFINE_ITEM_AVX(item_avx_f32, float, float, 0, 0)
DEFINE_ITEM_AVX(item_avx_fp8, uint8_t, uint8_t, 0, 0)
DEFINE_ITEM_AVX(item_avx_int8, int8_t, int8_t, 0, 0)
#ifdef __AVX512BF16__
DEFINE_ITEM_AVX(item_avx_bf16, uint16_t, bf16dp, 1, 1)
#else
DEFINE_ITEM_AVX(item_avx_bf16, uint16_t, uint16_t, 0, 0)
#endif
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The whole-request item for AVX2 (8 lanes, 16 registers), a tile (TILE tokens) at a time: every score
 * of the tile, one softmax step per head, then the tile's V products. Scores take one token's K row
 * whole and in order, up to 4 query heads of a KV head at once, so each K vector is loaded once for the
 * heads sharing it; V products take 16 dimensions (one 64-byte line of float32) of up to 4 heads over
 * the tile's tokens. While a tile computes, the next tile's K (during its scores) and V (during its V
 * products) are asked for, in shares, so memory always has the next tile in flight.
 * Why not the AVX-512 item's chunks of 256 tokens: their V rows, asked for during the chunk's scores,
 * were not yet in cache when the V products ran, which then waited on them with no further reads in
 * flight. AMD EPYC (Zen 3, AVX2 only), 2 threads, SmolLM2's 9 x 3 heads of 64, float32 pages scattered
 * over memory, ctypes A/B: batch 64 x 512 tokens 6067 -> 4018 us (8.3 -> 12.5 GB/s), 16 x 2048 and
 * 256 x 128 the same, one request of 8192 1993 -> 1374 us; bf16 pages 1.2-1.27x; from L3 level.
 * Head sizes a multiple of 16, up to 16 * AVX2_MAX_DV. */
#include <immintrin.h>

#define AVX2_MAX_DV 16

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* As load16_fp8: the e4m3fn fields shifted into a float16 (2^-8 of the value), widened exactly. */
static inline __m256 load8_fp8(const uint8_t *p) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7),
                                   _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
static inline __m256 load8_int8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The four sums of a0..a3's lanes, in order. */
static inline __m128 sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Unscaled scores of two tokens' K rows k0, k1 (k[0..d) each) for GG (<= 4) query heads q[h * d ...] into
 * s[h * ss] and s[h * ss + 1]. Each row is read whole and in order (kh after kh), the stream a hardware
 * prefetcher follows; each query vector is loaded once for both tokens. A lone last token is passed as
 * both rows (its second score lands in the tile's next, unused slot): each lane sums in the same order. */
#define DEFINE_SCORES_ROW2(NAME, T, LOAD, GG)                                                      \
static inline void NAME(const float *restrict q, int d, const T *restrict k0, const T *restrict k1, \
                        float *restrict s, int ss) {                                              \
    __m256 acc[4][2];                                                                             \
    for (int h = 0; h < GG; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();                     \
    for (int j = 0; j < d; j += 8) {                                                              \
        const __m256 kv0 = LOAD(k0 + j), kv1 = LOAD(k1 + j);                                      \
        for (int h = 0; h < GG; h++) {                                                            \
            const __m256 qh = _mm256_loadu_ps(q + (int64_t)h * d + j);                            \
            acc[h][0] = _mm256_fmadd_ps(qh, kv0, acc[h][0]);                                      \
            acc[h][1] = _mm256_fmadd_ps(qh, kv1, acc[h][1]);                                      \
        }                                                                                         \
    }                                                                                             \
    for (int h = 0; h < GG; h += 2) {                                                             \
        const int h1 = h + 1 < GG ? h + 1 : h;                                                    \
        float out[4];                                                                             \
        _mm_storeu_ps(out, sum4x8(acc[h][0], acc[h][1], acc[h1][0], acc[h1][1]));                 \
        s[(int64_t)h * ss] = out[0], s[(int64_t)h * ss + 1] = out[1];                             \
        if (h + 1 < GG) s[(int64_t)h1 * ss] = out[2], s[(int64_t)h1 * ss + 1] = out[3];           \
    }                                                                                             \
}

/* o[h * d + 0..16) of GG heads plus sum_i p[h * ss + i] V_i over the chunk's n tokens (v: each token's
 * 16 values of this head block). */
#define DEFINE_PV16(NAME, T, LOAD, GG)                                                             \
static inline void NAME(float *restrict o, int d, const T *const *rows, int n, int64_t v_off,     \
                        const float *restrict p, int ss) {                                        \
    __m256 acc[GG][2];                                                                            \
    for (int h = 0; h < GG; h++) {                                                                \
        acc[h][0] = _mm256_loadu_ps(o + (int64_t)h * d);                                          \
        acc[h][1] = _mm256_loadu_ps(o + (int64_t)h * d + 8);                                      \
    }                                                                                             \
    for (int i = 0; i < n; i++) {                                                                 \
        const T *v = rows[i] + v_off;                                                             \
        const __m256 v0 = LOAD(v), v1 = LOAD(v + 8);                                              \
        for (int h = 0; h < GG; h++) {                                                            \
            const __m256 ph = _mm256_broadcast_ss(p + (int64_t)h * ss + i);                       \
            acc[h][0] = _mm256_fmadd_ps(ph, v0, acc[h][0]);                                       \
            acc[h][1] = _mm256_fmadd_ps(ph, v1, acc[h][1]);                                       \
        }                                                                                         \
    }                                                                                             \
    for (int h = 0; h < GG; h++) {                                                                \
        _mm256_storeu_ps(o + (int64_t)h * d, acc[h][0]);                                          \
        _mm256_storeu_ps(o + (int64_t)h * d + 8, acc[h][1]);                                      \
    }                                                                                             \
}

#define DEFINE_ITEM_AVX2(NAME, T, LOAD)                                                           \
DEFINE_SCORES_ROW2(NAME##_p1, T, LOAD, 1) DEFINE_SCORES_ROW2(NAME##_p2, T, LOAD, 2)              \
DEFINE_SCORES_ROW2(NAME##_p3, T, LOAD, 3) DEFINE_SCORES_ROW2(NAME##_p4, T, LOAD, 4)              \
DEFINE_PV16(NAME##_v1, T, LOAD, 1) DEFINE_PV16(NAME##_v2, T, LOAD, 2)                            \
DEFINE_PV16(NAME##_v3, T, LOAD, 3) DEFINE_PV16(NAME##_v4, T, LOAD, 4)                            \
static void NAME(const float *restrict q, const T *restrict cache, int64_t page_stride,          \
                 int block_size, const int32_t *restrict blocks, int start, int t0, int t1,       \
                 int num_kv_heads, int g, int d, int64_t row, int64_t v_offset, float scale,     \
                 float cap, float *restrict o, float *restrict m, float *restrict l) {           \
    const int heads = num_kv_heads * g;                                                           \
    float os[MAX_ITEM_HEADS * 16 * AVX2_MAX_DV] __attribute__((aligned(64)));                     \
    float s[MAX_ITEM_HEADS * TILE] __attribute__((aligned(64)));                                  \
    const T *rows[TILE];                                                                          \
    memset(os, 0, sizeof(float) * (size_t)heads * d);                                             \
    for (int h = 0; h < heads; h++) { m[h] = -INFINITY; l[h] = 0.f; }                             \
    const int64_t v_bytes = v_offset * (int64_t)sizeof(T);                                        \
    const int passes = num_kv_heads * (d / 16) * ((g + 3) / 4); /* V products per tile */         \
    PREFETCH(T, start + t0, start + t1, 0);                                                       \
    PREFETCH(T, start + t0, start + t1, v_bytes);                                                 \
    for (int c0 = t0; c0 < t1; c0 += TILE) {                                                      \
        const int n = t1 - c0 < TILE ? t1 - c0 : TILE;                                            \
        const int nx = start + c0 + TILE; /* the next tile */                                     \
        GATHER_ROWS(T, rows, start + c0, n)                                                       \
        for (int i = 0; i < n; i += 2) {                                                          \
            if (i % 4 == 0) PREFETCH_PART(T, nx, start + t1, 0, i / 4, TILE / 4);                  \
            for (int kh = 0; kh < num_kv_heads; kh++)                                             \
                for (int h0 = 0; h0 < g; h0 += 4) {                                               \
                    const int64_t h = (int64_t)kh * g + h0;                                       \
                    const float *qh = q + h * d;                                                  \
                    const T *k = rows[i] + (int64_t)kh * d;                                       \
                    const T *k1 = rows[i + 1 < n ? i + 1 : i] + (int64_t)kh * d;                  \
                    float *sh = s + h * TILE + i;                                                 \
                    switch (g - h0 < 4 ? g - h0 : 4) {                                            \
                    case 4: NAME##_p4(qh, d, k, k1, sh, TILE); break;                             \
                    case 3: NAME##_p3(qh, d, k, k1, sh, TILE); break;                             \
                    case 2: NAME##_p2(qh, d, k, k1, sh, TILE); break;                             \
                    default: NAME##_p1(qh, d, k, k1, sh, TILE); break;                            \
                    }                                                                             \
                }                                                                                 \
        }                                                                                         \
        softmax_step(s, TILE, n, heads, d, scale, cap, m, l, os);                                 \
        int pass = 0;                                                                             \
        for (int kh = 0; kh < num_kv_heads; kh++)                                                 \
            for (int j = 0; j < d; j += 16)                                                       \
                for (int h0 = 0; h0 < g; h0 += 4, pass++) {                                       \
                    PREFETCH_PART(T, nx, start + t1, v_bytes, pass, passes); /* a share per pass */ \
                    const int64_t h = (int64_t)kh * g + h0;                                       \
                    float *oh = os + h * d + j;                                                   \
                    const int64_t off = v_offset + (int64_t)kh * d + j;                           \
                    switch (g - h0 < 4 ? g - h0 : 4) {                                            \
                    case 4: NAME##_v4(oh, d, rows, n, off, s + h * TILE, TILE); break;            \
                    case 3: NAME##_v3(oh, d, rows, n, off, s + h * TILE, TILE); break;            \
                    case 2: NAME##_v2(oh, d, rows, n, off, s + h * TILE, TILE); break;            \
                    default: NAME##_v1(oh, d, rows, n, off, s + h * TILE, TILE); break;           \
                    }                                                                             \
                }                                                                                 \
    }                                                                                             \
    memcpy(o, os, sizeof(float) * (size_t)heads * d);                                             \
}

DEFINE_ITEM_AVX2(item_avx2_f32, float, load8_f32)
DEFINE_ITEM_AVX2(item_avx2_bf16, uint16_t, load8_bf16)
DEFINE_ITEM_AVX2(item_avx2_fp8, uint8_t, load8_fp8)
DEFINE_ITEM_AVX2(item_avx2_int8, int8_t, load8_int8)
#define AVX2_ITEMS 1
#else
#define AVX2_ITEMS 0
#endif

#ifdef __AVX512F__
static int whole_request_items(int group, int num_kv_heads, int d) {
    return d % 16 == 0 && d <= 16 * AVX_MAX_DV && group * num_kv_heads <= AVX_MAX_HEADS
           && scores_fn_float(group, d / 16) != 0;
}
#elif AVX2_ITEMS
static int whole_request_items(int group, int num_kv_heads, int d) {
    return d % 16 == 0 && d <= 16 * AVX2_MAX_DV && group * num_kv_heads <= MAX_ITEM_HEADS;
}
#define item_avx_f32 item_avx2_f32
#define item_avx_bf16 item_avx2_bf16
#define item_avx_fp8 item_avx2_fp8
#define item_avx_int8 item_avx2_int8
#else
static int whole_request_items(int group, int num_kv_heads, int d) { (void)group; (void)num_kv_heads; (void)d; return 0; }
#define item_avx_f32 item_f32
#define item_avx_bf16 item_bf16
#define item_avx_fp8 item_fp8
#define item_avx_int8 item_int8
#endif

/* Outputs of `heads` heads divided by their softmax sums (0 where a sum is 0: nothing visible); with
 * sinks (one logit per head, NULL: none), each sink joins its head's sum (see sink_factor). */
static void normalize(float *restrict o, const float *restrict m, const float *restrict l,
                      const float *restrict sinks, int heads, int d) {
    for (int h = 0; h < heads; h++) {
        const float inv = sinks ? sink_factor(m[h], l[h], sinks[h]) : l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int j = 0; j < d; j++) o[(int64_t)h * d + j] *= inv;
    }
}

/* How many splits a request of n visible tokens gets: enough items for every thread, but splits
 * of at least MIN_SPLIT tokens (merging costs a little per split), except for a request that has the
 * threads to itself (see below). */
#define MIN_SPLIT 256
#define MIN_SPLIT_SHORT 48
int kernels_batch_invariant(void); /* csrc/qlinear.c */
static int num_splits(int n, int base_items, int threads) {
    /* Batch invariance: a request's splits (so the order its sums are merged in) from its own length
     * alone, never from how many requests share the call. */
    if (kernels_batch_invariant()) base_items = 1;
    int want = (4 * threads + base_items - 1) / base_items;
    int most = (n + MIN_SPLIT - 1) / MIN_SPLIT;
    /* Fewer items than threads (a lone request, served one at a time): its splits a multiple of the
     * threads, down to MIN_SPLIT_SHORT tokens each, so no thread waits while another attends the rest
     * (one request of 200 tokens, 2 threads: 22.6 -> 16.7 us a layer; of 600, 3 splits -> 4: 40.9 -> 34.2). */
    if (base_items < threads && n >= threads * MIN_SPLIT_SHORT) most = (most + threads - 1) / threads * threads;
    if (want > most) want = most;
    return want < 1 ? 1 : want;
}

/* Cascade attention for decodes that share a cached prefix (requests of one system prompt, the n
 * samples of one prompt): requests whose block tables begin with the same pages are a group, the
 * pages all of them have in common (whole pages, at least MIN_SHARED tokens, short of each
 * request's last token) its prefix. The prefix is attended once per group with every member's query
 * heads as rows of one tiled item (shared_prefix_item, in csrc/prefill_attention.c), the rest of
 * each request by the items here, in the same parallel loop (the shared prefixes' items first), and the
 * two merged as splits are. Groups come from the block
 * tables alone, so any pages two requests share are read once, whoever wrote them. */
#define MIN_SHARED 64
static int cascade_enabled = 1;
static int last_groups = 0; /* groups the last call cascaded (tests look) */
int paged_decode_last_groups(void) { return last_groups; }
void paged_decode_set_cascade(int on) { cascade_enabled = on; }
int paged_decode_cascade_on(void) { return cascade_enabled; }

/* Groups as CSR (members[member0[j] .. member0[j + 1]), leader first), each group's shared token
 * count tokens[j], and each request's (shared[r], 0: none); returns the number of groups. First pages
 * are matched through a hash table of 2n slots, so a step of n requests costs O(n) plus the pages
 * compared. */
static int find_shared(const int32_t *table, int max_blocks, const int32_t *seq_lens, int n, int block_size,
                       int *shared, int *members, int *member0, int *tokens) {
    int cap = 2;
    while (cap < 2 * n) cap *= 2;
    int *slots = (int *)malloc(sizeof(int) * (size_t)(cap + 3 * n));
    int *leader = slots + cap, *next = leader + n, *tail = next + n;
    for (int i = 0; i < cap; i++) slots[i] = -1;
    for (int r = 0; r < n; r++) {
        shared[r] = 0;
        leader[r] = next[r] = -1;
        tail[r] = r;
        if (seq_lens[r] <= block_size) continue; /* no whole page before its last token */
        const int32_t b0 = table[(int64_t)r * max_blocks];
        int h = (int)(((uint32_t)b0 * 2654435761u) & (uint32_t)(cap - 1));
        while (slots[h] >= 0 && table[(int64_t)slots[h] * max_blocks] != b0) h = (h + 1) & (cap - 1);
        if (slots[h] < 0) {
            slots[h] = r;
            leader[r] = r;
        } else {
            const int l = slots[h];
            leader[r] = l;
            next[tail[l]] = r;
            tail[l] = r;
        }
    }
    int groups = 0, at = 0;
    member0[0] = 0;
    for (int l = 0; l < n; l++) {
        if (leader[l] != l || next[l] < 0) continue;
        const int32_t *lt = table + (int64_t)l * max_blocks;
        int common = (seq_lens[l] - 1) / block_size;
        for (int r = next[l]; r >= 0; r = next[r]) {
            const int32_t *rt = table + (int64_t)r * max_blocks;
            const int most = (seq_lens[r] - 1) / block_size;
            if (most < common) common = most;
            int k = 1; /* page 0 matched already */
            while (k < common && lt[k] == rt[k]) k++;
            common = k;
        }
        if (common * block_size < MIN_SHARED) continue;
        for (int r = l; r >= 0; r = next[r]) {
            members[at++] = r;
            shared[r] = common * block_size;
        }
        tokens[groups] = common * block_size;
        member0[++groups] = at;
    }
    free(slots);
    return groups;
}

/* Cascade on AVX2 (no AVX512-BF16 prefill kernel to borrow): a group's shared prefix is attended by the
 * whole-request item itself, once, for a virtual request whose query heads are every member's heads
 * (per KV head, member after member), so each shared K and V row is read once per group instead of
 * once per member; its outputs go to each member's partial slots and merge with the member's own
 * tokens as splits do. A group takes items of up to MAX_ITEM_HEADS / num_heads members, and where
 * those items would leave threads idle (one request's verify step: 5 rows, one item) its prefix is
 * cut into key pieces, each a partial more. */
#if AVX2_ITEMS
#define VCASCADE 1
#define VP_MIN_PIECE 64 /* shared keys per piece */
typedef struct {
    int group, m0, m1, piece, pieces; /* members[m0 .. m1) of group `group`, key piece `piece` */
} vprefix_item;

/* The items of the groups' prefixes (most: members per item), into *out (malloc'd), and each group's
 * key pieces into pieces[j]; returns how many items. */
static int64_t vprefix_plan(int groups, const int *member0, const int *tokens, int most, int threads,
                            int *pieces, vprefix_item **out) {
    int64_t whole = 0, items = 0;
    for (int j = 0; j < groups; j++) whole += (member0[j + 1] - member0[j] + most - 1) / most;
    const int64_t want = 2 * (int64_t)threads;
    const int64_t cut = whole >= want ? 1 : (want + whole - 1) / whole;
    for (int j = 0; j < groups; j++) {
        const int64_t fit = tokens[j] / VP_MIN_PIECE;
        pieces[j] = (int)(cut < fit ? cut : fit > 1 ? fit : 1);
        items += (int64_t)pieces[j] * ((member0[j + 1] - member0[j] + most - 1) / most);
    }
    vprefix_item *it = (vprefix_item *)malloc(sizeof(vprefix_item) * (size_t)items);
    int64_t n = 0;
    for (int j = 0; j < groups; j++) {
        for (int m0 = member0[j]; m0 < member0[j + 1]; m0 += most)
            for (int p = 0; p < pieces[j]; p++) {
                const int m1 = m0 + most < member0[j + 1] ? m0 + most : member0[j + 1];
                it[n++] = (vprefix_item){j, m0, m1, p, pieces[j]};
            }
    }
    *out = it;
    return n;
}

/* One prefix item: its members' query heads gathered as one virtual request (KV head kh's rows are
 * member after member, each member's `group` heads in order), attended over the item's piece of the
 * shared keys by WHOLE, the partials scattered to slot[r] + piece of each member r. */
#define DEFINE_VPREFIX(NAME, T, WHOLE)                                                            \
static void NAME(const vprefix_item *it, const int *members, const int *tokens, const int *slot,  \
                 const float *q, const T *cache, int64_t page_stride, int block_size,             \
                 const int32_t *block_table, int max_blocks, int num_heads, int num_kv_heads,     \
                 int group, int d, int64_t row, int64_t v_offset, float scale, float cap,         \
                 float *pm, float *pl, float *po) {                                               \
    const int M = it->m1 - it->m0, gg = M * group, heads = num_kv_heads * gg;                     \
    const int64_t span = tokens[it->group];                                                       \
    const int t0 = (int)(span * it->piece / it->pieces), t1 = (int)(span * (it->piece + 1) / it->pieces); \
    float *qv = (float *)malloc(sizeof(float) * ((size_t)2 * heads * d + 2 * (size_t)heads));     \
    float *o = qv + (int64_t)heads * d, *m = o + (int64_t)heads * d, *l = m + heads;              \
    for (int mi = 0; mi < M; mi++)                                                                \
        for (int kh = 0; kh < num_kv_heads; kh++)                                                 \
            memcpy(qv + ((int64_t)(kh * M + mi) * group) * d,                                     \
                   q + ((int64_t)members[it->m0 + mi] * num_heads + (int64_t)kh * group) * d,     \
                   sizeof(float) * (size_t)group * d);                                            \
    WHOLE(qv, cache, page_stride, block_size, block_table + (int64_t)members[it->m0] * max_blocks, 0, t0, t1, \
          num_kv_heads, gg, d, row, v_offset, scale, cap, o, m, l);                               \
    for (int mi = 0; mi < M; mi++) {                                                              \
        const int64_t at = (int64_t)(slot[members[it->m0 + mi]] + it->piece) * num_heads;         \
        for (int kh = 0; kh < num_kv_heads; kh++)                                                 \
            for (int gi = 0; gi < group; gi++) {                                                  \
                const int64_t src = (int64_t)(kh * M + mi) * group + gi, h = at + kh * group + gi; \
                pm[h] = m[src], pl[h] = l[src];                                                   \
                memcpy(po + h * d, o + src * d, sizeof(float) * (size_t)d);                       \
            }                                                                                     \
    }                                                                                             \
    free(qv);                                                                                     \
}
DEFINE_VPREFIX(vprefix_f32, float, item_avx_f32)
DEFINE_VPREFIX(vprefix_bf16, uint16_t, item_avx_bf16)
DEFINE_VPREFIX(vprefix_fp8, uint8_t, item_avx_fp8)
DEFINE_VPREFIX(vprefix_int8, int8_t, item_avx_int8)
#else
#define VCASCADE 0
typedef struct vprefix_item vprefix_item;
#define vprefix_plan(...) ((int64_t)0)
#define vprefix_f32(...) abort()
#define vprefix_bf16(...) abort()
#define vprefix_fp8(...) abort()
#define vprefix_int8(...) abort()
#endif

#ifdef __AVX512BF16__
void shared_prefix_pieces(int num_groups, const int *member0, const int *tokens, int num_kv_heads, int g, int d,
                          int threads, int *pieces, int *per);
/* A call's shared-prefix items (csrc/prefill_attention.c): begin (find or pack the prefixes), items
 * run by any thread with its own scratch, end. */
typedef struct shared_prefix_step shared_prefix_step;
shared_prefix_step *shared_prefix_begin(const float *q, const uint16_t *cache, int64_t page_stride, int block_size,
                                        const int32_t *block_table, int max_blocks, int num_groups,
                                        const int *members, const int *member0, const int *tokens,
                                        const int *pieces, const int *per, const int *slot, int num_heads,
                                        int num_kv_heads, int d, float scale, float cap, float *pm, float *pl,
                                        float *po, const int64_t *epochs);
int64_t shared_prefix_items(const shared_prefix_step *st);
void *shared_prefix_scratch(const shared_prefix_step *st);
void shared_prefix_scratch_end(const shared_prefix_step *st, void *w);
void shared_prefix_item(const shared_prefix_step *st, int64_t it, int64_t nth, void *scratch);
void shared_prefix_end(shared_prefix_step *st);
#define CASCADE_BF16 1
#else
#define CASCADE_BF16 0
typedef struct shared_prefix_step shared_prefix_step;
#define shared_prefix_pieces(groups, member0, tokens, kv_heads, g, d, threads, pieces, per) ((void)(per), abort())
#define shared_prefix_begin(...) (abort(), (shared_prefix_step *)NULL)
#define shared_prefix_items(st) ((void)(st), (int64_t)0)
#define shared_prefix_scratch(st) ((void)(st), (void *)NULL)
#define shared_prefix_scratch_end(st, w) ((void)(st), (void)(w))
#define shared_prefix_item(st, it, nth, w) ((void)(st), (void)(it), (void)(nth), (void)(w), abort())
#define shared_prefix_end(st) ((void)(st), abort())
#endif
int paged_prefill_supports(int num_heads, int num_kv_heads, int head_size); /* prefill_attention.c, every build */

#define DEFINE_DECODE(NAME, T, ITEM, WHOLE, CASCADE, VPREFIX)                                              \
void NAME(const float *q, const T *cache, int64_t page_stride, int block_size,                   \
          const int32_t *block_table, int max_blocks, const int32_t *seq_lens, int num_reqs,     \
          int num_heads, int num_kv_heads, int head_size, float scale, int window, float *out,   \
          float cap, const float *sinks, const int64_t *epochs) {                                 \
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
    int *first = (int *)malloc(sizeof(int) * (size_t)(9 * num_reqs + 2));                         \
    /* shared[r]: tokens of request r attended with its group (see find_shared); the last parts[r] \
     * of its splits, from slot[r], are then the group's partials (one per piece of its prefix),   \
     * and the others cover [shared[r], len). */                                                  \
    int *shared = first + num_reqs + 1, *members = shared + num_reqs, *member0 = members + num_reqs; \
    int *slot = member0 + num_reqs + 1, *tokens = slot + num_reqs, *pieces = tokens + num_reqs;   \
    int *parts = pieces + num_reqs, *per = parts + num_reqs;                                      \
    const int cascade = cascade_enabled && !kernels_batch_invariant() && whole && window <= 0 && num_reqs > 1; \
    const int use_sp = CASCADE && cascade && paged_prefill_supports(num_heads, num_kv_heads, d);  \
    /* AVX2's own cascade: members per item, all their heads one whole-request item's */         \
    const int vmost = VCASCADE && cascade && !use_sp ? MAX_ITEM_HEADS / num_heads : 0;          \
    const int groups = use_sp || vmost >= 2                                                       \
        ? find_shared(block_table, max_blocks, seq_lens, num_reqs, block_size, shared, members, member0, tokens) \
        : 0;                                                                                      \
    last_groups = groups;                                                                         \
    if (!groups) memset(shared, 0, sizeof(int) * (size_t)num_reqs);                               \
    memset(parts, 0, sizeof(int) * (size_t)num_reqs);                                             \
    vprefix_item *vitems = NULL;                                                                  \
    int64_t vp_items = 0;                                                                         \
    if (groups) {                                                                                 \
        if (use_sp)                                                                               \
            shared_prefix_pieces(groups, member0, tokens, num_kv_heads, group, d, threads, pieces, per); \
        else                                                                                      \
            vp_items = vprefix_plan(groups, member0, tokens, vmost, threads, pieces, &vitems);    \
        for (int j = 0; j < groups; j++)                                                          \
            for (int m = member0[j]; m < member0[j + 1]; m++) parts[members[m]] = pieces[j];      \
    }                                                                                             \
    first[0] = 0;                                                                                 \
    for (int r = 0; r < num_reqs; r++) {                                                          \
        const int len = seq_lens[r];                                                              \
        const int n = (window > 0 && len > window) ? window : len;                                \
        first[r + 1] = first[r] + num_splits(n - shared[r], base, threads) + parts[r];            \
        slot[r] = first[r + 1] - parts[r];                                                        \
    }                                                                                             \
    const int total_splits = first[num_reqs];                                                     \
    const int64_t items = (int64_t)total_splits * per_split;                                      \
    /* Partial results per (split, query head): max, sum, unnormalized output. */                \
    const int merge = total_splits > num_reqs;                                                    \
    float *pm = merge ? (float *)malloc(sizeof(float) * (size_t)total_splits * num_heads) : NULL; \
    float *pl = merge ? (float *)malloc(sizeof(float) * (size_t)total_splits * num_heads) : NULL; \
    float *po = merge ? (float *)malloc(sizeof(float) * (size_t)total_splits * num_heads * d) : NULL; \
    shared_prefix_step *sp = groups && use_sp ? shared_prefix_begin(q, (const uint16_t *)cache, page_stride, block_size,   \
                                                          block_table, max_blocks, groups, members, member0, \
                                                          tokens, pieces, per, slot, num_heads, num_kv_heads, \
                                                          d, scale, cap, pm, pl, po, epochs)              \
                                    : NULL;                                                       \
    const int64_t sp_items = sp ? shared_prefix_items(sp) : 0;                                    \
    _Pragma("omp parallel")                                                                       \
    {                                                                                             \
    void *sp_w = sp ? shared_prefix_scratch(sp) : NULL;                                           \
    const int64_t nth = omp_get_num_threads();                                                    \
    _Pragma("omp for schedule(dynamic, 1)")                                                       \
    for (int64_t at = 0; at < sp_items + vp_items + items; at++) {                                \
        if (at < sp_items) {                                                                      \
            shared_prefix_item(sp, at, nth, sp_w);                                                \
            continue;                                                                             \
        }                                                                                         \
        if (at < sp_items + vp_items) {                                                           \
            VPREFIX(vitems + (at - sp_items), members, tokens, slot, q, cache, page_stride, block_size, \
                    block_table, max_blocks, num_heads, num_kv_heads, group, d, row, v_offset, scale, cap, \
                    pm, pl, po);                                                                  \
            continue;                                                                             \
        }                                                                                         \
        const int64_t it = at - sp_items - vp_items;                                              \
        const int split_index = (int)(it / per_split);                                            \
        const int rest = (int)(it % per_split);                                                   \
        const int kh = rest / chunks, c = rest % chunks;                                          \
        int r = 0; /* the request owning this split */                                           \
        { int lo = 0, hi = num_reqs - 1;                                                          \
          while (lo < hi) { int mid = (lo + hi + 1) / 2;                                          \
                            if (first[mid] <= split_index) lo = mid; else hi = mid - 1; }         \
          r = lo; }                                                                               \
        const int nsplit = first[r + 1] - first[r], k = split_index - first[r];                  \
        const int len = seq_lens[r], sh = shared[r];                                              \
        if (k >= nsplit - parts[r]) continue; /* the group's partials */                           \
        const int start = (window > 0 && len > window) ? len - window : 0;                        \
        const int n = len - start - sh, own = nsplit - parts[r];                                  \
        const int t0 = sh + (int)((int64_t)n * k / own), t1 = sh + (int)((int64_t)n * (k + 1) / own); \
        const int32_t *blocks = block_table + (int64_t)r * max_blocks;                            \
        const int h0 = whole ? 0 : kh * group + c * MAX_GROUP;                                    \
        const int g = group - c * MAX_GROUP < MAX_GROUP ? group - c * MAX_GROUP : MAX_GROUP;      \
        const int64_t slot = (int64_t)split_index * num_heads + h0;                               \
        /* A request of one split has nothing to merge: its item writes out itself. */           \
        float own_m[MAX_ITEM_HEADS], own_l[MAX_ITEM_HEADS];                                       \
        float *io = nsplit == 1 ? out + ((int64_t)r * num_heads + h0) * d : po + slot * d;       \
        float *im = nsplit == 1 ? own_m : pm + slot, *il = nsplit == 1 ? own_l : pl + slot;       \
        if (whole)                                                                                \
            WHOLE(q + (int64_t)r * num_heads * d, cache, page_stride, block_size, blocks, start,  \
                  t0, t1, num_kv_heads, group, d, row, v_offset, scale, cap, io, im, il);         \
        else                                                                                      \
            ITEM(q + ((int64_t)r * num_heads + h0) * d, cache, page_stride, block_size, blocks,   \
                 start, t0, t1, kh, g, d, row, v_offset, scale, cap, io, im, il);                 \
        if (nsplit == 1) normalize(io, im, il, sinks ? sinks + h0 : NULL, whole ? num_heads : g, d); \
    }                                                                                             \
    if (sp) shared_prefix_scratch_end(sp, sp_w);                                                  \
    /* Merge each request's splits: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s; a sink joins \
     * the denominator as e^(sink - M), M raised to it if it is larger. In the items' parallel region \
     * (after their barrier): a region of its own cost about 1 us a call, 5% of a lone request's. */ \
    if (merge) {                                                                                  \
    _Pragma("omp for schedule(static)")                                                           \
    for (int r = 0; r < num_reqs; r++) {                                                          \
        for (int h = 0; h < num_heads && first[r + 1] - first[r] > 1; h++) {                      \
            float M = -INFINITY;                                                                  \
            for (int s = first[r]; s < first[r + 1]; s++)                                         \
                if (pm[(int64_t)s * num_heads + h] > M) M = pm[(int64_t)s * num_heads + h];       \
            const float sink = sinks ? sinks[h] : -INFINITY;                                      \
            const float M0 = M; /* the splits' own max: none saw anything when it is -inf */      \
            if (sink > M) M = sink;                                                               \
            float *restrict oh = out + ((int64_t)r * num_heads + h) * d;                          \
            memset(oh, 0, sizeof(float) * (size_t)d);                                             \
            float L = 0.f;                                                                        \
            for (int s = first[r]; s < first[r + 1]; s++) {                                       \
                const int64_t slot = (int64_t)s * num_heads + h;                                  \
                float w = pm[slot] - M;                                                           \
                exp_tile(&w, 1);                                                                  \
                L += w * pl[slot];                                                                \
                const float *restrict os = po + slot * d;                                         \
                for (int j = 0; j < d; j++) oh[j] += w * os[j];                                   \
            }                                                                                     \
            if (sinks && M0 > -INFINITY) L += expf(sink - M);                                     \
            const float inv = L > 0.f ? 1.f / L : 0.f;                                            \
            for (int j = 0; j < d; j++) oh[j] *= inv;                                             \
        }                                                                                         \
    }                                                                                             \
    }                                                                                             \
    }                                                                                             \
    if (sp) shared_prefix_end(sp);                                                                \
    free(first); free(pm); free(pl); free(po); free(vitems);                                      \
}

DEFINE_DECODE(paged_decode_f32, float, item_f32, item_avx_f32, 0, vprefix_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, item_bf16, item_avx_bf16, CASCADE_BF16, vprefix_bf16)
DEFINE_DECODE(paged_decode_fp8, uint8_t, item_fp8, item_avx_fp8, 0, vprefix_fp8)
DEFINE_DECODE(paged_decode_int8, int8_t, item_int8, item_avx_int8, 0, vprefix_int8)

int paged_decode_max_head_size(void) { return MAX_HEAD; }
int paged_decode_avx2_cascade(void) { return VCASCADE; }

/* This step's K and V into 8-bit pages, in one call where torch took five ops per tensor (about 20 us
 * each at decode sizes, times two, times every layer): element j of token t's K row (k + t * k_stride,
 * row elements contiguous) goes to flat row rows[t], its V row to flat row rows[n + t], each byte what
 * attention.py's torch path writes for it.
 * int8: round(x * inv) (half to even, as torch.round) clamped to [-127, 127], NaN as 0, with inv_k / inv_v
 * the scales' float32 reciprocals.
 * fp8 (e4m3fn): x / scale, rounded to the input's dtype as torch's division is, clamped to +-448, then
 * converted as c10's float -> Float8_e4m3fn is (round to nearest even, subnormals included; NaN stays
 * NaN), with div_k / div_v the scales themselves (1.0: no division). */
static inline int8_t to_int8(float x, float inv) {
    float y = rintf(x * inv);
    y = y > 127.f ? 127.f : y;
    y = y < -127.f ? -127.f : y;
    return y == y ? (int8_t)y : 0;
}

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }

/* c10's fp8e4m3fn_from_fp32_value. Values below 2^-6 (e4m3's smallest normal) are rounded by one float
 * addition to 2^14, whose ulp is e4m3's subnormal step 2^-9: the hardware's round to nearest even. */
static inline uint8_t f32_to_fp8(float f) {
    uint32_t bits = f32_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t out;
    if (bits >= 1087u << 20) { /* 464 and above (448 + half an ulp), inf and NaN */
        out = 0x7f;
    } else if (bits < 121u << 23) {
        const uint32_t denorm = 141u << 23;
        out = (uint8_t)(f32_bits(bits_f32(bits) + bits_f32(denorm)) - denorm);
    } else {
        const uint32_t odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7ffff + odd;
        out = (uint8_t)(bits >> 20);
    }
    return out | (uint8_t)(sign >> 24);
}

static inline float fp8_clamp(float y) { return y > 448.f ? 448.f : y < -448.f ? -448.f : y; }
static inline int8_t to_fp8_f32(float x, float div) { return (int8_t)f32_to_fp8(fp8_clamp(div != 1.f ? x / div : x)); }
static inline int8_t to_fp8_bf16(float x, float div) {
    return (int8_t)f32_to_fp8(fp8_clamp(div != 1.f ? bf16_to_f32(f32_to_bf16(x / div)) : x));
}

static inline float f32_id(float x) { return x; }

#define DEFINE_KV_WRITE(NAME, T, TO_F32, STORE)                                                   \
void NAME(const T *k, int64_t k_stride, const T *v, int64_t v_stride, int64_t n, int row,        \
          int8_t *flat, const int64_t *rows, float sk, float sv) {                                \
    _Pragma("omp parallel for schedule(static) if (n * row > (1 << 18))")                        \
    for (int64_t t = 0; t < 2 * n; t++) {                                                         \
        const int is_v = t >= n;                                                                  \
        const T *restrict src = is_v ? v + (t - n) * v_stride : k + t * k_stride;                 \
        const float sc = is_v ? sv : sk;                                                          \
        int8_t *restrict dst = flat + rows[t] * row;                                              \
        for (int j = 0; j < row; j++) dst[j] = STORE(TO_F32(src[j]), sc);                         \
    }                                                                                             \
}

DEFINE_KV_WRITE(kv_write_int8_f32, float, f32_id, to_int8)
DEFINE_KV_WRITE(kv_write_int8_bf16, uint16_t, bf16_to_f32, to_int8)
DEFINE_KV_WRITE(kv_write_fp8_f32, float, f32_id, to_fp8_f32)
DEFINE_KV_WRITE(kv_write_fp8_bf16, uint16_t, bf16_to_f32, to_fp8_bf16)
