/* Paged prefill attention for CPUs with AVX512-BF16: every prefill chunk of a step in one call,
 * keys and values read in place from the paged KV cache (no gather), causal, with a cached prefix
 * (the chunk's queries sit after num_computed cached tokens) and an optional sliding window.
 *
 * Cache layout per layer (see tokenos/layers/attention.py): page b starts at element
 * b * page_stride; its K rows are [block_size, num_kv_heads, head_size], its V rows follow at
 * + block_size * num_kv_heads * head_size. The chunk's own K/V are already written there.
 *
 * Two phases, each one parallel loop:
 *  1. Pack: for each (chunk, KV head), its visible keys and values are copied once from the pages
 *     into the pair-interleaved layouts vdpbf16ps wants (K: per pair of dimensions, 32 keys side by
 *     side; V: per pair of keys, the head's dimensions side by side). Every query tile of the chunk
 *     then reads them from there.
 *  2. Attend: items are (chunk, KV head, tile of PF_QT query tokens); the query heads sharing the KV
 *     head (GQA) are rows of the same item, so each packed K/V tile serves PF_QT * group rows. Per block
 *     of PF_BT key tiles (PF_KT keys each): scores S = q k^T by vdpbf16ps (bf16 products exact in
 *     float32, float32 sums), the causal / window mask, an online-softmax update in float32, then
 *     O += P V with P rounded to bf16 (as torch's flash attention does for its second GEMM) and float32
 *     accumulation.
 *     Outputs are normalized and rounded to bf16 once, at the end.
 *
 * fp8 pages (float8 e4m3fn, kv_kind = 1) and int8 pages (kv_kind = 2): the pack phase widens each key and
 * value to bf16 through a 256-entry table, exactly (every e4m3 value and every integer in [-128, 127] is a
 * bf16 value), so the attend phase is the same; the caller folds the per-tensor scales into the softmax
 * scale and the output.
 *
 * Soft cap (cap > 0, Gemma 2): each tile's scaled scores become cap * tanh(s / cap) before the mask. Sinks
 * (gpt-oss): each row's sink logit joins its softmax sum where the row is normalized.
 *
 * Built only where the compiler targets AVX512-BF16; paged_prefill_available() says whether it was,
 * and the caller keeps torch's SDPA (its reference) otherwise. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "amx.h"
#include "packed_prefix.h"
#include "vec_math.h"

#ifdef __AVX512BF16__

#define PF_QT 16       /* query tokens per item */
#define PF_KT 32       /* keys per tile: two vectors of 16 scores per row */
_Static_assert(PF_KT == PREFIX_TILE_KEYS, "packed_prefix.c counts tiles of PF_KT keys");
#define PF_BT 4        /* tiles per softmax block */
#define PF_BS (PF_BT * PF_KT)
#define PF_MAX_D 256   /* head sizes: multiples of 16 up to this (see pv_for) */
#define PF_MAX_G 16    /* query heads per KV head */
#define PF_RS 8        /* rows per register block of the score kernel */
#define PF_MAX_ROWS (PF_QT * PF_MAX_G)

int paged_prefill_available(void) { return 1; }

/* Where a chunk's packed keys start: the first key its first query may see, rounded down to a softmax
 * block (PF_BS keys), so that a query's keys fall into the same blocks, and its online softmax
 * takes the same steps, however its prompt was chunked (attend_item starts on a block too). */
static inline int key_base(int ctx, int window) {
    if (window <= 0 || ctx - window + 1 <= 0) return 0;
    return (ctx - window + 1) / PF_BS * PF_BS;
}

/* bf16 bits of each float8 e4m3fn code (exact: 3 mantissa bits, exponents 2^-9 .. 2^8). */
static uint16_t fp8_to_bf16[256];

static void init_fp8_table(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        if (e == 15 && m == 7) v = NAN;
        if (c & 0x80) v = -v;
        uint32_t bits;
        memcpy(&bits, &v, 4);
        fp8_to_bf16[c] = (uint16_t)(bits >> 16);
    }
}

/* bf16 bits of each int8 value, indexed by its byte. */
static uint16_t int8_to_bf16[256];

static void init_int8_table(void) {
    for (int c = 0; c < 256; c++) {
        const float v = (float)(int8_t)(uint8_t)c;
        uint32_t bits;
        memcpy(&bits, &v, 4);
        int8_to_bf16[c] = (uint16_t)(bits >> 16);
    }
}

/* The widening table of a page kind (NULL: bf16 pages, read as they are), built on first use (before
 * the parallel loops, so by one thread). */
static const uint16_t *kv_table(int kv_kind) {
    if (kv_kind == 1) {
        if (fp8_to_bf16[0x38] == 0) init_fp8_table(); /* 0x38 is 1.0 */
        return fp8_to_bf16;
    }
    if (kv_kind == 2) {
        if (int8_to_bf16[1] == 0) init_int8_table();
        return int8_to_bf16;
    }
    return 0;
}

/* Element i of a page row as bf16 bits: one byte through the table, or a bf16 element. */
static inline uint16_t kv_at(const void *row, int64_t i, const uint16_t *table) {
    return table ? table[((const uint8_t *)row)[i]] : ((const uint16_t *)row)[i];
}

/* 16 x 16 dwords: dst[j * ds + i] = src[i][j], by the usual four rounds of unpacks and lane shuffles. */
static inline void transpose16(const uint32_t *const *src, uint32_t *restrict dst, int64_t ds) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_loadu_si512(src[i]);
    for (int i = 0; i < 16; i += 2) {
        b[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
        b[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        a[i] = _mm512_unpacklo_epi64(b[i], b[i + 2]);
        a[i + 1] = _mm512_unpackhi_epi64(b[i], b[i + 2]);
        a[i + 2] = _mm512_unpacklo_epi64(b[i + 1], b[i + 3]);
        a[i + 3] = _mm512_unpackhi_epi64(b[i + 1], b[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        b[i] = _mm512_shuffle_i32x4(a[i], a[4 + i], 0x88);
        b[4 + i] = _mm512_shuffle_i32x4(a[i], a[4 + i], 0xDD);
        b[8 + i] = _mm512_shuffle_i32x4(a[8 + i], a[12 + i], 0x88);
        b[12 + i] = _mm512_shuffle_i32x4(a[8 + i], a[12 + i], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        a[i] = _mm512_shuffle_i32x4(b[i], b[8 + i], 0x88);
        a[8 + i] = _mm512_shuffle_i32x4(b[i], b[8 + i], 0xDD);
        a[4 + i] = _mm512_shuffle_i32x4(b[4 + i], b[12 + i], 0x88);
        a[12 + i] = _mm512_shuffle_i32x4(b[4 + i], b[12 + i], 0xDD);
    }
    for (int k = 0; k < 16; k++) _mm512_storeu_si512(dst + (int64_t)k * ds, a[k]); /* a[k]: column k */
}

/* pack_kv for bf16 pages and head sizes in 32s: K by 16 x 16 transposes of dword pairs, V by one
 * interleaving permute per 32 dimensions of a pair of keys. Keys past k1 read a zero row. */
static void pack_kv_bf16(const uint16_t *cache, int64_t page_stride, int block_size, const int32_t *blocks,
                         int64_t row, int64_t v_offset, int kh, int d, int k0, int k1, int tile,
                         uint32_t *restrict kp, uint32_t *restrict vp) {
    static const uint16_t zeros[PF_MAX_D] __attribute__((aligned(64)));
    uint32_t *kt = kp + (int64_t)tile * (d / 2) * PF_KT;
    uint16_t *vt = (uint16_t *)(vp + (int64_t)tile * (PF_KT / 2) * d);
    const uint16_t *k_rows[PF_KT], *v_rows[PF_KT];
    for (int i = 0; i < PF_KT; i++) {
        const int pos = k0 + tile * PF_KT + i;
        if (pos >= k1) {
            k_rows[i] = v_rows[i] = zeros;
            continue;
        }
        k_rows[i] = cache + (int64_t)blocks[pos / block_size] * page_stride + (int64_t)(pos % block_size) * row
                    + (int64_t)kh * d;
        v_rows[i] = k_rows[i] + v_offset;
    }
    for (int i0 = 0; i0 < PF_KT; i0 += 16)
        for (int j0 = 0; j0 < d / 2; j0 += 16) {
            const uint32_t *src[16];
            for (int i = 0; i < 16; i++) src[i] = (const uint32_t *)k_rows[i0 + i] + j0;
            transpose16(src, kt + (int64_t)j0 * PF_KT + i0, PF_KT);
        }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int p = 0; p < PF_KT / 2; p++)
        for (int j = 0; j < d; j += 32) {
            const __m512i a = _mm512_loadu_si512(v_rows[2 * p] + j), b = _mm512_loadu_si512(v_rows[2 * p + 1] + j);
            _mm512_storeu_si512(vt + (int64_t)p * 2 * d + 2 * j, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vt + (int64_t)p * 2 * d + 2 * j + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
}

/* Copy keys [k0, k1) of KV head kh (k0 a multiple of PF_KT) into the packed layouts, the last tile
 * padded with zeros: kp[tile][d / 2][PF_KT] pairs of dimensions, vp[tile][PF_KT / 2][d] pairs of
 * keys (uint32 = two bf16, the lower one first). Pages hold bf16 elements, or (table set) bytes. */
static void pack_kv(const void *cache, const uint16_t *table, int64_t page_stride, int block_size, const int32_t *blocks,
                    int64_t row, int64_t v_offset, int kh, int d, int k0, int k1, int tile,
                    uint32_t *restrict kp, uint32_t *restrict vp) {
    if (!table && d % 32 == 0) {
        pack_kv_bf16((const uint16_t *)cache, page_stride, block_size, blocks, row, v_offset, kh, d, k0, k1, tile, kp,
                     vp);
        return;
    }
    uint32_t *kt = kp + (int64_t)tile * (d / 2) * PF_KT;
    uint16_t *vt = (uint16_t *)(vp + (int64_t)tile * (PF_KT / 2) * d);
    for (int i = 0; i < PF_KT; i++) {
        const int pos = k0 + tile * PF_KT + i;
        uint16_t *vi = vt + (int64_t)(i / 2) * d * 2 + (i & 1);
        if (pos >= k1) {
            for (int j = 0; j < d / 2; j++) kt[j * PF_KT + i] = 0;
            for (int j = 0; j < d; j++) vi[2 * j] = 0;
            continue;
        }
        const int64_t at = (int64_t)blocks[pos / block_size] * page_stride + (int64_t)(pos % block_size) * row
                           + (int64_t)kh * d;
        const int width = table ? 1 : 2;
        const char *kr = (const char *)cache + at * width, *vr = kr + v_offset * width;
        if (table) {
            for (int j = 0; j < d / 2; j++)
                kt[j * PF_KT + i] = (uint32_t)kv_at(kr, 2 * j, table) | (uint32_t)kv_at(kr, 2 * j + 1, table) << 16;
        } else {
            for (int j = 0; j < d / 2; j++) {
                uint32_t pair;
                memcpy(&pair, kr + 4 * j, sizeof pair);
                kt[j * PF_KT + i] = pair;
            }
        }
        for (int j = 0; j < d; j++) vi[2 * j] = kv_at(vr, j, table);
    }
}

/* Scores of rows [0, rows) (a multiple of PF_RS) against one packed key tile: s[r * ss + 0..31] = q_r . k,
 * unscaled (softmax_step scales them). */
static void tile_scores(const uint32_t *restrict qb, const uint32_t *restrict kt, int rows, int d,
                        float *restrict s, int ss) {
    for (int r0 = 0; r0 < rows; r0 += PF_RS) {
        __m512 lo[PF_RS], hi[PF_RS];
        for (int r = 0; r < PF_RS; r++) lo[r] = hi[r] = _mm512_setzero_ps();
        for (int j = 0; j < d / 2; j++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + j * PF_KT);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + j * PF_KT + 16);
            for (int r = 0; r < PF_RS; r++) {
                const __m512bh qr = (__m512bh)_mm512_set1_epi32((int)qb[(int64_t)(r0 + r) * (d / 2) + j]);
                lo[r] = _mm512_dpbf16_ps(lo[r], qr, k0);
                hi[r] = _mm512_dpbf16_ps(hi[r], qr, k1);
            }
        }
        for (int r = 0; r < PF_RS; r++) {
            _mm512_storeu_ps(s + (int64_t)(r0 + r) * ss, lo[r]);
            _mm512_storeu_ps(s + (int64_t)(r0 + r) * ss + 16, hi[r]);
        }
    }
}

#define LOG2E 1.44269504088896341f

/* 2^t on the lanes of keep, 0 on the others: vexp's polynomial with the exponent applied by a
 * zero-masked vscalefps. t is held at -126 so that no lane ever computes a subnormal or an underflow,
 * even one masked away afterwards: each such lane costs a microcode assist on these CPUs (letting them
 * through made prefill attention 1.35x slower). fn = -126 only with f >= 0: 2^f >= 1 keeps the result
 * normal (2^-126 at the least). */
static inline __m512 exp2_held16(__m512 t, __mmask16 keep) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
    const __m512 fn = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(keep, exp2_poly16(_mm512_sub_ps(t, fn)), fn);
}

/* exp16 (exp(x), 0 below -87, so 0 for a masked key's -inf) in 12 operations instead of 17. */
static inline __m512 exp_softmax16(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
    return exp2_held16(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), keep);
}

/* One row's step of softmax_step: p = exp(x - m) over its nkeys scores as bf16 pairs, and their sum (16
 * lanes). whole (a constant in each call, so each gets its own loop): the row sees every key and its
 * scores are raw, exp(s * scale - m) = 2^(s * scale * log2(e) - m * log2(e)) with c = scale * log2(e);
 * else they are scaled and masked, a masked key's -inf giving exactly 0. */
static inline __attribute__((always_inline)) __m512 row_exps(const float *restrict sr, int nkeys, float m, __m512 c,
                                                             int whole, uint32_t *restrict pr) {
    const __m512 mv = _mm512_set1_ps(m), mc = _mm512_set1_ps(-m * LOG2E);
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < nkeys; v += 32) {
        const __m512 s0 = _mm512_loadu_ps(sr + v), s1 = _mm512_loadu_ps(sr + v + 16);
        const __m512 e0 = whole ? exp2_held16(_mm512_fmadd_ps(s0, c, mc), 0xFFFF) : exp_softmax16(_mm512_sub_ps(s0, mv));
        const __m512 e1 = whole ? exp2_held16(_mm512_fmadd_ps(s1, c, mc), 0xFFFF) : exp_softmax16(_mm512_sub_ps(s1, mv));
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        _mm512_storeu_si512(pr + v / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    return sum;
}

/* Lanes [base, base + 16) of the keys [lo, hi] of a step. */
static inline __mmask16 span16(int lo, int hi, int base) {
    int a = lo - base, b = hi - base;
    if (a < 0) a = 0;
    if (b > 15) b = 15;
    return b < a ? (__mmask16)0 : (__mmask16)((2u << b) - (1u << a));
}

/* One online-softmax step for each row over nkeys keys (a multiple of 32) from kpos0, their scores
 * s[r][0 .. nkeys) (row stride ss floats, unscaled): keys visible to row r are those in [lo_r, hi_r]
 * (from its position and the window). The scores are scaled, soft-capped (cap > 0: cap * tanh(s /
 * cap), before the mask, as the models define it) and masked in place to -inf, then exponentiated
 * against the rows' new maxima into p (bf16 pairs, row stride ss / 2) with the factor alpha the
 * row's outputs are rescaled by; rows seeing no key of the step get p = 0, alpha = 1. Rows go 16 at a
 * time so that their maxima, sums and rescale factors are vectors: one transpose-and-reduce (max16 /
 * sum16) and one exp for 16 rows instead of two horizontal reductions and a scalar exp per row. The
 * step takes a block of up to PF_BT tiles (PF_BS keys). m, l, alpha
 * have room for whole blocks of 16 (PF_MAX_ROWS). */
static void softmax_step(float *restrict s, int ss, const int *restrict row_pos, int rows, int kpos0, int nkeys,
                         int window, float scale, float cap, float *restrict m, float *restrict l,
                         float *restrict alpha, uint32_t *restrict p) {
    const __m512 neg = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale), c = _mm512_set1_ps(scale * LOG2E);
    const __m512 capv = _mm512_set1_ps(cap), inv_cap = _mm512_set1_ps(cap > 0.f ? 1.f / cap : 0.f);
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int nr = rows - r0 < 16 ? rows - r0 : 16;
        const __mmask16 lanes = (__mmask16)((1u << nr) - 1);
        __m512 mx[16], sums[16];
        __mmask16 live = 0, whole = 0;
        for (int i = 0; i < 16; i++) {
            mx[i] = neg;
            if (i >= nr) continue;
            const int pos = row_pos[r0 + i];
            int lo = window > 0 ? pos - window + 1 - kpos0 : 0, hi = pos - kpos0;
            if (lo < 0) lo = 0;
            if (hi > nkeys - 1) hi = nkeys - 1;
            if (pos < 0 || hi < lo) continue;
            live |= (__mmask16)(1u << i);
            float *sr = s + (int64_t)(r0 + i) * ss;
            if (lo == 0 && hi == nkeys - 1 && cap == 0.f) {
                /* every key visible, no cap: the scores stay as they are, their maximum is taken
                 * unscaled (scaling is monotonic), and the exponent folds the scale in below */
                whole |= (__mmask16)(1u << i);
                for (int v = 0; v < nkeys; v += 16) mx[i] = _mm512_max_ps(mx[i], _mm512_loadu_ps(sr + v));
                continue;
            }
            for (int v = 0; v < nkeys; v += 16) {
                __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + v), sc);
                if (cap > 0.f) x = softcap16(x, capv, inv_cap);
                x = _mm512_mask_mov_ps(neg, span16(lo, hi, v), x);
                _mm512_storeu_ps(sr + v, x);
                mx[i] = _mm512_max_ps(mx[i], x);
            }
        }
        const __m512 m_old = _mm512_maskz_loadu_ps(lanes, m + r0);
        const __m512 m_red = max16(mx);
        const __m512 m_new = _mm512_mask_max_ps(m_old, live, m_old, _mm512_mask_mul_ps(m_red, whole, m_red, sc));
        /* exp(-inf) = 0 for a row's first visible keys; rows seeing nothing keep everything (alpha 1). */
        const __m512 a = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), live, exp16(_mm512_sub_ps(m_old, m_new)));
        float mn[16] __attribute__((aligned(64)));
        _mm512_store_ps(mn, m_new);
        for (int i = 0; i < 16; i++) {
            sums[i] = _mm512_setzero_ps();
            if (i >= nr) continue;
            uint32_t *pr = p + (int64_t)(r0 + i) * (ss / 2);
            if (!((live >> i) & 1)) {
                memset(pr, 0, sizeof(uint32_t) * (size_t)(nkeys / 2));
                continue;
            }
            const float *sr = s + (int64_t)(r0 + i) * ss;
            sums[i] = (whole >> i) & 1 ? row_exps(sr, nkeys, mn[i], c, 1, pr) : row_exps(sr, nkeys, mn[i], c, 0, pr);
        }
        const __m512 l_new = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, l + r0), a, sum16(sums));
        _mm512_mask_storeu_ps(m + r0, lanes, m_new);
        _mm512_mask_storeu_ps(l + r0, lanes, l_new);
        _mm512_mask_storeu_ps(alpha + r0, lanes, a);
    }
}

/* o[r] = alpha[r] * o[r] + p[r] V over nt packed value tiles (consecutive in memory, so their pairs of
 * keys are one run of nt * PF_KT / 2), p[r] the row's bf16 pairs (row stride PF_BS / 2); DV = head size
 * / 16 vectors per row, RO rows per register block (RO * DV accumulators, loaded and stored once a
 * block). */
#define DEFINE_TILE_PV(NAME, DV, RO)                                                              \
static void NAME(const uint32_t *restrict p, const uint32_t *restrict vt, int nt, const float *restrict alpha, \
                 int rows, float *restrict o) {                                                   \
    for (int r0 = 0; r0 < rows; r0 += RO) {                                                       \
        __m512 acc[RO][DV];                                                                       \
        for (int r = 0; r < RO; r++) {                                                            \
            const __m512 a = _mm512_set1_ps(alpha[r0 + r]);                                       \
            for (int j = 0; j < DV; j++)                                                          \
                acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)(r0 + r) * DV * 16 + 16 * j), a); \
        }                                                                                         \
        for (int kp = 0; kp < nt * (PF_KT / 2); kp++) {                                           \
            __m512bh pr[RO];                                                                      \
            for (int r = 0; r < RO; r++)                                                          \
                pr[r] = (__m512bh)_mm512_set1_epi32((int)p[(int64_t)(r0 + r) * (PF_BS / 2) + kp]); \
            for (int j = 0; j < DV; j++) {                                                        \
                const __m512bh v = (__m512bh)_mm512_loadu_si512(vt + (int64_t)kp * DV * 16 + 16 * j); \
                for (int r = 0; r < RO; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pr[r], v);   \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < RO; r++)                                                              \
            for (int j = 0; j < DV; j++)                                                          \
                _mm512_storeu_ps(o + (int64_t)(r0 + r) * DV * 16 + 16 * j, acc[r][j]);            \
    }                                                                                             \
}
DEFINE_TILE_PV(tile_pv_1, 1, 8) DEFINE_TILE_PV(tile_pv_2, 2, 8) DEFINE_TILE_PV(tile_pv_3, 3, 4)
DEFINE_TILE_PV(tile_pv_4, 4, 4) DEFINE_TILE_PV(tile_pv_5, 5, 2) DEFINE_TILE_PV(tile_pv_6, 6, 2)
DEFINE_TILE_PV(tile_pv_7, 7, 2) DEFINE_TILE_PV(tile_pv_8, 8, 2) DEFINE_TILE_PV(tile_pv_12, 12, 1)
DEFINE_TILE_PV(tile_pv_16, 16, 1)

typedef void (*tile_pv_fn)(const uint32_t *, const uint32_t *, int, const float *, int, float *);

static tile_pv_fn pv_for(int d) {
    if (d % 16) return 0;
    switch (d / 16) {
    case 1: return tile_pv_1;   case 2: return tile_pv_2;   case 3: return tile_pv_3;
    case 4: return tile_pv_4;   case 5: return tile_pv_5;   case 6: return tile_pv_6;
    case 7: return tile_pv_7;   case 8: return tile_pv_8;   case 12: return tile_pv_12;
    case 16: return tile_pv_16;
    default: return 0;
    }
}

/* Slice i of n of [at, at + bytes) prefetched into L2: the keys of a prefix lie in memory (a packed
 * prefix of 64 decodes is 94 MB), and a tile load that misses stalls its row of tile products; one
 * burst of a block's 512 lines before it stalled on the fill buffers instead, so they go out a slice
 * per tile product. */
static inline void prefetch_slice(const char *at, int64_t bytes, int i, int n) {
    if (!at) return;
    const int64_t lines = (bytes + 63) / 64, l0 = lines * i / n, l1 = lines * (i + 1) / n;
    for (int64_t l = l0; l < l1; l++) _mm_prefetch(at + l * 64, _MM_HINT_T1);
}

#if AMX_AVAILABLE
/* The AMX path takes the keys PF_BT tiles (128 keys) at a time: the two products on AMX tiles
 * (TDPBF16PS: bf16 pairs, products exact in float32, float32 sums) from the same packed layouts, and
 * one online-softmax step per block instead of per tile. A packed K tile, [d / 2][PF_KT] pairs, is a
 * B operand as it lies (16 pairs of dimensions by 16 keys per tile, rows PF_KT * 4 bytes apart), as a
 * packed V tile, [PF_KT / 2][d] pairs of keys, is for P V; q rows and bf16 p rows are A operands, and
 * the P V accumulators stay in tiles over the block's keys. Per tile, the vector work around the
 * tiles (maxima and sums through max16 / sum16, rescaling the outputs, storing and reloading P V) cost
 * several times the tile products; per block it is a quarter of that. Rows go in blocks of 16 (the
 * caller pads with zero queries), head sizes in multiples of 32. Tiles: 0, 1 accumulate, 2 holds A,
 * 3, 4 hold B. */

/* s[r][t * PF_KT ..] = q_r . k over the block's nt tiles, unscaled (row stride PF_BS floats); pf:
 * pf_bytes to prefetch meanwhile (NULL: none; attend_rows passes the block's values). */
static void block_scores_amx(const uint32_t *restrict qb, const uint32_t *restrict kp, int nt, int rows, int d,
                             float *restrict s, const char *pf, int64_t pf_bytes) {
    const int steps = rows / 16 * nt;
    for (int r0 = 0; r0 < rows; r0 += 16)
        for (int t = 0; t < nt; t++) {
            prefetch_slice(pf, pf_bytes, r0 / 16 * nt + t, steps);
            const uint32_t *kt = kp + (int64_t)t * (d / 2) * PF_KT;
            _tile_zero(0);
            _tile_zero(1);
            for (int j0 = 0; j0 < d / 2; j0 += 16) {
                _tile_loadd(2, qb + (int64_t)r0 * (d / 2) + j0, d * 2);
                _tile_loadd(3, kt + (int64_t)j0 * PF_KT, PF_KT * 4);
                _tile_loadd(4, kt + (int64_t)j0 * PF_KT + 16, PF_KT * 4);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, s + (int64_t)r0 * PF_BS + t * PF_KT, PF_BS * 4);
            _tile_stored(1, s + (int64_t)r0 * PF_BS + t * PF_KT + 16, PF_BS * 4);
        }
}

/* o[r] = alpha[r] * o[r] + p[r] V over the block's nt value tiles: the products accumulate in tiles
 * over the block, are stored to pv once and folded into the outputs by the vector unit; pf as in
 * block_scores_amx (attend_rows passes the next block's keys). */
static void block_pv_amx(const uint32_t *restrict p, const uint32_t *restrict vp, int nt, const float *restrict alpha,
                         int rows, int d, float *restrict o, float *restrict pv, const char *pf, int64_t pf_bytes) {
    const int steps = rows / 16 * (d / 32);
    for (int r0 = 0; r0 < rows; r0 += 16)
        for (int j = 0; j < d; j += 32) {
            prefetch_slice(pf, pf_bytes, r0 / 16 * (d / 32) + j / 32, steps);
            _tile_zero(0);
            _tile_zero(1);
            for (int t = 0; t < nt; t++) {
                const uint32_t *vt = vp + (int64_t)t * (PF_KT / 2) * d;
                _tile_loadd(2, p + (int64_t)r0 * (PF_BS / 2) + t * (PF_KT / 2), PF_BS * 2);
                _tile_loadd(3, vt + j, d * 4);
                _tile_loadd(4, vt + j + 16, d * 4);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, pv + (int64_t)r0 * d + j, d * 4);
            _tile_stored(1, pv + (int64_t)r0 * d + j + 16, d * 4);
        }
    for (int r = 0; r < rows; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        float *orow = o + (int64_t)r * d;
        const float *prow = pv + (int64_t)r * d;
        for (int j = 0; j < d; j += 16)
            _mm512_storeu_ps(orow + j, _mm512_fmadd_ps(_mm512_loadu_ps(orow + j), a, _mm512_loadu_ps(prow + j)));
    }
}

/* Whether this call multiplies on AMX: an AMX build, allowed now, and a head size in 32s. */
static int prefill_amx(int d) { return d % 32 == 0 && kernels_amx_ready(); }
#else
static int prefill_amx(int d) { (void)d; return 0; }
#define block_scores_amx(qb, kp, nt, rows, d, s, pf, pf_bytes) ((void)(nt), abort())
#define block_pv_amx(p, vp, nt, alpha, rows, d, o, pv, pf, pf_bytes) abort()
#endif

int paged_prefill_supports(int num_heads, int num_kv_heads, int head_size) {
    const int g = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    return g >= 1 && g <= PF_MAX_G && g * num_kv_heads == num_heads && head_size <= PF_MAX_D
           && pv_for(head_size) != 0;
}

/* Scratch of one thread for one item. */
typedef struct {
    uint32_t qb[PF_MAX_ROWS * PF_MAX_D / 2];
    float s[PF_MAX_ROWS * PF_BS]; /* a block's scores, rows PF_BS apart */
    uint32_t p[PF_MAX_ROWS * PF_BS / 2];
    float o[PF_MAX_ROWS * PF_MAX_D];
    float pv[PF_MAX_ROWS * PF_MAX_D]; /* a block's P V on the AMX path */
    float m[PF_MAX_ROWS], l[PF_MAX_ROWS], alpha[PF_MAX_ROWS];
    int pos[PF_MAX_ROWS];
} pf_scratch;

/* The online-softmax loop of an item over packed key tiles [tile0, tile1) (keys from kbase), for the
 * rows set up in w (bf16 queries, positions, m = -inf, l = 0, o = 0, or the state an earlier range of
 * keys left); leaves unnormalized outputs in w->o.
 * stream: the tiles lie in memory, not in cache (a cached prefix's, see prefetch_slice), so the
 * loops ask for them a block ahead, and during the last block for follow's (the first keys of the
 * item the thread likely takes next; NULL: none); a prefill chunk's were just packed. */
static void attend_rows(const uint32_t *kp, const uint32_t *vp, int kbase, int tile0, int tile1, int rows, int d,
                        float scale, int window, float cap, pf_scratch *w, int amx, int stream,
                        const uint32_t *follow) {
    /* Blocks of PF_BT tiles on both paths, not a softmax step per tile on the AVX-512 one: the step's
     * maxima and sums (max16 / sum16), its rescale factors' exp and the outputs' rescale, load and store
     * are paid once per 128 keys. AMD EPYC (Zen 4, AVX512-BF16, no AMX), `tokenos bench kernels`, two
     * alternations: prefill chunk 2048 after 2048 cached 43.7 / 47.1 -> 40.9 / 42.6 ms; cascade, 8 groups
     * of 8 over 512 shared tokens, 96 own, 407 / 382 -> 345 / 372 us. */
    const tile_pv_fn pv = pv_for(d);
    for (int b0 = tile0; b0 < tile1; b0 += PF_BT) {
        const int nt = tile1 - b0 < PF_BT ? tile1 - b0 : PF_BT, b1 = b0 + PF_BT;
        const int next = tile1 - b1 < PF_BT ? tile1 - b1 : PF_BT; /* tiles of the next block */
        const uint32_t *kb = kp + (int64_t)b0 * (d / 2) * PF_KT, *vb = vp + (int64_t)b0 * (PF_KT / 2) * d;
        const int64_t block_bytes = (int64_t)nt * PF_KT * d * 2; /* of its keys, as of its values */
        /* Streamed tiles: this block's values come in while its scores are made; the next block's keys
         * (the next item's on the last block) during its P V on AMX, during its scores on AVX-512 (its
         * P V is one call), a slice per tile. */
        const char *values = stream ? (const char *)vb : NULL;
        const char *ahead = !stream ? NULL : next > 0 ? (const char *)(kp + (int64_t)b1 * (d / 2) * PF_KT)
                                                        : (const char *)follow;
        const int64_t ahead_bytes = (int64_t)(next > 0 ? next : PF_BT) * PF_KT * d * 2;
        if (amx) {
            block_scores_amx(w->qb, kb, nt, rows, d, w->s, values, block_bytes);
        } else {
            for (int t = 0; t < nt; t++) {
                prefetch_slice(values, block_bytes, t, nt);
                prefetch_slice(ahead, ahead_bytes, t, nt);
                tile_scores(w->qb, kb + (int64_t)t * (d / 2) * PF_KT, rows, d, w->s + t * PF_KT, PF_BS);
            }
        }
        softmax_step(w->s, PF_BS, w->pos, rows, kbase + b0 * PF_KT, nt * PF_KT, window, scale, cap, w->m, w->l,
                     w->alpha, w->p);
        if (amx)
            block_pv_amx(w->p, vb, nt, w->alpha, rows, d, w->o, w->pv, ahead, ahead_bytes);
        else
            pv(w->p, vb, nt, w->alpha, rows, w->o);
    }
}

/* Item (chunk c, KV head kh, query tokens [t0, t1) of the chunk): keys [0, pkeys) from pkp / pvp (a
 * cached prefix's packed tiles, pkeys whole softmax blocks; 0: none), the rest from kp / vp (keys
 * from kbase). The blocks fall where one range from key 0 would put them, so a query's arithmetic is
 * the same whichever range its keys come from. */
static void attend_item(const uint16_t *q, int64_t q_stride, const uint32_t *pkp, const uint32_t *pvp, int pkeys,
                        const uint32_t *kp, const uint32_t *vp, int kbase, int ctx, int start, int t0, int t1,
                        int kh, int g, int d, float scale, int window, float cap, const float *sinks,
                        uint16_t *out, int64_t out_stride, pf_scratch *w, int amx) {
    const int live = (t1 - t0) * g;
    const int block = amx ? 16 : PF_RS; /* rows are padded to whole register blocks or tiles */
    const int rows = (live + block - 1) / block * block;
    for (int r = 0; r < rows; r++) {
        uint32_t *qr = w->qb + (int64_t)r * (d / 2);
        if (r < live) {
            const int t = t0 + r / g, h = r % g;
            memcpy(qr, q + (int64_t)(start + t) * q_stride + (int64_t)(kh * g + h) * d, sizeof(uint16_t) * d);
            w->pos[r] = ctx + t;
        } else {
            memset(qr, 0, sizeof(uint16_t) * d);
            w->pos[r] = -1;
        }
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)rows * d);
    const int first_pos = ctx + t0, last_pos = ctx + t1 - 1;
    if (pkeys > 0) /* its tiles lie in memory since an earlier step, as a decode group's prefix does */
        attend_rows(pkp, pvp, 0, 0, pkeys / PF_KT, rows, d, scale, window, cap, w, amx, 1, NULL);
    int lo_key = window > 0 ? first_pos - window + 1 : 0;
    if (lo_key < kbase) lo_key = kbase;
    attend_rows(kp, vp, kbase, (lo_key - kbase) / PF_BS * PF_BT, (last_pos - kbase) / PF_KT + 1, rows, d, scale,
                window, cap, w, amx, 0, NULL);
    for (int r = 0; r < live; r++) {
        const int t = t0 + r / g, h = r % g;
        const float f = sinks ? sink_factor(w->m[r], w->l[r], sinks[kh * g + h])
                              : w->l[r] > 0.f ? 1.f / w->l[r] : 0.f;
        const __m512 inv = _mm512_set1_ps(f);
        uint16_t *dst = out + (int64_t)(start + t) * out_stride + (int64_t)(kh * g + h) * d;
        for (int j = 0; j < d; j += 16)
            _mm256_storeu_si256((__m256i *)(dst + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w->o + (int64_t)r * d + j), inv)));
    }
}

/* The unit whose range [first[u], first[u + 1]) holds index i (units are few: a linear scan). */
static inline int unit_of(const int64_t *first, int64_t i) {
    int u = 0;
    while (first[u + 1] <= i) u++;
    return u;
}

/* Packed K/V of several key ranges ("units": a prefill chunk's visible keys, a decode group's shared
 * pages), each packed once per KV head; unit u reads blocks[u]'s pages over keys [k0[u], k1[u]). Each
 * unit has its own pointers and its own distance between KV heads (room for more tiles), so a decode
 * group's units can live in the packed-prefix cache below and grow there. */
typedef struct {
    uint32_t **kp, **vp; /* unit u's K and V: [num_kv_heads][hstride[u] tiles][tile_elems] uint32 each */
    int64_t *ntiles;     /* unit u's tiles per KV head */
    int64_t *hstride;    /* tiles from one KV head's to the next */
    int64_t *from;       /* pack_units packs unit u's tiles [from[u], ntiles[u]) */
    int64_t tile_elems;
    int num_kv_heads;
    uint32_t *block; /* what packed_alloc allocated (NULL: nothing) */
} packed_kv;

static void packed_init(packed_kv *pk, int units, const int *k0, const int *k1, int num_kv_heads, int d) {
    pk->num_kv_heads = num_kv_heads;
    pk->tile_elems = (int64_t)PF_KT * d / 2; /* uint32 per packed tile of K (and of V) */
    pk->ntiles = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * units + 1));
    pk->hstride = pk->ntiles + units;
    pk->from = pk->hstride + units;
    for (int u = 0; u < units; u++) {
        pk->ntiles[u] = pk->hstride[u] = (k1[u] - k0[u] + PF_KT - 1) / PF_KT;
        pk->from[u] = 0;
    }
    pk->kp = (uint32_t **)calloc((size_t)(2 * units + 1), sizeof(uint32_t *));
    pk->vp = pk->kp + units;
    pk->block = NULL;
}

/* uint32 elements of unit u's packed K (as many again for its V). */
static inline int64_t unit_elems(const packed_kv *pk, int u) {
    return pk->hstride[u] * pk->num_kv_heads * pk->tile_elems;
}

/* One allocation for units todo[0 .. n). */
static void packed_alloc(packed_kv *pk, const int *todo, int n) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += 2 * unit_elems(pk, todo[i]);
    pk->block = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(total > 0 ? total : 1));
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        const int u = todo[i];
        pk->kp[u] = pk->block + at;
        pk->vp[u] = pk->kp[u] + unit_elems(pk, u);
        at += 2 * unit_elems(pk, u);
    }
}

/* Where KV head kh's tiles start in unit u's kp / vp. */
static inline int64_t packed_base(const packed_kv *pk, int u, int kh) {
    return (int64_t)kh * pk->hstride[u] * pk->tile_elems;
}

/* Unit u's tiles are entry e's (csrc/packed_prefix.h: each KV head's at cap_tiles apart, K then V);
 * whether some are still to pack (from[u], set by prefix_entry_for, short of its tiles). */
static int unit_in_entry(packed_kv *pk, int u, const prefix_entry *e) {
    pk->kp[u] = e->kv;
    pk->vp[u] = e->kv + prefix_entry_elems(e, pk->tile_elems);
    pk->hstride[u] = e->cap_tiles;
    return pk->from[u] < pk->ntiles[u];
}

/* Pack units todo[0 .. n) into their buffers, every (tile, KV head) of them one parallel item. */
#define PACK_PARALLEL_MIN 16
static void pack_units(const packed_kv *pk, const int *todo, int n, const void *cache, const uint16_t *table,
                       int64_t page_stride, int block_size, const int32_t *const *blocks, const int *k0,
                       const int *k1, int64_t row, int64_t v_offset, int d) {
    const int num_kv_heads = pk->num_kv_heads;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n + 1)); /* tiles before todo[i] */
    first[0] = 0;
    for (int i = 0; i < n; i++) first[i + 1] = first[i] + pk->ntiles[todo[i]] - pk->from[todo[i]];
    const int64_t pack_items = first[n] * num_kv_heads;
    /* A decode group's cached prefix mostly grows by a tile or none a step: waking the threads would
     * cost more than packing it. */
    _Pragma("omp parallel for schedule(static) if (pack_items >= PACK_PARALLEL_MIN)")
    for (int64_t it = 0; it < pack_items; it++) {
        const int64_t gt = it / num_kv_heads;
        const int kh = (int)(it % num_kv_heads);
        const int i = unit_of(first, gt), u = todo[i];
        const int64_t base = packed_base(pk, u, kh);
        pack_kv(cache, table, page_stride, block_size, blocks[u], row, v_offset, kh, d, k0[u], k1[u],
                (int)(pk->from[u] + gt - first[i]), pk->kp[u] + base, pk->vp[u] + base);
    }
    free(first);
}

static void packed_free(packed_kv *pk) {
    free(pk->ntiles);
    free(pk->kp);
    free(pk->block);
}

/* A thread's scratch for the items of one parallel region, its AMX tiles configured where used. */
static pf_scratch *scratch_begin(int amx) {
    pf_scratch *w = (pf_scratch *)aligned_alloc(64, (sizeof(pf_scratch) + 63) / 64 * 64);
#if AMX_AVAILABLE
    if (amx) amx_configure();
#else
    (void)amx;
#endif
    return w;
}

static void scratch_end(pf_scratch *w, int amx) {
#if AMX_AVAILABLE
    if (amx) _tile_release();
#else
    (void)amx;
#endif
    free(w);
}

/* Cached prefixes through the packed-prefix cache (csrc/packed_prefix.h): a prefix that several chunks
 * of a step share (requests over one cached system prompt or document), or that the cache already
 * holds (a decode group's, an earlier step's), is packed once and kept, rather than once per chunk and
 * step. Chunk c's part, pre[c] keys from 0: whole softmax blocks of whole pages below its cached
 * tokens, without a window; 0 where it has none. A prefix of one chunk's own is packed with its chunk,
 * as before: kept, it would only crowd out the shared ones. */
static int prefix_keys(int ctx, int window, int block_size) {
    const int keys = ctx / PF_BS * PF_BS;
    return window == 0 && keys > 0 && keys % block_size == 0 ? keys : 0;
}

/* pre (see above) and the units of pp (unit c: chunk c's prefix tiles, in its entry), packing what the
 * entries lack. Inside prefix_cache_begin / end. */
static void cached_prefixes(packed_kv *pp, int *pre, const void *cache, int64_t page_stride, int block_size,
                            const int32_t **blocks, const int32_t *chunks, int num_chunks, int window,
                            int num_kv_heads, int d, const int64_t *epochs, int64_t row, int64_t v_offset) {
    int *twin = (int *)malloc(sizeof(int) * (size_t)(4 * num_chunks)), *shared = twin + num_chunks;
    int *zero = shared + num_chunks, *todo = zero + num_chunks, ntodo = 0;
    for (int c = 0; c < num_chunks; c++) {
        pre[c] = prefix_keys(chunks[3 * c + 2], window, block_size);
        twin[c] = -1, shared[c] = 0, zero[c] = 0;
    }
    /* twin: the first earlier chunk over the same prefix (its pages, as many keys) */
    for (int c = 0; c < num_chunks; c++)
        for (int t = 0; t < c && pre[c] > 0; t++)
            if (pre[t] == pre[c] && blocks[t][0] == blocks[c][0]
                && memcmp(blocks[t], blocks[c], sizeof(int32_t) * (size_t)(pre[c] / block_size)) == 0) {
                twin[c] = t, shared[c] = shared[t] = 1;
                break;
            }
    packed_init(pp, num_chunks, zero, pre, num_kv_heads, d);
    for (int c = 0; c < num_chunks; c++) {
        if (pre[c] == 0) continue;
        const int t = twin[c];
        if (t >= 0) { /* processed before c: its entry, or none (no room) */
            pre[c] = pre[t];
            pp->kp[c] = pp->kp[t], pp->vp[c] = pp->vp[t], pp->hstride[c] = pp->hstride[t];
            continue;
        }
        prefix_entry *e = prefix_entry_for(cache, page_stride, block_size, num_kv_heads, d, pre[c], blocks[c], epochs,
                                           pp->tile_elems, shared[c], &pp->from[c]);
        if (!e) {
            pre[c] = 0;
            continue;
        }
        if (unit_in_entry(pp, c, e)) todo[ntodo++] = c;
    }
    pack_units(pp, todo, ntodo, cache, NULL, page_stride, block_size, blocks, zero, pre, row, v_offset, d);
    free(twin);
}

/* chunks: int32 [num_chunks][3] = (first token in q/out, query length, tokens cached before it);
 * block_table: int32 [num_chunks][max_blocks]. q and out: [tokens, num_heads, head_size] bf16 with
 * token strides q_stride / out_stride (elements), heads contiguous. cap: the attention-logit soft cap
 * (0: none); sinks: one float32 logit per query head joining its softmax sum (NULL: none). epochs: the
 * pages' epochs for the packed-prefix cache (see csrc/packed_prefix.h; NULL: every prefix packed with
 * its chunk). */
void paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const void *cache, int kv_kind, int64_t page_stride,
                        int block_size, const int32_t *block_table, int max_blocks, const int32_t *chunks,
                        int num_chunks, int num_heads, int num_kv_heads, int head_size, float scale,
                        int window, uint16_t *out, int64_t out_stride, float cap, const float *sinks,
                        const int64_t *epochs) {
    const int g = num_heads / num_kv_heads, d = head_size;
    const uint16_t *table = kv_table(kv_kind);
    const int64_t row = (int64_t)num_kv_heads * d, v_offset = (int64_t)block_size * row;
    /* Packed K/V per (chunk, KV head): tiles of [PF_KT * d] uint32 for K and for V. */
    int64_t *item0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));
    const int32_t **blocks = (const int32_t **)malloc(sizeof(*blocks) * (size_t)num_chunks);
    int *k0 = (int *)malloc(sizeof(int) * (size_t)(2 * num_chunks)), *k1 = k0 + num_chunks;
    item0[0] = 0;
    for (int c = 0; c < num_chunks; c++) {
        const int qlen = chunks[3 * c + 1], ctx = chunks[3 * c + 2];
        blocks[c] = block_table + (int64_t)c * max_blocks;
        k0[c] = key_base(ctx, window);
        k1[c] = ctx + qlen;
        item0[c + 1] = item0[c] + (int64_t)num_kv_heads * ((qlen + PF_QT - 1) / PF_QT);
    }
    /* keys [0, pre[c]) from the packed-prefix cache (pp), the rest packed for this call (pk) */
    int *pre = (int *)calloc((size_t)num_chunks, sizeof(int));
    packed_kv pp = {0};
    const int keep = table == NULL && prefix_cache_begin(epochs);
    if (keep)
        cached_prefixes(&pp, pre, cache, page_stride, block_size, blocks, chunks, num_chunks, window, num_kv_heads,
                        d, epochs, row, v_offset);
    for (int c = 0; c < num_chunks; c++)
        if (pre[c] > 0) k0[c] = pre[c];
    packed_kv pk;
    packed_init(&pk, num_chunks, k0, k1, num_kv_heads, d);
    int *todo = (int *)malloc(sizeof(int) * (size_t)num_chunks);
    for (int c = 0; c < num_chunks; c++) todo[c] = c;
    packed_alloc(&pk, todo, num_chunks);
    pack_units(&pk, todo, num_chunks, cache, table, page_stride, block_size, blocks, k0, k1, row, v_offset, d);
    free(todo);
    const int64_t items = item0[num_chunks];
    const int amx = prefill_amx(d);
    _Pragma("omp parallel")
    {
        pf_scratch *w = scratch_begin(amx);
        /* Later query tiles see more keys: hand them out first for a better balance. */
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t rev = 0; rev < items; rev++) {
            const int64_t it = items - 1 - rev;
            const int c = unit_of(item0, it);
            const int start = chunks[3 * c], qlen = chunks[3 * c + 1], ctx = chunks[3 * c + 2];
            const int64_t local = it - item0[c];
            const int kh = (int)(local % num_kv_heads), qt = (int)(local / num_kv_heads);
            const int t0 = qt * PF_QT, t1 = t0 + PF_QT < qlen ? t0 + PF_QT : qlen;
            const int64_t base = packed_base(&pk, c, kh), pbase = pre[c] > 0 ? packed_base(&pp, c, kh) : 0;
            attend_item(q, q_stride, pre[c] > 0 ? pp.kp[c] + pbase : NULL, pre[c] > 0 ? pp.vp[c] + pbase : NULL,
                        pre[c], pk.kp[c] + base, pk.vp[c] + base, k0[c], ctx, start, t0, t1, kh, g, d, scale,
                        window, cap, sinks, out, out_stride, w, amx);
        }
        scratch_end(w, amx);
    }
    if (keep) {
        prefix_cache_end();
        packed_free(&pp);
    }
    packed_free(&pk);
    free(item0); free(blocks); free(k0); free(pre);
}

/* Decodes sharing a cached prefix (cascade attention): csrc/paged_attention.c finds requests whose
 * block tables begin with the same pages and hands the common pages here, once per group. Their
 * keys and values are packed once per (group, KV head), or taken from the packed-prefix cache
 * (csrc/packed_prefix.h, epochs given), and every member's query heads of that KV head are rows of one item, as a prefill
 * chunk's tokens are: each packed tile serves all of them, on AMX tiles where present, where the
 * decode kernel would read the prefix once per request. The results are partials (unnormalized
 * outputs, max, sum per query head) that the decode kernel merges with its own over the rest of each
 * request's tokens.
 *
 * Group j: members[member0[j] .. member0[j + 1]) (request indices, the first one's block table used),
 * over its first tokens[j] tokens (whole pages), per[j] members an item, in pieces[j] consecutive key
 * ranges (see shared_prefix_pieces). q: float32 [requests, num_heads, d], rounded to bf16 as the decode kernel
 * rounds it; partial slots slot[r] .. slot[r] + pieces - 1 of request r get, piece by piece, pm/pl
 * [num_heads] and po [num_heads, d] at slot * num_heads. epochs: see above (NULL: pack every group
 * afresh). */
#define SP_MEMBERS (PF_MAX_ROWS / PF_MAX_G) /* members per item: 16, whatever the GQA group */
#define SP_MIN_PIECE_TILES 2                /* keys per piece: at least 64 */

/* Row blocks of an item of `members` members (g query heads each): AMX tiles of 16 rows, or the
 * AVX-512 path's register blocks of PF_RS. */
static int64_t row_blocks(int64_t members, int g, int amx) {
    const int block = amx ? 16 : PF_RS;
    return (members * g + block - 1) / block;
}

/* How each group's items are made when the groups' natural items (a KV head and up to SP_MEMBERS
 * members each) would leave threads idle, as one request's verify step does (5 tokens: 3 items for 2
 * threads): its members spread over more items (per[j] members each), where that adds no row block
 * (9 tokens: 27 rows as 15 + 12), else its prefix cut into pieces[j] key ranges, each a partial the
 * decode kernel merges like its splits (5 tokens: 15 rows, one AMX tile whether 15 or 6 are live).
 * Spreading members repeats every key for each item; cutting keys repeats no work but adds partials. */
void shared_prefix_pieces(int num_groups, const int *member0, const int *tokens, int num_kv_heads, int g, int d,
                          int threads, int *pieces, int *per) {
    const int amx = prefill_amx(d);
    int64_t whole = 0;
    for (int j = 0; j < num_groups; j++)
        whole += (int64_t)num_kv_heads * ((member0[j + 1] - member0[j] + SP_MEMBERS - 1) / SP_MEMBERS);
    const int64_t want = 2 * (int64_t)threads;
    const int64_t cut = whole >= want ? 1 : (want + whole - 1) / whole;
    for (int j = 0; j < num_groups; j++) {
        const int count = member0[j + 1] - member0[j];
        const int64_t base = (count + SP_MEMBERS - 1) / SP_MEMBERS;
        int64_t chunks = base * cut < count ? base * cut : count;
        const int spread = (int)((count + chunks - 1) / chunks);
        chunks = (count + spread - 1) / spread;
        const int64_t blocks_spread = (chunks - 1) * row_blocks(spread, g, amx)
                                      + row_blocks(count - (chunks - 1) * spread, g, amx);
        const int64_t blocks_whole = (base - 1) * row_blocks(SP_MEMBERS, g, amx)
                                     + row_blocks(count - (base - 1) * SP_MEMBERS, g, amx);
        const int64_t most = (tokens[j] + PF_KT - 1) / PF_KT / SP_MIN_PIECE_TILES;
        if (cut == 1 || blocks_spread <= blocks_whole || most < 2) {
            pieces[j] = 1;
            per[j] = cut == 1 ? SP_MEMBERS : spread;
        } else {
            pieces[j] = (int)(cut < most ? cut : most);
            per[j] = SP_MEMBERS;
        }
    }
}

/* Item it of a call's shared-prefix items: group j, KV head kh, piece of its keys, chunk of its members
 * (items of group j from item0[j]: (member chunk, piece, KV head), KV head fastest). */
typedef struct {
    int j, kh, piece, chunk;
} prefix_item;

static prefix_item prefix_item_at(const int64_t *item0, int num_kv_heads, const int *pieces, int64_t it) {
    const int j = unit_of(item0, it);
    const int64_t local = it - item0[j];
    return (prefix_item){j, (int)(local % num_kv_heads), (int)(local / num_kv_heads % pieces[j]),
                         (int)(local / num_kv_heads / pieces[j])};
}

/* The first packed tile of item x's piece of its group's keys. */
static inline int64_t piece_tile0(const packed_kv *pk, const int *pieces, prefix_item x) {
    return pk->ntiles[x.j] * x.piece / pieces[x.j];
}

/* The first packed keys of shared-prefix item it (NULL past the last item): what a thread asks for
 * while it finishes the item before, so that no item starts on keys still in memory. */
static const uint32_t *item_keys(const packed_kv *pk, const int64_t *item0, int num_kv_heads, const int *pieces,
                                 int64_t it, int64_t items) {
    if (it >= items) return NULL;
    const prefix_item x = prefix_item_at(item0, num_kv_heads, pieces, it);
    return pk->kp[x.j] + packed_base(pk, x.j, x.kh) + piece_tile0(pk, pieces, x) * pk->tile_elems;
}

/* One call's cascade work, from shared_prefix_begin to shared_prefix_end, so that its items can share
 * one parallel loop with the decode kernel's own (csrc/paged_attention.c): while one thread waits on a
 * prefix's packed keys, the other reads a request's pages. */
typedef struct shared_prefix_step shared_prefix_step;
struct shared_prefix_step {
    const float *q;
    int num_heads, num_kv_heads, d, g, amx, keep;
    float scale, cap;
    const int *members, *member0, *tokens, *pieces, *per, *slot;
    float *pm, *pl, *po;
    int64_t *item0, items;
    const int32_t **blocks;
    int *k0, *todo;
    packed_kv pk;
};

shared_prefix_step *shared_prefix_begin(const float *q, const uint16_t *cache, int64_t page_stride, int block_size,
                                        const int32_t *block_table, int max_blocks, int num_groups,
                                        const int *members, const int *member0, const int *tokens,
                                        const int *pieces, const int *per, const int *slot, int num_heads,
                                        int num_kv_heads, int d, float scale, float cap, float *pm, float *pl,
                                        float *po, const int64_t *epochs) {
    shared_prefix_step *st = (shared_prefix_step *)malloc(sizeof(shared_prefix_step));
    *st = (shared_prefix_step){.q = q, .num_heads = num_heads, .num_kv_heads = num_kv_heads, .d = d,
                               .g = num_heads / num_kv_heads, .amx = prefill_amx(d), .scale = scale, .cap = cap,
                               .members = members, .member0 = member0, .tokens = tokens, .pieces = pieces,
                               .per = per, .slot = slot, .pm = pm, .pl = pl, .po = po};
    const int64_t row = (int64_t)num_kv_heads * d, v_offset = (int64_t)block_size * row;
    int64_t *item0 = st->item0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_groups + 1));
    const int32_t **blocks = st->blocks = (const int32_t **)malloc(sizeof(*blocks) * (size_t)num_groups);
    int *k0 = st->k0 = (int *)calloc((size_t)num_groups, sizeof(int)); /* every group's keys from 0 */
    int *todo = st->todo = (int *)malloc(sizeof(int) * (size_t)num_groups), ntodo = 0;
    /* Items of group j: (member chunk of per[j], piece, KV head), KV head fastest (prefix_item_at). */
    item0[0] = 0;
    for (int j = 0; j < num_groups; j++) {
        blocks[j] = block_table + (int64_t)members[member0[j]] * max_blocks;
        const int64_t chunks = (member0[j + 1] - member0[j] + per[j] - 1) / per[j];
        item0[j + 1] = item0[j] + (int64_t)num_kv_heads * pieces[j] * chunks;
    }
    packed_kv *pk = &st->pk;
    packed_init(pk, num_groups, k0, tokens, num_kv_heads, d);
    st->keep = prefix_cache_begin(epochs);
    int *spare = (int *)malloc(sizeof(int) * (size_t)num_groups), nspare = 0; /* packed outside the cache */
    for (int j = 0; j < num_groups; j++) {
        prefix_entry *e = st->keep ? prefix_entry_for(cache, page_stride, block_size, num_kv_heads, d, tokens[j],
                                                      blocks[j], epochs, pk->tile_elems, 1, &pk->from[j])
                                   : NULL;
        if (!e) {
            spare[nspare++] = todo[ntodo++] = j;
            continue;
        }
        if (unit_in_entry(pk, j, e)) todo[ntodo++] = j;
    }
    packed_alloc(pk, spare, nspare);
    free(spare);
    pack_units(pk, todo, ntodo, cache, NULL, page_stride, block_size, blocks, k0, tokens, row, v_offset, d);
    st->items = item0[num_groups];
    return st;
}

int64_t shared_prefix_items(const shared_prefix_step *st) { return st->items; }

/* A thread's scratch for shared_prefix_item, its AMX tiles configured where used. */
void *shared_prefix_scratch(const shared_prefix_step *st) { return scratch_begin(st->amx); }
void shared_prefix_scratch_end(const shared_prefix_step *st, void *w) { scratch_end((pf_scratch *)w, st->amx); }

/* Item it; nth: about how many items on the thread's next one is (for item_keys). */
void shared_prefix_item(const shared_prefix_step *st, int64_t it, int64_t nth, void *scratch) {
    pf_scratch *w = (pf_scratch *)scratch;
    const packed_kv *pk = &st->pk;
    const int num_kv_heads = st->num_kv_heads, num_heads = st->num_heads, d = st->d, g = st->g;
    const int *members = st->members, *member0 = st->member0, *per = st->per, *pieces = st->pieces;
    const prefix_item x = prefix_item_at(st->item0, num_kv_heads, pieces, it);
    const int j = x.j, kh = x.kh, piece = x.piece;
    const int m0 = member0[j] + x.chunk * per[j];
    const int m1 = m0 + per[j] < member0[j + 1] ? m0 + per[j] : member0[j + 1];
    const int live = (m1 - m0) * g, block = st->amx ? 16 : PF_RS;
    const int rows = (live + block - 1) / block * block;
    for (int r = 0; r < rows; r++) {
        uint16_t *qr = (uint16_t *)(w->qb + (int64_t)r * (d / 2));
        if (r < live) {
            const float *src = st->q + ((int64_t)members[m0 + r / g] * num_heads + kh * g + r % g) * d;
            for (int i = 0; i < d; i += 16) /* d is a multiple of 16; RNE, as f32_to_bf16 */
                _mm256_storeu_si256((__m256i *)(qr + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
            w->pos[r] = st->tokens[j] - 1; /* every prefix key visible, the padding past it not */
        } else {
            memset(qr, 0, sizeof(uint16_t) * d);
            w->pos[r] = -1;
        }
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)rows * d);
    const int64_t base = packed_base(pk, j, kh), ntiles = pk->ntiles[j];
    attend_rows(pk->kp[j] + base, pk->vp[j] + base, 0, (int)piece_tile0(pk, pieces, x),
                (int)(ntiles * (piece + 1) / pieces[j]), rows, d, st->scale, 0, st->cap, w, st->amx, 1,
                item_keys(pk, st->item0, num_kv_heads, pieces, it + nth, st->items));
    for (int r = 0; r < live; r++) {
        const int64_t at = (int64_t)(st->slot[members[m0 + r / g]] + piece) * num_heads + kh * g + r % g;
        st->pm[at] = w->m[r];
        st->pl[at] = w->l[r];
        memcpy(st->po + at * d, w->o + (int64_t)r * d, sizeof(float) * (size_t)d);
    }
}

void shared_prefix_end(shared_prefix_step *st) {
    if (st->keep) prefix_cache_end();
    packed_free(&st->pk);
    free(st->item0); free(st->blocks); free(st->k0); free(st->todo);
    free(st);
}

#else

int paged_prefill_available(void) { return 0; }
int paged_prefill_supports(int num_heads, int num_kv_heads, int head_size) {
    (void)num_heads; (void)num_kv_heads; (void)head_size;
    return 0;
}
void paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const void *cache, int kv_kind, int64_t page_stride,
                        int block_size, const int32_t *block_table, int max_blocks, const int32_t *chunks,
                        int num_chunks, int num_heads, int num_kv_heads, int head_size, float scale,
                        int window, uint16_t *out, int64_t out_stride, float cap, const float *sinks,
                        const int64_t *epochs) {
    (void)cap; (void)sinks; (void)epochs; (void)q; (void)q_stride; (void)cache; (void)kv_kind; (void)page_stride; (void)block_size; (void)block_table;
    (void)max_blocks; (void)chunks; (void)num_chunks; (void)num_heads; (void)num_kv_heads;
    (void)head_size; (void)scale; (void)window; (void)out; (void)out_stride;
    abort(); /* the caller checks paged_prefill_available() first */
}

#endif
