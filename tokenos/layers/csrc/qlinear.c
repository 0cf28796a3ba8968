/*
 * Weight-only quantized linears: y = x W^T with W kept packed in 4 or 8 bits and group-wise scales.
 *
 * A weight row n, column k dequantizes to q[n,k] * s[n,g] + z[n,g] (g = k / group; z may be absent),
 * which holds GGUF's Q4_0 / Q4_1 / Q8_0 blocks and GPTQ / AWQ groups exactly up to the rounding of s, z
 * to fp16 (the precision GGUF stores them in).
 *
 * Layout (built by tokenos/layers/quantization.py): rows in blocks of 16, columns in pairs. For block b
 * and column pair p, the 32 weights w[16b + r, 2p + t] (r < 16, t < 2) form one cell, ordered so that
 * widening it gives two 16-lane vectors
 *   B = (r0 t0, r0 t1, r1 t0, ..., r7 t1)   and   A = (r8 t0, ..., r15 t1)
 * with no shuffle. int8: 32 bytes per pair, bytes 0..15 = B, 16..31 = A. int4: 32 bytes per two pairs
 * (2j, 2j + 1), byte i = lane i of pair 2j | lane i of pair 2j + 1 << 4 (lanes 0..15 = B, 16..31 = A),
 * so one 32-byte load widens to both pairs. After the scale and zero, one vcvtne2ps2bf16(A, B) turns a
 * pair into the layout vdpbf16ps multiplies against a broadcast (x[2p], x[2p+1]): dword lane r = row r.
 * Scales and zeros are fp16 [blocks][groups][16].
 *
 * qgemm_*: up to 16 activation rows (decode; past 8 in passes of up to 8 over each tile), each cell's
 * integers go straight into the dot product and each group's scale and zero apply once to its integer
 * sum, so the weights are read once, as packed bytes, and never rounded. More rows: a chunk of 128 column
 * pairs of a 32-row tile is dequantized once into an L1 panel of bf16 weights and every row runs over it
 * in tiles of 6, accumulating in fp32; on an AVX512-BF16 CPU this measures level with oneDNN's bf16 GEMM
 * from M = 64 to 2048. On an AMX-BF16
 * CPU the same panel, over the whole of K, is multiplied on AMX tiles instead (qgemm_amx), and 2 to 16
 * rows multiply the integer cells on tiles, exact as the few-row path (qgemv_amx). The fp32 build
 * (AVX2) takes a panel path in fp32 past MV32 rows; fewer (qgemv_f32) go straight from the cells;
 * qdequant_f32_desc writes rows of the weight as dense fp32 for a torch GEMM at many rows.
 * qgemm_bf16_argmax_desc runs the same bf16 paths but keeps each row's argmax instead of its outputs
 * (an LM head's greedy ids without its logits).
 * Built where the compiler targets AVX2 + FMA + F16C (fp32) and AVX512-BF16 (bf16);
 * qlinear_available() says which.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_F32 1
#else
#define QL_F32 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define QL_BF16 1
#else
#define QL_BF16 0
#endif
#include "amx.h"
#include "argmax.h"
#include "vec_math.h"
#if QL_BF16 && AMX_AVAILABLE
#include <sys/syscall.h>
#include <unistd.h>
#define QL_AMX 1
#else
#define QL_AMX 0
#endif

int qlinear_available(void) { return QL_F32 | (QL_BF16 << 1); }
int kernels_amx_ready(void); /* below, in every build */

/* Batch invariance (cpu_kernels.set_batch_invariant, TOKENOS_BATCH_INVARIANT=1): every row count takes
 * the same arithmetic, so a row's outputs are the same bits whatever rows share its call (a decode
 * alone, the same token among a speculative verify's, a batch of 64). By default the kernel is picked
 * by row count (a GEMV, the few-row tiles, a dequantized panel), and rows differ in their last bits
 * between them. On: with AMX, the few-row path's integer tiles for every row count (one row, and past
 * 16 rows in slices of 16 over a panel of widened cells); without it, the panel path for every row
 * count, never the GEMV. */
static int batch_invariant = 0;
void kernels_set_batch_invariant(int on) { batch_invariant = on; }
int kernels_batch_invariant(void) { return batch_invariant; }

/* A packed weight as the Python side describes it once (one pointer per call instead of seven
 * arguments: ctypes converts every argument on every call). */
typedef struct {
    const uint8_t *q;
    const uint16_t *s, *z;
    int32_t bits, group;
    int64_t K, N;
} qdesc;

/* Bytes of one 16-row block per column pair, and where pair p's cell starts (int4: its double cell,
 * the pair's values in nibble p & 1). */
static inline int64_t cell_bytes(int bits) { return bits == 4 ? 16 : 32; }
static inline const uint8_t *cell_at(const uint8_t *cells, int64_t p, int bits) {
    return bits == 4 ? cells + (p >> 1) * 32 : cells + p * 32;
}

#if QL_BF16
#define KCP 128 /* column pairs per panel chunk: 16 KiB for 32 rows */
#define MT 6    /* activation rows per panel tile */
#define MV 8    /* rows per pass of the panel-free path */
#define GEMV_ROWS (2 * MV) /* up to this many rows, the panel-free path (without AMX: see qgemv_bf16) */
/* Bytes ahead of the cells in use that the few-row paths and the panel dequantizer ask for. Weights
 * stream from memory once per step, and a thread's share of them is contiguous; with the hardware
 * prefetcher alone these loops, busy with widening and multiply-adds, left the stream idle while
 * they computed (an int4 GEMV of the LM head's shape over 212 MB of weights: 17 GB/s where a
 * plain read reaches 29; 8 KiB ahead: 23 GB/s; 256 B to 4 KiB ahead changed little). */
#define STREAM_AHEAD 8192
/* int8 weights are also asked for STREAM_FAR ahead into L2: the LM head's GEMV (SmolLM2's 49152 x 576
 * int8, 28 MB) went from 1.05-1.12 to 0.965 ms (29 GB/s), where int4 layers measured level or a little
 * slower (/tmp C harness, 2 threads, p25 of 280 calls). */
#define STREAM_FAR 16384

/* The GEMV's streaming prefetches for its two blocks' lines at a and b: STREAM_AHEAD into L1, and for
 * int8 STREAM_FAR into L2, the two L1 requests first (a helper per line, interleaving L1 and L2
 * requests, made the GEMV 1.6-2x slower in the /tmp C harness). */
static inline __attribute__((always_inline)) void prefetch_cells(const uint8_t *a, const uint8_t *b, int bits) {
    _mm_prefetch((const char *)a + STREAM_AHEAD, _MM_HINT_T0);
    _mm_prefetch((const char *)b + STREAM_AHEAD, _MM_HINT_T0);
    if (bits == 8) {
        _mm_prefetch((const char *)a + STREAM_FAR, _MM_HINT_T1);
        _mm_prefetch((const char *)b + STREAM_FAR, _MM_HINT_T1);
    }
}

typedef struct {
    const uint8_t *q;
    const uint16_t *s, *z;
    int bits, group;
    int64_t K, N;
    argmax_pick *best; /* NULL: outputs are stored; else each thread's picks [threads][M], nothing stored */
    int64_t M;
} qweight;

/* A cell's 32 integers as bf16 pairs (dword lane r = row r). An int4 nibble v becomes the bit pattern
 * 0x4300 | v, which is exactly 128 + v; an int8 goes through fp32, exactly. */
static inline __m512i int8_ints(const uint8_t *cell) {
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)cell)));
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(cell + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(a, b);
}

/* (x[0], x[1]) in every dword lane, straight from memory: one broadcast load. Read through a GPR (a
 * memcpy of both pairs into an int64, as GCC compiles it) each broadcast is a GPR-to-vector move and a
 * shuffle, which on Zen 4 share the FP pipes with vdpbf16ps. */
static inline __m512bh bcast_pair(const uint16_t *x) { return (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(x)); }

/* Pairs p (even) and p + 1 of a block: one load for int4's double cell. */
static inline void pair_ints(const uint8_t *cells, int64_t p, int bits, __m512i *even, __m512i *odd) {
    if (bits == 4) {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(cells + (p >> 1) * 32)));
        const __m512i f = _mm512_set1_epi16(15), bias = _mm512_set1_epi16(0x4300);
        *even = _mm512_or_si512(_mm512_and_si512(v, f), bias);
        *odd = _mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
    } else {
        *even = int8_ints(cells + p * 32);
        *odd = int8_ints(cells + (p + 1) * 32);
    }
}

/* Scale and zero of block blk (clamped to the last), group g, lane r = row r. With q the cell's integer
 * (128 + v for int4), sum_k w x = s * sum_k q x + (z - 128 s) * sum_k x over the group. */
static inline void group_scale(const qweight *w, int64_t blk, int64_t g, float offset, __m512 *sc, __m512 *zc) {
    int64_t nblocks = (w->N + 15) / 16, groups = w->K / w->group;
    blk = blk < nblocks ? blk : nblocks - 1;
    *sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->s + (blk * groups + g) * 16)));
    *zc = w->z ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->z + (blk * groups + g) * 16)))
               : _mm512_setzero_ps();
    if (offset != 0.0f) *zc = _mm512_fnmadd_ps(_mm512_set1_ps(offset), *sc, *zc);
}

/* An int8 cell as two planes of nibbles, for few rows: with u = q + 128 = 16 h + l, the bf16 patterns
 * 0x4300 | l and 0x4300 | h are 128 + l and 128 + h exactly, and
 * sum q x = 16 sum (128 + h) x + sum (128 + l) x - 2304 sum x: one widening and two dot products per
 * cell instead of two conversions through fp32. */
#define INT8_PLANES_OFFSET 2304.0f
static inline void int8_planes(const uint8_t *cell, __m512i *lo, __m512i *hi) {
    __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)cell), _mm256_set1_epi8((char)0x80));
    __m512i v = _mm512_cvtepu8_epi16(u);
    const __m512i f = _mm512_set1_epi16(15), bias = _mm512_set1_epi16(0x4300);
    *lo = _mm512_or_si512(_mm512_and_si512(v, f), bias);
    *hi = _mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
}

/* Every row's sum of x over each group: xsum[m * groups + g]. */
static void group_sums(const qweight *w, const uint16_t *x, int64_t M, int64_t xs, float *xsum) {
    int64_t groups = w->K / w->group;
    _Pragma("omp parallel for schedule(static) if (M > 64)") /* one row's sums stay in one thread */
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < groups; g++) {
            float t = 0;
            for (int64_t k = g * w->group; k < (g + 1) * w->group; k++) {
                uint32_t bits = (uint32_t)x[i * xs + k] << 16;
                float f;
                memcpy(&f, &bits, 4);
                t += f;
            }
            xsum[i * groups + g] = t;
        }
}

/* Rows [m0, m0 + rows) of a 32-column tile (acc, row stride 32) into the thread's picks. */
static void pick_rows(const qweight *w, const float *acc, int64_t m0, int64_t rows, int64_t n0, int64_t width) {
    int me = 0;
#ifdef _OPENMP
    me = omp_get_thread_num();
#endif
    argmax_pick *b = w->best + (int64_t)me * w->M + m0;
    const __mmask16 m_lo = (__mmask16)(width >= 16 ? 0xFFFF : (1u << width) - 1);
    const __mmask16 m_hi = (__mmask16)(width >= 32 ? 0xFFFF : width > 16 ? (1u << (width - 16)) - 1 : 0);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < rows; i++) {
        if (b[i].nan) continue; /* a NaN in an earlier column outranks everything after it */
        const float *a = acc + i * 32;
        const __m512 lo = _mm512_mask_loadu_ps(ninf, m_lo, a), hi = _mm512_mask_loadu_ps(ninf, m_hi, a + 16);
        const uint32_t nan = (uint32_t)_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q)
                             | (uint32_t)_mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q) << 16;
        argmax_pick tile = {0.f, n0 + (nan ? __builtin_ctz(nan) : 0), nan != 0};
        if (!nan) {
            tile.max = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
            if (b[i].at >= 0 && !(tile.max > b[i].max)) continue; /* the fold would keep b[i] */
            const __m512 t = _mm512_set1_ps(tile.max);
            tile.at = n0 + __builtin_ctz((uint32_t)_mm512_cmp_ps_mask(lo, t, _CMP_EQ_OQ)
                                         | (uint32_t)_mm512_cmp_ps_mask(hi, t, _CMP_EQ_OQ) << 16);
        }
        argmax_fold(&b[i], tile);
    }
}

static void store_rows(const qweight *w, const float *acc, int64_t m0, int64_t rows, int64_t n0, int64_t N,
                       void *out, int64_t os, int out_f32) {
    int64_t width = N - n0 < 32 ? N - n0 : 32;
    if (w->best) {
        pick_rows(w, acc, m0, rows, n0, width);
        return;
    }
    for (int64_t i = 0; i < rows; i++) {
        for (int h = 0; h < 2 && h * 16 < width; h++) {
            int64_t lanes = width - h * 16 < 16 ? width - h * 16 : 16;
            __mmask16 m = (__mmask16)((1u << lanes) - 1);
            __m512 v = _mm512_loadu_ps(acc + i * 32 + h * 16);
            if (out_f32) {
                _mm512_mask_storeu_ps((float *)out + i * os + n0 + h * 16, m, v);
            } else {
                __m256i bf = (__m256i)_mm512_cvtneps_pbh(v);
                _mm256_mask_storeu_epi16((uint16_t *)out + i * os + n0 + h * 16, m, bf);
            }
        }
    }
}

/* Up to MV rows over a 32-row tile, straight from the cells: per group, the integer dot products, then
 * the scale and zero once. Up to 2 rows, even and odd pairs go to separate chains, for the dot
 * product's latency. */
static inline __attribute__((always_inline)) void gemv_tile(int mt, const qweight *w, int64_t blk0,
                                                            const uint16_t *x, int64_t xs, const float *xsum,
                                                            float *acc) {
    int64_t groups = w->K / w->group, gp = w->group / 2, cb = cell_bytes(w->bits);
    int64_t nblocks = (w->N + 15) / 16;
    /* split: even and odd pairs in separate chains (int4), or int8 as two nibble planes. */
    int two = blk0 + 1 < nblocks, split = mt <= 2, planes = split && w->bits == 8;
    float offset = w->bits == 4 ? 128.0f : planes ? INT8_PLANES_OFFSET : 0.0f;
    const uint8_t *c0 = w->q + blk0 * (w->K / 2) * cb, *c1 = c0 + (w->K / 2) * cb;
    for (int i = 0; i < mt * 32; i++) acc[i] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        __m512 d[MV][2], e[2][2];
        for (int i = 0; i < mt; i++) d[i][0] = d[i][1] = _mm512_setzero_ps();
        for (int i = 0; i < 2; i++) e[i][0] = e[i][1] = _mm512_setzero_ps();
        int64_t p = g * gp, end = p + gp; /* p is even: int4 groups hold whole double cells */
        for (; planes && p < end; p++) { /* e: the high planes */
            prefetch_cells(c0 + p * 32, c1 + p * 32, 8);
            __m512i l0, h0, l1, h1;
            int8_planes(c0 + p * 32, &l0, &h0);
            if (two)
                int8_planes(c1 + p * 32, &l1, &h1);
            else
                l1 = l0, h1 = h0;
            for (int i = 0; i < mt; i++) {
                __m512bh xb = bcast_pair(x + i * xs + 2 * p);
                d[i][0] = _mm512_dpbf16_ps(d[i][0], (__m512bh)l0, xb);
                d[i][1] = _mm512_dpbf16_ps(d[i][1], (__m512bh)l1, xb);
                e[i][0] = _mm512_dpbf16_ps(e[i][0], (__m512bh)h0, xb);
                e[i][1] = _mm512_dpbf16_ps(e[i][1], (__m512bh)h1, xb);
            }
        }
        for (; p + 1 < end; p += 2) {
            prefetch_cells(cell_at(c0, p, w->bits), cell_at(c1, p, w->bits), w->bits);
            __m512i w0, v0, w1, v1;
            pair_ints(c0, p, w->bits, &w0, &v0);
            if (two)
                pair_ints(c1, p, w->bits, &w1, &v1);
            else
                w1 = w0, v1 = v0;
            for (int i = 0; i < mt; i++) {
                __m512bh xe = bcast_pair(x + i * xs + 2 * p), xo = bcast_pair(x + i * xs + 2 * p + 2);
                d[i][0] = _mm512_dpbf16_ps(d[i][0], (__m512bh)w0, xe);
                d[i][1] = _mm512_dpbf16_ps(d[i][1], (__m512bh)w1, xe);
                if (split) {
                    e[i][0] = _mm512_dpbf16_ps(e[i][0], (__m512bh)v0, xo);
                    e[i][1] = _mm512_dpbf16_ps(e[i][1], (__m512bh)v1, xo);
                } else {
                    d[i][0] = _mm512_dpbf16_ps(d[i][0], (__m512bh)v0, xo);
                    d[i][1] = _mm512_dpbf16_ps(d[i][1], (__m512bh)v1, xo);
                }
            }
        }
        for (; p < end; p++) { /* int8 groups of an odd number of pairs */
            __m512bh w0 = (__m512bh)int8_ints(c0 + p * 32);
            __m512bh w1 = two ? (__m512bh)int8_ints(c1 + p * 32) : w0;
            for (int i = 0; i < mt; i++) {
                __m512bh xb = bcast_pair(x + i * xs + 2 * p);
                d[i][0] = _mm512_dpbf16_ps(d[i][0], w0, xb);
                d[i][1] = _mm512_dpbf16_ps(d[i][1], w1, xb);
            }
        }
        for (int h = 0; h < 2; h++) {
            __m512 sc, zc;
            group_scale(w, blk0 + h, g, offset, &sc, &zc);
            for (int i = 0; i < mt; i++) {
                __m512 odd = e[i < 2 ? i : 0][h];
                __m512 dot = planes  ? _mm512_fmadd_ps(_mm512_set1_ps(16.0f), odd, d[i][h])
                             : split ? _mm512_add_ps(d[i][h], odd)
                                     : d[i][h];
                __m512 a = _mm512_loadu_ps(acc + i * 32 + h * 16);
                a = _mm512_fmadd_ps(sc, dot, a);
                a = _mm512_fmadd_ps(zc, _mm512_set1_ps(xsum[i * groups + g]), a);
                _mm512_storeu_ps(acc + i * 32 + h * 16, a);
            }
        }
    }
}

/* Past MV rows, passes of up to MV rows over each tile (as even as they go: 9 rows are 5 + 4), the
 * tile's cells widened again for each pass from L1. Up to GEMV_ROWS this beats the panel path, whose
 * dequantizing so few rows share (AMD EPYC Zen 4, /tmp C harness, 2 threads, weights from memory, p25 us,
 * panel -> passes: int4 3072 x 576 at 9 / 16 / 24 rows 144 -> 106, 199 -> 162, 257 -> 245; int4
 * 576 x 1536 74 -> 54, 97 -> 84, 130 -> 124; the int8 LM head, 49152 x 576, 2912 -> 2188, 3505 -> 3150,
 * 4609 -> 4814); from 24 rows on the two measured about level, from 32 the panel ahead. */
static void qgemv_bf16(const qweight *w, const uint16_t *x, int64_t M, int64_t xs, void *out, int64_t os,
                       int out_f32) {
    int64_t groups = w->K / w->group, ntiles = (w->N + 31) / 32;
    const int64_t passes = (M + MV - 1) / MV, per = (M + passes - 1) / passes;
    float xsum[M * groups];
    group_sums(w, x, M, xs, xsum);
    _Pragma("omp parallel for schedule(static)") for (int64_t t = 0; t < ntiles; t++) {
        float acc[MV * 32] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += per) {
            const int64_t mt = M - m0 < per ? M - m0 : per;
            const uint16_t *xr = x + m0 * xs;
            const float *sr = xsum + m0 * groups;
            switch (mt) {
            case 8: gemv_tile(8, w, 2 * t, xr, xs, sr, acc); break;
            case 7: gemv_tile(7, w, 2 * t, xr, xs, sr, acc); break;
            case 6: gemv_tile(6, w, 2 * t, xr, xs, sr, acc); break;
            case 5: gemv_tile(5, w, 2 * t, xr, xs, sr, acc); break;
            case 4: gemv_tile(4, w, 2 * t, xr, xs, sr, acc); break;
            case 3: gemv_tile(3, w, 2 * t, xr, xs, sr, acc); break;
            case 2: gemv_tile(2, w, 2 * t, xr, xs, sr, acc); break;
            default: gemv_tile(1, w, 2 * t, xr, xs, sr, acc); break;
            }
            void *rows = out ? (char *)out + m0 * os * (out_f32 ? 4 : 2) : NULL;
            store_rows(w, acc, m0, mt, 32 * t, w->N, rows, os, out_f32);
        }
    }
}

/* The panel path (more than MV rows) multiplies dequantized weights, rounded once to bf16: the scale
 * and zero cost nothing in the inner loop, which is what keeps it level with oneDNN's bf16 GEMM at
 * prefill sizes. The few-row path above does not round them, so a token's logits can differ in the
 * last bits between a step of up to MV rows and a larger one, as with any GEMM that picks its kernel by
 * shape. */

/* A cell as two fp32 vectors in the B (rows 0-7) and A (rows 8-15) lane orders. */
static inline void cell_floats(const uint8_t *cells, int64_t p, int bits, __m512 *b, __m512 *a) {
    const uint8_t *cell = cell_at(cells, p, bits);
    if (bits == 4) {
        __m128i shift = _mm_cvtsi32_si128(4 * (int)(p & 1));
        __m512i f = _mm512_set1_epi32(15);
        __m512i db = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)cell));
        __m512i da = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(cell + 16)));
        *b = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(db, shift), f));
        *a = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(da, shift), f));
    } else {
        *b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)cell)));
        *a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(cell + 16))));
    }
}

/* 16 fp16 values of one block and group, spread to the B and A lane orders. */
static inline void spread(const uint16_t *v, __m512 *vb, __m512 *va) {
    const __m512i ib = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i ia = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)v));
    *vb = _mm512_permutexvar_ps(ib, f);
    *va = _mm512_permutexvar_ps(ia, f);
}

/* Column pairs [p0, p1) of block blk as dequantized bf16 pairs, at dst[(p - p0) * step] (zeros past
 * the last block). */
static void deq_block(const qweight *w, int64_t blk, int64_t p0, int64_t p1, __m512i *dst, int step) {
    if (blk >= (w->N + 15) / 16) {
        for (int64_t p = p0; p < p1; p++) dst[(p - p0) * step] = _mm512_setzero_si512();
        return;
    }
    int64_t groups = w->K / w->group, gp = w->group / 2, cb = cell_bytes(w->bits);
    const uint8_t *cells = w->q + blk * (w->K / 2) * cb;
    __m512 sb, sa, zb = _mm512_setzero_ps(), za = zb;
    for (int64_t p = p0; p < p1;) {
        int64_t g = p / gp, end = (g + 1) * gp < p1 ? (g + 1) * gp : p1;
        spread(w->s + (blk * groups + g) * 16, &sb, &sa);
        if (w->z) spread(w->z + (blk * groups + g) * 16, &zb, &za);
        for (int64_t b = (p - p0) * cb; b < (end - p0) * cb; b += 64)
            _mm_prefetch((const char *)cell_at(cells, p0, w->bits) + b + STREAM_AHEAD, _MM_HINT_T0);
        /* int4: an even pair and the next share one double cell, widened once for both (the low
         * nibbles are the even pair, the high ones the odd). */
        for (; w->bits == 4 && (p & 1) == 0 && p + 1 < end; p += 2) {
            const uint8_t *cell = cells + (p >> 1) * 32;
            const __m512i f = _mm512_set1_epi32(15);
            __m512i db = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)cell));
            __m512i da = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(cell + 16)));
            __m512 b0 = _mm512_cvtepi32_ps(_mm512_and_si512(db, f)), a0 = _mm512_cvtepi32_ps(_mm512_and_si512(da, f));
            __m512 b1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(db, 4)), a1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(da, 4));
            dst[(p - p0) * step] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(a0, sa, za), _mm512_fmadd_ps(b0, sb, zb));
            dst[(p + 1 - p0) * step] =
                (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(a1, sa, za), _mm512_fmadd_ps(b1, sb, zb));
        }
        for (; p < end; p++) {
            __m512 b, a;
            cell_floats(cells, p, w->bits, &b, &a);
            dst[(p - p0) * step] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(a, sa, za), _mm512_fmadd_ps(b, sb, zb));
        }
    }
}

static inline __attribute__((always_inline)) void tile_bf16(int mt, const __m512i *panel, int64_t np,
                                                            const uint16_t *x, int64_t xs, int64_t p0,
                                                            float *acc_io, int first) {
    __m512 acc[MT][2];
    for (int i = 0; i < mt; i++) {
        acc[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_io + i * 32);
        acc[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_io + i * 32 + 16);
    }
    for (int64_t p = 0; p < np; p++) {
        __m512bh w0 = (__m512bh)panel[2 * p], w1 = (__m512bh)panel[2 * p + 1];
        for (int i = 0; i < mt; i++) {
            __m512bh xb = bcast_pair(x + i * xs + 2 * (p0 + p));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xb);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xb);
        }
    }
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(acc_io + i * 32, acc[i][0]);
        _mm512_storeu_ps(acc_io + i * 32 + 16, acc[i][1]);
    }
}

#if QL_AMX
/* The AMX panel path: the same dequantized bf16 panel, multiplied in tiles by TDPBF16PS. A panel entry
 * (one block's pair p, 16 dword lanes = 16 weight rows) is exactly one 64-byte row of a B tile, so a
 * 32-row stripe dequantized over the whole of K (entries interleaved by block, as above) loads as
 * B tiles with a 128-byte stride. Tiles: 0-3 accumulate C (rows m0 / m0 + 16, block 0 / 1), 4-5 hold A,
 * 6-7 B. Activation rows past M come from a zero-padded copy, so every tile is full. */
static int amx_enabled = 1;
void kernels_set_amx(int on) { amx_enabled = on; }

/* Linux hands out AMX's tile state per process, on request (ARCH_REQ_XCOMP_PERM, XTILEDATA). */
static int amx_permitted(void) {
    static int state = 0;
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state > 0;
}

int kernels_amx_ready(void) { return amx_enabled && amx_permitted(); }

/* One 32-row group of activations against a stripe: C (32 x 32 fp32, row stride 32) = A . panel. */
static inline void amx_stripe_rows(const uint16_t *a, int64_t as, const __m512i *panel, int64_t K, int two,
                                   float *c) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const __m512i *b = panel + k0; /* pair k0 / 2, two entries per pair */
        _tile_loadd(4, a + k0, as * 2);
        _tile_loadd(6, b, 128);
        _tile_loadd(7, b + 1, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a + 16 * as + k0, as * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (two) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    }
}

/* The calling thread's contiguous share of n stripes, as even as whole stripes allow (inside a
 * parallel region). */
static inline void thread_span(int64_t n, int64_t *t0, int64_t *t1) {
    int nt = 1, me = 0;
#ifdef _OPENMP
    nt = omp_get_num_threads();
    me = omp_get_thread_num();
#endif
    *t0 = n * me / nt, *t1 = n * (me + 1) / nt;
}

/* A thread's panels: its stripes go in groups whose dequantized panels fit in AMX_PANEL_BYTES (about a
 * quarter of L2), and each 32-row block of activations runs over every stripe of the group before the
 * next block, so the activations are read from L2 once per group instead of from L3 once per stripe
 * (2048 rows of 576 are 2.4 MB). The buffer is the thread's own and kept between calls. */
#define AMX_PANEL_BYTES (512 * 1024)
static __thread __m512i *amx_panel;
static __thread int64_t amx_panel_bytes;

static __m512i *panel_buffer(int64_t bytes) {
    if (bytes > amx_panel_bytes) {
        free(amx_panel);
        amx_panel = aligned_alloc(64, (size_t)bytes);
        amx_panel_bytes = bytes;
    }
    return amx_panel;
}

static void qgemm_amx(const qweight *w, const uint16_t *x, int64_t M, int64_t xs, void *out, int64_t os,
                      int out_f32) {
    int64_t K = w->K, ntiles = (w->N + 31) / 32, full = M / 32 * 32, esize = out_f32 ? 4 : 2;
    int64_t stripe = K * 64; /* bytes: K / 2 pairs, two 64-byte entries each */
    int64_t group = AMX_PANEL_BYTES / stripe < 1 ? 1 : AMX_PANEL_BYTES / stripe;
    uint16_t *pad = NULL; /* the rows [full, M), then zeros, as one 32-row group */
    if (full < M) {
        pad = aligned_alloc(64, 32 * K * 2);
        memset(pad, 0, 32 * K * 2);
        for (int64_t i = full; i < M; i++) memcpy(pad + (i - full) * K, x + i * xs, K * 2);
    }
    _Pragma("omp parallel") {
        int64_t t0, t1;
        thread_span(ntiles, &t0, &t1);
        int64_t most = t1 - t0 < group ? t1 - t0 : group;
        __m512i *panel = most > 0 ? panel_buffer(most * stripe) : NULL;
        float c[32 * 32] __attribute__((aligned(64)));
        if (most > 0) amx_configure();
        for (int64_t g0 = t0; g0 < t1; g0 += group) {
            int64_t g1 = g0 + group < t1 ? g0 + group : t1;
            for (int64_t t = g0; t < g1; t++) {
                __m512i *p = panel + (t - g0) * (K / 2) * 2;
                deq_block(w, 2 * t, 0, K / 2, p, 2);
                deq_block(w, 2 * t + 1, 0, K / 2, p + 1, 2);
            }
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                int64_t rows = M - m0 < 32 ? M - m0 : 32;
                const uint16_t *a = m0 < full ? x + m0 * xs : pad;
                for (int64_t t = g0; t < g1; t++) {
                    amx_stripe_rows(a, m0 < full ? xs : K, panel + (t - g0) * (K / 2) * 2, K, rows > 16, c);
                    store_rows(w, c, m0, rows, 32 * t, w->N, (char *)out + m0 * os * esize, os, out_f32);
                }
            }
        }
        if (most > 0) _tile_release();
    }
    free(pad);
}

/* Few rows (AMX_FEW_MIN to AMX_FEW_MAX) on AMX, exact as the few-row path above: B tiles hold a
 * group's integer cells (128 + v for int4, q for int8, both exact in bf16) and the scale and zero apply once per group
 * to the tile sums, so nothing is rounded but fp32 sums. On a CPU with AMX, vdpbf16ps is the slow
 * part of qgemv_bf16 past two rows (a 5-row speculative verify costs about 2.5x a 1-row decode there):
 * one TDPBF16PS does a 32-column group's multiply-adds for all rows at once. */
#define AMX_FEW_MIN 2 /* 1 row: the AVX-512 GEMV measured 0.85x this path's time for int4, level for int8 */
#define AMX_FEW_MAX 16 /* one A tile */

/* One 16-pair chunk (pairs p to p + 15, 32 columns) of a block's integer cells, as 16 B-tile rows
 * at dst. */
static inline void int_rows(const qweight *w, const uint8_t *cells, int64_t p, __m512i *dst) {
    const char *at = (const char *)cell_at(cells, p, w->bits) + STREAM_AHEAD;
    for (int j = 0; j < (w->bits == 4 ? 256 : 512); j += 64) _mm_prefetch(at + j, _MM_HINT_T0);
    if (w->bits == 8)
        for (int j = 0; j < 512; j += 64) _mm_prefetch(at - STREAM_AHEAD + STREAM_FAR + j, _MM_HINT_T1);
    for (int j = 0; j < 16; j += 2) pair_ints(cells, p + j, w->bits, dst + j, dst + j + 1);
}

/* Group gg's tile sums (cg, row stride 32) into the accumulators, with the group's scale and zero. */
static inline __attribute__((always_inline)) void few_scale(const int M, const qweight *w, int64_t t, int64_t gg,
                                                            float offset, const float *cg, const float *xsum,
                                                            __m512 acc[][2]) {
    const int64_t groups = w->K / w->group;
    for (int h = 0; h < 2; h++) {
        __m512 sc, zc;
        group_scale(w, 2 * t + h, gg, offset, &sc, &zc);
        for (int i = 0; i < M; i++) {
            acc[i][h] = _mm512_fmadd_ps(sc, _mm512_load_ps(cg + h * 16 + i * 32), acc[i][h]);
            acc[i][h] = _mm512_fmadd_ps(zc, _mm512_set1_ps(xsum[i * groups + gg]), acc[i][h]);
        }
    }
}

/* Group g's tile sums (tiles 0-1 for an even g, 2-3 for an odd one) to c, and those tiles zeroed. */
static inline __attribute__((always_inline)) void few_store(int64_t g, float *c) {
    if (g & 1) {
        _tile_stored(2, c, 128);
        _tile_stored(3, c + 16, 128);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_stored(0, c, 128);
        _tile_stored(1, c + 16, 128);
        _tile_zero(0);
        _tile_zero(1);
    }
}

/* One 32-column tile t of qgemv_amx for a constant M (each M its own copy, by always_inline through
 * the switch below), so the M x 32 fp32 accumulators stay in registers. Software-pipelined, as the
 * tile unit's latency is the cost here, not its throughput: the integer cells of chunk k + 1 are
 * widened into the other B buffer before chunk k's tiles load; groups accumulate in alternate pairs
 * of C tiles, and a group's sums are stored one group after its multiplies were issued (a store right
 * after them waited for their result, a third of the time at 5 rows) and scaled one group after that,
 * so no tile load waits on the vector stores just made, and no vector load on a tile store. */
static inline __attribute__((always_inline)) void few_tile(const int M, const qweight *w, const uint16_t *x,
                                                           int64_t xs, int64_t t, const float *xsum, float offset,
                                                           __m512i b[2][2][16], float c[2][AMX_FEW_MAX * 32],
                                                           const __m512i *panel, int64_t m0, void *out,
                                                           int64_t os, int out_f32) {
    /* A copy whose address never escapes: the B buffers are written through __m512i (may_alias), which
     * would otherwise make every use of w reload its fields after every store. */
    const qweight wl = *w, *const wo = w;
    w = &wl;
    const int64_t K = w->K, groups = K / w->group, nblocks = (w->N + 15) / 16;
    const int64_t cb = cell_bytes(w->bits), chunks = K / 32, per_group = w->group / 32;
    const int two = 2 * t + 1 < nblocks;
    const uint8_t *c0 = w->q + 2 * t * (K / 2) * cb, *c1 = two ? c0 + (K / 2) * cb : c0;
    __m512 acc[AMX_FEW_MAX][2];
    for (int i = 0; i < M; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    if (!panel) {
        int_rows(w, c0, 0, b[0][0]);
        int_rows(w, c1, 0, b[0][1]);
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    int64_t g = 0, done = 0; /* chunk k's group, and its chunks issued before k */
    for (int64_t k = 0; k < chunks; k++) {
        if (!panel && k + 1 < chunks) {
            int_rows(w, c0, 16 * (k + 1), b[(k + 1) & 1][0]);
            int_rows(w, c1, 16 * (k + 1), b[(k + 1) & 1][1]);
        }
        _tile_loadd(4, x + 32 * k, xs * 2);
        _tile_loadd(6, panel ? panel + 32 * k : b[k & 1][0], 64);
        _tile_loadd(7, panel ? panel + 32 * k + 16 : b[k & 1][1], 64);
        if (g & 1) {
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 4, 7);
        } else {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (++done < per_group) continue;
        done = 0;
        if (g > 0) few_store(g - 1, c[(g - 1) & 1]);
        if (g > 1) few_scale(M, w, t, g - 2, offset, c[g & 1], xsum, acc);
        g++;
    }
    if (groups > 1) few_scale(M, w, t, groups - 2, offset, c[groups & 1], xsum, acc);
    few_store(groups - 1, c[(groups - 1) & 1]);
    few_scale(M, w, t, groups - 1, offset, c[(groups - 1) & 1], xsum, acc);
    float rows[AMX_FEW_MAX * 32] __attribute__((aligned(64)));
    for (int i = 0; i < M; i++) {
        _mm512_store_ps(rows + i * 32, acc[i][0]);
        _mm512_store_ps(rows + i * 32 + 16, acc[i][1]);
    }
    store_rows(wo, rows, m0, M, 32 * t, w->N, out, os, out_f32);
}

/* few_tile for M rows (1 to AMX_FEW_MAX), each row count its own copy. */
static void few_rows(int64_t M, const qweight *w, const uint16_t *x, int64_t xs, int64_t t, const float *xsum,
                     float offset, __m512i b[2][2][16], float c[2][AMX_FEW_MAX * 32], const __m512i *panel,
                     int64_t m0, void *out, int64_t os, int out_f32) {
#define FEW_CASE(R) case R: few_tile(R, w, x, xs, t, xsum, offset, b, c, panel, m0, out, os, out_f32); break;
    switch (M) {
        FEW_CASE(1) FEW_CASE(2) FEW_CASE(3) FEW_CASE(4) FEW_CASE(5) FEW_CASE(6) FEW_CASE(7) FEW_CASE(8)
        FEW_CASE(9) FEW_CASE(10) FEW_CASE(11) FEW_CASE(12) FEW_CASE(13) FEW_CASE(14) FEW_CASE(15)
        default: few_tile(AMX_FEW_MAX, w, x, xs, t, xsum, offset, b, c, panel, m0, out, os, out_f32); break;
    }
#undef FEW_CASE
}

static void qgemv_amx(const qweight *w, const uint16_t *x, int64_t M, int64_t xs, void *out, int64_t os,
                      int out_f32) {
    const int64_t groups = w->K / w->group, ntiles = (w->N + 31) / 32;
    const float offset = w->bits == 4 ? 128.0f : 0.0f;
    float xsum[AMX_FEW_MAX * groups];
    group_sums(w, x, M, xs, xsum);
    _Pragma("omp parallel") {
        int64_t t0, t1;
        thread_span(ntiles, &t0, &t1);
        __m512i b[2][2][16] __attribute__((aligned(64)));
        float c[2][AMX_FEW_MAX * 32] __attribute__((aligned(64)));
        if (t0 < t1) amx_configure_rows((int)M);
        for (int64_t t = t0; t < t1; t++) few_rows(M, w, x, xs, t, xsum, offset, b, c, NULL, 0, out, os, out_f32);
        if (t0 < t1) _tile_release();
    }
}

/* The few-row arithmetic past AMX_FEW_MAX rows (batch invariance): each row's sums are few_tile's, so
 * the same bits as in a call of one row. A thread's stripes are widened once per group of them into a
 * panel laid out as few_tile's B buffers (chunk k of a stripe: block 0's 16 B rows, then block 1's),
 * and every slice of up to 16 rows runs over the group. */
static void qgemm_amx_few(const qweight *w, const uint16_t *x, int64_t M, int64_t xs, void *out, int64_t os,
                          int out_f32) {
    const int64_t K = w->K, groups = K / w->group, ntiles = (w->N + 31) / 32, chunks = K / 32;
    const int64_t nblocks = (w->N + 15) / 16, cb = cell_bytes(w->bits), esize = out_f32 ? 4 : 2;
    const int64_t stripe = chunks * 32 * 64; /* bytes: 32 B rows of 64 bytes per chunk */
    const int64_t group = AMX_PANEL_BYTES / stripe < 1 ? 1 : AMX_PANEL_BYTES / stripe;
    const float offset = w->bits == 4 ? 128.0f : 0.0f;
    float *xsum = malloc(sizeof(float) * (size_t)(M * groups));
    group_sums(w, x, M, xs, xsum);
    _Pragma("omp parallel") {
        int64_t t0, t1;
        thread_span(ntiles, &t0, &t1);
        const int64_t most = t1 - t0 < group ? t1 - t0 : group;
        __m512i *panel = most > 0 ? panel_buffer(most * stripe) : NULL;
        __m512i b[2][2][16] __attribute__((aligned(64)));
        float c[2][AMX_FEW_MAX * 32] __attribute__((aligned(64)));
        for (int64_t g0 = t0; g0 < t1; g0 += group) {
            const int64_t g1 = g0 + group < t1 ? g0 + group : t1;
            for (int64_t t = g0; t < g1; t++) {
                const uint8_t *c0 = w->q + 2 * t * (K / 2) * cb;
                const uint8_t *c1 = 2 * t + 1 < nblocks ? c0 + (K / 2) * cb : c0;
                __m512i *p = panel + (t - g0) * chunks * 32;
                for (int64_t k = 0; k < chunks; k++) {
                    int_rows(w, c0, 16 * k, p + 32 * k);
                    int_rows(w, c1, 16 * k, p + 32 * k + 16);
                }
            }
            int configured = 0;
            for (int64_t m0 = 0; m0 < M; m0 += AMX_FEW_MAX) {
                const int64_t rows = M - m0 < AMX_FEW_MAX ? M - m0 : AMX_FEW_MAX;
                if (rows != configured) amx_configure_rows((int)rows), configured = (int)rows;
                void *o = out ? (char *)out + m0 * os * esize : NULL;
                for (int64_t t = g0; t < g1; t++)
                    few_rows(rows, w, x + m0 * xs, xs, t, xsum + m0 * groups, offset, b, c,
                             panel + (t - g0) * chunks * 32, m0, o, os, out_f32);
            }
        }
        if (most > 0) _tile_release();
    }
    free(xsum);
}
#endif

static void qgemm_bf16_w(const qweight *wp, const uint16_t *x, int64_t M, int64_t xs, void *out, int64_t os,
                         int out_f32) {
    const qweight w = *wp;
    const int64_t N = w.N, K = w.K;
#if QL_AMX
    const int few = w.group % 32 == 0 && kernels_amx_ready();
    if (few && M <= AMX_FEW_MAX && (M >= AMX_FEW_MIN || batch_invariant)) {
        qgemv_amx(&w, x, M, xs, out, os, out_f32);
        return;
    }
    if (few && batch_invariant) {
        qgemm_amx_few(&w, x, M, xs, out, os, out_f32);
        return;
    }
#endif
    if (M <= (kernels_amx_ready() ? MV : GEMV_ROWS) && !batch_invariant) {
        qgemv_bf16(&w, x, M, xs, out, os, out_f32);
        return;
    }
#if QL_AMX
    if (K % 32 == 0 && kernels_amx_ready()) { /* every row on its own: the same bits for any M */
        qgemm_amx(&w, x, M, xs, out, os, out_f32);
        return;
    }
#endif
    int64_t ntiles = (N + 31) / 32, pairs = K / 2;
    _Pragma("omp parallel") {
        __m512i panel[KCP * 2] __attribute__((aligned(64)));
        float *acc = aligned_alloc(64, ((M * 32 * sizeof(float) + 63) / 64) * 64);
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < ntiles; t++) {
            for (int64_t p0 = 0; p0 < pairs; p0 += KCP) {
                int64_t p1 = p0 + KCP < pairs ? p0 + KCP : pairs;
                deq_block(&w, 2 * t, p0, p1, panel, 2);
                deq_block(&w, 2 * t + 1, p0, p1, panel + 1, 2);
                for (int64_t m0 = 0; m0 < M; m0 += MT) {
                    int64_t mt = M - m0 < MT ? M - m0 : MT;
                    const uint16_t *xr = x + m0 * xs;
                    float *ar = acc + m0 * 32;
                    int first = p0 == 0;
                    switch (mt) {
                    case 6: tile_bf16(6, panel, p1 - p0, xr, xs, p0, ar, first); break;
                    case 5: tile_bf16(5, panel, p1 - p0, xr, xs, p0, ar, first); break;
                    case 4: tile_bf16(4, panel, p1 - p0, xr, xs, p0, ar, first); break;
                    case 3: tile_bf16(3, panel, p1 - p0, xr, xs, p0, ar, first); break;
                    case 2: tile_bf16(2, panel, p1 - p0, xr, xs, p0, ar, first); break;
                    default: tile_bf16(1, panel, p1 - p0, xr, xs, p0, ar, first); break;
                    }
                }
            }
            store_rows(&w, acc, 0, M, 32 * t, N, out, os, out_f32);
        }
        free(acc);
    }
}

void qgemm_bf16(const uint16_t *x, int64_t M, int64_t xs, const uint8_t *q, const uint16_t *s,
                const uint16_t *z, int bits, int group, int64_t N, int64_t K, void *out, int64_t os,
                int out_f32) {
    const qweight w = {q, s, z, bits, group, K, N, NULL, M};
    qgemm_bf16_w(&w, x, M, xs, out, os, out_f32);
}

/* Greedy ids of x W^T without storing it (an LM head's [M, vocab] float32 logits are written and read
 * back otherwise: 12.6 MB at batch 64): ids[m] is torch's argmax of row m of the float32 outputs
 * qgemm_bf16 would store, that is the same sums, picked per tile (pick_rows) and merged here in column
 * order, every thread's columns being one contiguous run after the previous thread's. */
void qgemm_bf16_argmax_desc(const qdesc *d, const uint16_t *x, int64_t M, int64_t xs, int64_t *ids) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    argmax_pick *best = malloc(sizeof(argmax_pick) * (size_t)(threads * M));
    for (int64_t i = 0; i < threads * M; i++) best[i] = ARGMAX_NONE;
    const qweight w = {d->q, d->s, d->z, d->bits, d->group, d->K, d->N, best, M};
    qgemm_bf16_w(&w, x, M, xs, NULL, 0, 1);
    for (int64_t m = 0; m < M; m++) {
        argmax_pick row = ARGMAX_NONE;
        for (int t = 0; t < threads; t++) argmax_fold(&row, best[(int64_t)t * M + m]);
        ids[m] = row.at;
    }
    free(best);
}
#else
void qgemm_bf16(const uint16_t *x, int64_t M, int64_t xs, const uint8_t *q, const uint16_t *s,
                const uint16_t *z, int bits, int group, int64_t N, int64_t K, void *out, int64_t os,
                int out_f32) {
    abort(); /* the caller checks qlinear_available() first */
}
void qgemm_bf16_argmax_desc(const qdesc *d, const uint16_t *x, int64_t M, int64_t xs, int64_t *ids) { abort(); }
#endif

#if !QL_AMX
void kernels_set_amx(int on) { (void)on; }
int kernels_amx_ready(void) { return 0; }
#endif

#if QL_F32
#define KCP32 64
#define MT32 6
#define MB32 512

/* One cell as four 8-lane fp32 vectors: rows 0-3, 4-7 (B halves), 8-11, 12-15 (A halves). */
/* Pair p of a block as four 8-lane fp32 vectors: rows 0-3, 4-7 (B halves), 8-11, 12-15 (A halves). */
/* Eight int8 weights (a quarter of an int8 cell: rows 4j..4j+3, both columns) as fp32, exactly. */
static inline __m256 int8_quarter(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline void cell256(const uint8_t *cells, int64_t p, int bits, __m256 v[4]) {
    const uint8_t *cell = cell_at(cells, p, bits);
    __m128i shift = _mm_cvtsi32_si128(4 * (int)(p & 1));
    for (int j = 0; j < 4; j++) {
        if (bits == 4) {
            __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cell + 8 * j)));
            v[j] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(q, shift), _mm256_set1_epi32(15)));
        } else {
            v[j] = int8_quarter(cell + 8 * j);
        }
    }
}

static inline void group256(const uint16_t *v, __m256 out[4]) {
    const __m256i idx = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    for (int j = 0; j < 4; j++) {
        /* rows 4j'..: quarter j of the block is rows 4j..4j+3 in B/A order 0-3, 4-7, 8-11, 12-15 */
        __m128 quarter = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(v + 4 * j)));
        out[j] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(quarter), idx);
    }
}

typedef struct {
    const uint8_t *q;
    const uint16_t *s, *z;
    int bits, group;
    int64_t K, N;
} qweight32;

static void deq_block_f32(const qweight32 *w, int64_t blk, int64_t p0, int64_t p1, __m256 *dst) {
    int64_t groups = w->K / w->group, cb = cell_bytes(w->bits);
    const uint8_t *cells = w->q + blk * (w->K / 2) * cb;
    __m256 sc[4], zc[4];
    for (int j = 0; j < 4; j++) sc[j] = zc[j] = _mm256_setzero_ps();
    int64_t gp = w->group / 2;
    for (int64_t p = p0; p < p1;) {
        int64_t g = p / gp, end = (g + 1) * gp < p1 ? (g + 1) * gp : p1;
        group256(w->s + (blk * groups + g) * 16, sc);
        if (w->z) group256(w->z + (blk * groups + g) * 16, zc);
        for (; p < end; p++) {
            __m256 v[4];
            cell256(cells, p, w->bits, v);
            for (int j = 0; j < 4; j++) dst[(p - p0) * 4 + j] = _mm256_fmadd_ps(v[j], sc[j], zc[j]);
        }
    }
}

/* mt (up to MT32) rows over np pairs of the panel: 4 to 6 rows take half a block (two of its four
 * vectors) at a time, so that 12 accumulators, the two weight vectors and one broadcast fill the 16
 * registers, as an AVX2 SGEMM's 6 x 16 kernel does; 1 to 3 rows take the whole block in one pass. Each
 * lane's sum takes its products in the same order whatever mt is. */
static inline __attribute__((always_inline)) void tile_f32(int mt, const __m256 *panel, int64_t np,
                                                           const float *x, int64_t xs, int64_t p0,
                                                           float *acc_io, int first) {
    const int jw = mt <= 3 ? 4 : 2; /* vectors per pass: mt * jw accumulators, at most 12 */
    for (int h = 0; h < 4; h += jw) {
        __m256 acc[MT32][4];
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < jw; j++)
                acc[i][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_io + i * 32 + 8 * (h + j));
        for (int64_t p = 0; p < np; p++) {
            for (int i = 0; i < mt; i++) {
                __m256 xp = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(x + i * xs + 2 * (p0 + p))));
                for (int j = 0; j < jw; j++) acc[i][j] = _mm256_fmadd_ps(panel[4 * p + h + j], xp, acc[i][j]);
            }
        }
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < jw; j++) _mm256_storeu_ps(acc_io + i * 32 + 8 * (h + j), acc[i][j]);
    }
}

/* tile_f32 with its row count a constant, so that its accumulators stay in registers. */
static void tile_rows_f32(int mt, const __m256 *panel, int64_t np, const float *x, int64_t xs, int64_t p0,
                          float *acc_io, int first) {
    switch (mt) {
    case 6: tile_f32(6, panel, np, x, xs, p0, acc_io, first); break;
    case 5: tile_f32(5, panel, np, x, xs, p0, acc_io, first); break;
    case 4: tile_f32(4, panel, np, x, xs, p0, acc_io, first); break;
    case 3: tile_f32(3, panel, np, x, xs, p0, acc_io, first); break;
    case 2: tile_f32(2, panel, np, x, xs, p0, acc_io, first); break;
    default: tile_f32(1, panel, np, x, xs, p0, acc_io, first); break;
    }
}

/* Pair sums of a tile row's 32 accumulators -> the 16 row outputs. */
static inline void finish_row(const float *acc, float *dst16) {
    __m256 lo = _mm256_hadd_ps(_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8));
    __m256 hi = _mm256_hadd_ps(_mm256_loadu_ps(acc + 16), _mm256_loadu_ps(acc + 24));
    _mm256_storeu_ps(dst16, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(lo), 0xD8)));
    _mm256_storeu_ps(dst16 + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(hi), 0xD8)));
}

/* Block blk's outputs for M rows (each row's 32 accumulators at acc + 32 i) into out, rows past N left. */
static inline void store_block(const float *acc, int64_t M, int64_t blk, int64_t N, float *out, int64_t os) {
    int64_t rows = N - 16 * blk < 16 ? N - 16 * blk : 16;
    for (int64_t i = 0; i < M; i++) {
        float row[16];
        finish_row(acc + i * 32, row);
        memcpy(out + i * os + 16 * blk, row, rows * sizeof(float));
    }
}

/* Up to MV32 activation rows (decode steps) straight from the cells, as qgemv_bf16 does: per group,
 * the integer weights (exact in fp32) times x, then the group's scale and zero once. The panel path's
 * dequantize-store-reload costs as much as its multiply-adds at a few rows; here an int4 double cell's
 * bytes are widened once for both of its pairs and every row. A pass covers JW of a block's four
 * quarters (rows 4j..4j+3) so that MT * JW accumulators fit the 16 registers; one row keeps even and
 * odd pairs in separate chains, for the FMA latency. On an AVX2 EPYC (Zen 2) this is 1.75x / 1.5x /
 * 1.2x faster than the panel path at 1 / 2 / 3 rows (int4; int8 1.25x to 1.1x) and level from 4. */
#define MV32 3
static inline __attribute__((always_inline)) void gemv32_tile(int mt, int jw, const qweight32 *w, int64_t blk,
                                                              const float *x, int64_t xs, const float *xsum,
                                                              float *acc_out) {
    int64_t groups = w->K / w->group, gp = w->group / 2, cb = cell_bytes(w->bits);
    const uint8_t *cells = w->q + blk * (w->K / 2) * cb;
    int split = mt == 1;
    for (int j0 = 0; j0 < 4; j0 += jw) {
        __m256 acc[MV32][4];
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < jw; j++) acc[i][j] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256 d[MV32][4], e[4];
            for (int j = 0; j < jw; j++) {
                e[j] = _mm256_setzero_ps();
                for (int i = 0; i < mt; i++) d[i][j] = _mm256_setzero_ps();
            }
            int64_t p = g * gp, end = p + gp; /* int4: p even, gp even (the group holds whole double cells) */
            for (; p + 1 < end; p += 2) {
                for (int j = 0; j < jw; j++) {
                    __m256 we, wo;
                    if (w->bits == 4) {
                        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cells + (p >> 1) * 32 + 8 * (j0 + j))));
                        we = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
                        wo = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                    } else {
                        we = int8_quarter(cells + p * 32 + 8 * (j0 + j));
                        wo = int8_quarter(cells + (p + 1) * 32 + 8 * (j0 + j));
                    }
                    for (int i = 0; i < mt; i++) {
                        const double *xp = (const double *)(x + i * xs + 2 * p);
                        d[i][j] = _mm256_fmadd_ps(we, _mm256_castpd_ps(_mm256_broadcast_sd(xp)), d[i][j]);
                        if (split)
                            e[j] = _mm256_fmadd_ps(wo, _mm256_castpd_ps(_mm256_broadcast_sd(xp + 1)), e[j]);
                        else
                            d[i][j] = _mm256_fmadd_ps(wo, _mm256_castpd_ps(_mm256_broadcast_sd(xp + 1)), d[i][j]);
                    }
                }
            }
            for (; p < end; p++) /* int8 groups of an odd number of pairs */
                for (int j = 0; j < jw; j++) {
                    __m256 we = int8_quarter(cells + p * 32 + 8 * (j0 + j));
                    for (int i = 0; i < mt; i++)
                        d[i][j] = _mm256_fmadd_ps(we, _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(x + i * xs + 2 * p))), d[i][j]);
                }
            __m256 sc[4], zc[4];
            group256(w->s + (blk * groups + g) * 16, sc);
            if (w->z) group256(w->z + (blk * groups + g) * 16, zc);
            for (int i = 0; i < mt; i++) {
                const __m256 xsg = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(xsum + (i * groups + g) * 2)));
                for (int j = 0; j < jw; j++) {
                    __m256 dot = split ? _mm256_add_ps(d[i][j], e[j]) : d[i][j];
                    acc[i][j] = _mm256_fmadd_ps(sc[j0 + j], dot, acc[i][j]);
                    if (w->z) acc[i][j] = _mm256_fmadd_ps(zc[j0 + j], xsg, acc[i][j]);
                }
            }
        }
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < jw; j++) _mm256_storeu_ps(acc_out + i * 32 + 8 * (j0 + j), acc[i][j]);
    }
}

static void qgemv_f32(const qweight32 *w, const float *x, int64_t M, int64_t xs, float *out, int64_t os) {
    int64_t groups = w->K / w->group, nblocks = (w->N + 15) / 16;
    /* Per row and group: the sums of its even and odd columns, for the zeros. */
    float *xsum = malloc(sizeof(float) * 2 * groups * M);
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < groups; g++) {
            float e = 0.f, o = 0.f;
            for (int64_t k = g * w->group; k < (g + 1) * w->group; k += 2) e += x[i * xs + k], o += x[i * xs + k + 1];
            xsum[(i * groups + g) * 2] = e, xsum[(i * groups + g) * 2 + 1] = o;
        }
    _Pragma("omp parallel for schedule(static)") for (int64_t blk = 0; blk < nblocks; blk++) {
        float acc[MV32 * 32];
        switch (M) {
        case 3: gemv32_tile(3, 2, w, blk, x, xs, xsum, acc); break;
        case 2: gemv32_tile(2, 4, w, blk, x, xs, xsum, acc); break;
        default: gemv32_tile(1, 4, w, blk, x, xs, xsum, acc); break;
        }
        store_block(acc, M, blk, w->N, out, os);
    }
    free(xsum);
}

/* The panel path over M rows: per 16-row block, chunks of KCP32 pairs dequantized into an L1 panel that
 * every row runs over in tiles of up to MT32. */
static void panel_f32(const qweight32 *w, const float *x, int64_t M, int64_t xs, float *out, int64_t os) {
    int64_t nblocks = (w->N + 15) / 16, pairs = w->K / 2;
    _Pragma("omp parallel") {
        __m256 panel[KCP32 * 4] __attribute__((aligned(64)));
        float *acc = aligned_alloc(64, ((M * 32 * sizeof(float) + 63) / 64) * 64);
        _Pragma("omp for schedule(static)") for (int64_t blk = 0; blk < nblocks; blk++) {
            for (int64_t p0 = 0; p0 < pairs; p0 += KCP32) {
                int64_t p1 = p0 + KCP32 < pairs ? p0 + KCP32 : pairs;
                deq_block_f32(w, blk, p0, p1, panel);
                for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
                    /* 4 rows left: two tiles of 2 over whole blocks measured faster than 4 over halves */
                    mt = M - m0 < MT32 ? (M - m0 == 4 ? 2 : M - m0) : MT32;
                    tile_rows_f32((int)mt, panel, p1 - p0, x + m0 * xs, xs, p0, acc + m0 * 32, p0 == 0);
                }
            }
            store_block(acc, M, blk, w->N, out, os);
        }
        free(acc);
    }
}

void qgemm_f32(const float *x, int64_t M, int64_t xs, const uint8_t *q, const uint16_t *s, const uint16_t *z,
               int bits, int group, int64_t N, int64_t K, float *out, int64_t os) {
    qweight32 w = {q, s, z, bits, group, K, N};
    if (M <= MV32 && !batch_invariant) {
        qgemv_f32(&w, x, M, xs, out, os);
        return;
    }
    /* Pieces of MB32 rows, each over the whole weight: a block's panel is dequantized once a piece,
     * and the piece's activations stay in L2 while every block runs over them (all of a 2048-row
     * prefill chunk, 4.7 MB at K = 576, came from L3 once a block). A row's sums are the same in any
     * piece. Zen 3, 2 threads: 1.13x at 1024 rows, 1.15-1.32x at 2048; below 1024 a smaller piece
     * measured slower. */
    for (int64_t m0 = 0; m0 < M; m0 += MB32)
        panel_f32(&w, x + m0 * xs, M - m0 < MB32 ? M - m0 : MB32, xs, out + m0 * os, os);
}

/* Rows [n0, n1) of the weight (n0 a multiple of 16), dequantized into a dense row-major fp32 [n1 - n0, K]:
 * for many activation rows the caller multiplies that with torch's GEMM, which outruns the panel path
 * above on most CPUs once M is large (tokenos/layers/quantization.py chooses where). Four pairs of a
 * block quarter (rows 4j..4j+3, eight columns) are a 4x4 transpose of 64-bit column pairs. */
static inline void store_pairs(const __m256 *v, int64_t stride, float *dst, int rows) {
    __m256d t0 = _mm256_unpacklo_pd(_mm256_castps_pd(v[0]), _mm256_castps_pd(v[4]));
    __m256d t1 = _mm256_unpackhi_pd(_mm256_castps_pd(v[0]), _mm256_castps_pd(v[4]));
    __m256d t2 = _mm256_unpacklo_pd(_mm256_castps_pd(v[8]), _mm256_castps_pd(v[12]));
    __m256d t3 = _mm256_unpackhi_pd(_mm256_castps_pd(v[8]), _mm256_castps_pd(v[12]));
    __m256d r[4] = {_mm256_permute2f128_pd(t0, t2, 0x20), _mm256_permute2f128_pd(t1, t3, 0x20),
                    _mm256_permute2f128_pd(t0, t2, 0x31), _mm256_permute2f128_pd(t1, t3, 0x31)};
    for (int i = 0; i < rows; i++) _mm256_storeu_pd((double *)(dst + i * stride), r[i]);
}

void qdequant_f32_desc(const qdesc *d, int64_t n0, int64_t n1, float *out) {
    qweight32 w = {d->q, d->s, d->z, d->bits, d->group, d->K, d->N};
    int64_t K = w.K, pairs = K / 2, b0 = n0 / 16, b1 = (n1 + 15) / 16;
    _Pragma("omp parallel") {
        __m256 panel[KCP32 * 4] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)") for (int64_t blk = b0; blk < b1; blk++) {
            for (int64_t p0 = 0; p0 < pairs; p0 += KCP32) {
                int64_t p1 = p0 + KCP32 < pairs ? p0 + KCP32 : pairs;
                deq_block_f32(&w, blk, p0, p1, panel);
                for (int j = 0; j < 4; j++) {
                    int64_t r0 = 16 * blk + 4 * j;
                    int rows = n1 - r0 >= 4 ? 4 : n1 - r0 > 0 ? (int)(n1 - r0) : 0;
                    float *dst = out + (r0 - n0) * K;
                    int64_t p = p0;
                    for (; p + 4 <= p1; p += 4) store_pairs(panel + (p - p0) * 4 + j, K, dst + 2 * p, rows);
                    for (; p < p1; p++) {
                        const double *v = (const double *)(panel + (p - p0) * 4 + j);
                        for (int i = 0; i < rows; i++) memcpy(dst + i * K + 2 * p, v + i, 8);
                    }
                }
            }
        }
    }
}

/* Rows ids[0 .. n) of the weight, dequantized (an embedding lookup) into out [n, K]: float32, or bf16
 * rounded to nearest even (out_bf16), exactly QuantizedWeight.rows' values: q * s is exact in float32
 * (an 8-bit integer times an fp16), so q * s + z rounds once whether fused or not. Row r of block b is
 * byte 16 * (r % 16 / 8) + 2 * (r % 8) + t of each cell (t: the pair's column); an int4 double cell
 * holds pair 2j in its low nibbles, 2j + 1 in its high ones. Returns 1, writing nothing, where an id is
 * not a row. */
int qrows_desc(const qdesc *d, const int64_t *ids, int64_t n, void *out, int out_bf16) {
    const int64_t K = d->K, groups = K / d->group, pairs = K / 2, cb = cell_bytes(d->bits);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= d->N) return 1; /* the caller raises; nothing read out of bounds */
    _Pragma("omp parallel for schedule(static) if (n >= 64)")
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = ids[i], blk = row / 16, lane = row % 16, at = 16 * (lane / 8) + 2 * (lane % 8);
        const uint8_t *cells = d->q + blk * pairs * cb;
        const uint16_t *s = d->s + blk * groups * 16 + lane, *z = d->z ? d->z + blk * groups * 16 + lane : NULL;
        float *of = (float *)out + i * K;
        uint16_t *ob = (uint16_t *)out + i * K;
        const int64_t gp = d->group / 2; /* pairs per group (the kernels' groups hold whole pairs) */
        for (int64_t g = 0; g < groups; g++) {
            const float sc = _cvtsh_ss(s[g * 16]), zc = z ? _cvtsh_ss(z[g * 16]) : 0.0f;
            for (int64_t p = g * gp; p < (g + 1) * gp; p++) {
                const uint8_t *c = cell_at(cells, p, d->bits) + at;
                const int shift = 4 * (int)(p & 1);
                for (int t = 0; t < 2; t++) {
                    const float q = d->bits == 4 ? (float)((c[t] >> shift) & 15) : (float)(int8_t)c[t];
                    float w = q * sc;
                    if (z) w += zc;
                    if (out_bf16)
                        ob[2 * p + t] = f32_to_bf16(w);
                    else
                        of[2 * p + t] = w;
                }
            }
        }
    }
    return 0;
}

#else
void qgemm_f32(const float *x, int64_t M, int64_t xs, const uint8_t *q, const uint16_t *s, const uint16_t *z,
               int bits, int group, int64_t N, int64_t K, float *out, int64_t os) {
    abort();
}
void qdequant_f32_desc(const qdesc *d, int64_t n0, int64_t n1, float *out) { abort(); }
int qrows_desc(const qdesc *d, const int64_t *ids, int64_t n, void *out, int out_bf16) { abort(); }
#endif

void qgemm_bf16(const uint16_t *x, int64_t M, int64_t xs, const uint8_t *q, const uint16_t *s,
                const uint16_t *z, int bits, int group, int64_t N, int64_t K, void *out, int64_t os,
                int out_f32);
void qgemm_f32(const float *x, int64_t M, int64_t xs, const uint8_t *q, const uint16_t *s, const uint16_t *z,
               int bits, int group, int64_t N, int64_t K, float *out, int64_t os);

void qgemm_bf16_desc(const qdesc *w, const uint16_t *x, int64_t M, int64_t xs, void *out, int64_t os,
                     int out_f32) {
    qgemm_bf16(x, M, xs, w->q, w->s, w->z, w->bits, w->group, w->N, w->K, out, os, out_f32);
}

void qgemm_f32_desc(const qdesc *w, const float *x, int64_t M, int64_t xs, float *out, int64_t os) {
    qgemm_f32(x, M, xs, w->q, w->s, w->z, w->bits, w->group, w->N, w->K, out, os);
}

