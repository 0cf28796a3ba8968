/* Multi-LoRA: every adapter's delta over its contiguous segment of a step's tokens, in one call.
 *
 *   y[i, off_p : off_p + size_p] += sum_r t[i, r0_p + r] * bt_p[r, :]    for each piece p
 *   with t[i, :] = A x[i, :]                                              (A: [R, K], rows contiguous)
 *
 * A fused linear (q/k/v, gate/up) has one piece per adapted shard: its rank rows of t, its output
 * columns, its scaled B^T [rows, size] without the zeros a block-diagonal B^T would carry. In torch this
 * is two matmuls of a few tens of columns each, whose dispatch (20-80 us apiece on a small shape) is
 * most of the cost at decode sizes; here it is one pass per block of 4 tokens, accumulated in float32
 * (bf16 shrinks by vdpbf16ps where the CPU has AVX512-BF16; the expand in AVX-512 registers, 32 columns
 * at a time; plain C, vectorized by the compiler, elsewhere), the result rounded once into y. Blocks run
 * in parallel; A and B^T stay in cache across a segment's tokens. */
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

typedef uint16_t bf16;

#define LORA_MAX_RANK 1536 /* the most t entries a linear may have: 3 shards of rank 512 */
#define LORA_TILE 32       /* output columns held in registers at once */

struct lora_piece {
    int64_t offset, size; /* output columns */
    int32_t r0, rows;     /* rows of t */
    const void *bt;       /* [rows, size] */
};

struct lora_desc {
    const void *a; /* [rank, K] */
    int32_t rank, num_pieces;
    int64_t K;
    struct lora_piece pieces[3];
};

static inline float ld_f32(const float *p, int64_t i) { return p[i]; }
static inline float ld_bf16(const bf16 *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void st_f32(float *p, int64_t i, float f) { p[i] = f; }
static inline void st_bf16(bf16 *p, int64_t i, float f) { p[i] = f32_to_bf16(f); }

#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 vld_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 vld_bf16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* 32 output columns of a block of 4 tokens: the 8 accumulators stay in registers over every row of B^T. */
#define DEFINE_EXPAND32(NAME, T, VLD)                                                               \
static inline void NAME(const float t[][LORA_MAX_RANK], const struct lora_piece *p, const T *bt,     \
                        int64_t c0, float acc[4][32]) {                                             \
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;                              \
    __m512 a20 = a00, a21 = a00, a30 = a00, a31 = a00;                                              \
    for (int r = 0; r < p->rows; r++) {                                                             \
        const T *row = bt + (int64_t)r * p->size + c0;                                              \
        const __m512 b0 = VLD(row), b1 = VLD(row + 16);                                             \
        const int q = p->r0 + r;                                                                    \
        const __m512 k0 = _mm512_set1_ps(t[0][q]), k1 = _mm512_set1_ps(t[1][q]);                    \
        const __m512 k2 = _mm512_set1_ps(t[2][q]), k3 = _mm512_set1_ps(t[3][q]);                    \
        a00 = _mm512_fmadd_ps(k0, b0, a00), a01 = _mm512_fmadd_ps(k0, b1, a01);                     \
        a10 = _mm512_fmadd_ps(k1, b0, a10), a11 = _mm512_fmadd_ps(k1, b1, a11);                     \
        a20 = _mm512_fmadd_ps(k2, b0, a20), a21 = _mm512_fmadd_ps(k2, b1, a21);                     \
        a30 = _mm512_fmadd_ps(k3, b0, a30), a31 = _mm512_fmadd_ps(k3, b1, a31);                     \
    }                                                                                               \
    _mm512_storeu_ps(acc[0], a00), _mm512_storeu_ps(acc[0] + 16, a01);                              \
    _mm512_storeu_ps(acc[1], a10), _mm512_storeu_ps(acc[1] + 16, a11);                              \
    _mm512_storeu_ps(acc[2], a20), _mm512_storeu_ps(acc[2] + 16, a21);                              \
    _mm512_storeu_ps(acc[3], a30), _mm512_storeu_ps(acc[3] + 16, a31);                              \
}
DEFINE_EXPAND32(expand32_f32, float, vld_f32)
DEFINE_EXPAND32(expand32_bf16, bf16, vld_bf16)
#define HAVE_EXPAND32 1
#else
#define HAVE_EXPAND32 0
#endif

/* Tokens go in blocks of LORA_BLOCK: each row of A and of B^T is loaded once per block, not per token. */
#define LORA_BLOCK 4

#define DEFINE_SHRINK(NAME, T, LD)                                                                  \
static __attribute__((unused)) void NAME(const T *x, int64_t x_stride, int nb,                   \
                                         const struct lora_desc *d, float t[LORA_BLOCK][LORA_MAX_RANK]) { \
    const T *a = (const T *)d->a;                                                                  \
    const T *x0 = x, *x1 = x + (nb > 1) * x_stride, *x2 = x + (nb > 2) * 2 * x_stride;            \
    const T *x3 = x + (nb > 3) * 3 * x_stride;                                                     \
    for (int r = 0; r < d->rank; r++) {                                                            \
        const T *ar = a + (int64_t)r * d->K;                                                       \
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;                                              \
        _Pragma("omp simd reduction(+ : s0, s1, s2, s3)")                                          \
        for (int64_t k = 0; k < d->K; k++) {                                                       \
            const float w = LD(ar, k);                                                             \
            s0 += LD(x0, k) * w;                                                                   \
            s1 += LD(x1, k) * w;                                                                   \
            s2 += LD(x2, k) * w;                                                                   \
            s3 += LD(x3, k) * w;                                                                   \
        }                                                                                          \
        t[0][r] = s0, t[1][r] = s1, t[2][r] = s2, t[3][r] = s3;                                    \
    }                                                                                              \
}

DEFINE_SHRINK(shrink_f32, float, ld_f32)
DEFINE_SHRINK(shrink_bf16_generic, bf16, ld_bf16)

#ifdef __AVX512BF16__
/* bf16 pairs straight into vdpbf16ps: 32 multiply-adds per instruction, no widening. */
static void shrink_bf16(const bf16 *x, int64_t x_stride, int nb, const struct lora_desc *d,
                        float t[LORA_BLOCK][LORA_MAX_RANK]) {
    const bf16 *a = (const bf16 *)d->a;
    const bf16 *xs[LORA_BLOCK];
    for (int j = 0; j < LORA_BLOCK; j++) xs[j] = x + (j < nb ? j : 0) * x_stride;
    for (int r = 0; r < d->rank; r++) {
        const bf16 *ar = a + (int64_t)r * d->K;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t k = 0; k < d->K; k += 32) {
            const __mmask32 m = d->K - k >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (d->K - k)) - 1);
            const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(m, ar + k);
            s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_maskz_loadu_epi16(m, xs[0] + k), w);
            s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_maskz_loadu_epi16(m, xs[1] + k), w);
            s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_maskz_loadu_epi16(m, xs[2] + k), w);
            s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_maskz_loadu_epi16(m, xs[3] + k), w);
        }
        t[0][r] = _mm512_reduce_add_ps(s0), t[1][r] = _mm512_reduce_add_ps(s1); /* unused rows: never stored */
        t[2][r] = _mm512_reduce_add_ps(s2), t[3][r] = _mm512_reduce_add_ps(s3);
    }
}
#else
#define shrink_bf16 shrink_bf16_generic
#endif

#define DEFINE_LORA(NAME, T, LD, ST, SHRINK)                                                                \
static void NAME##_expand(float t[LORA_BLOCK][LORA_MAX_RANK], int nb, const struct lora_piece *p,  \
                          T *y, int64_t y_stride) {                                                \
    const T *bt = (const T *)p->bt;                                                                \
    T *out = y + p->offset;                                                                        \
    for (int64_t c0 = 0; c0 < p->size; c0 += LORA_TILE) {                                          \
        const int n = p->size - c0 < LORA_TILE ? (int)(p->size - c0) : LORA_TILE;                  \
        float acc[LORA_BLOCK][LORA_TILE] = {{0}};                                                  \
        if (HAVE_EXPAND32 && n == LORA_TILE) {                                                     \
            NAME##_expand32(t, p, bt, c0, acc);                                                    \
        } else {                                                                                   \
            for (int r = 0; r < p->rows; r++) {                                                    \
                const T *row = bt + (int64_t)r * p->size + c0;                                     \
                for (int j = 0; j < LORA_BLOCK; j++) {                                             \
                    const float k = t[j][p->r0 + r];                                               \
                    for (int c = 0; c < n; c++) acc[j][c] += k * LD(row, c);                       \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int j = 0; j < nb; j++) {                                                             \
            T *o = out + j * y_stride + c0;                                                        \
            for (int c = 0; c < n; c++) ST(o, c, LD(o, c) + acc[j][c]);                            \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* Every segment of the step in one call (one parallel region, not one per adapter): segment s is    \
 * tokens [starts[s], ends[s]) under descs[s] (NULL: this linear has no piece of that adapter). */  \
void NAME(const T *x, int64_t x_stride, T *y, int64_t y_stride, int num_segments,                  \
          const int64_t *starts, const int64_t *ends, const struct lora_desc *const *descs) {      \
    int64_t first[num_segments + 1]; /* the flat index of each segment's first block */            \
    first[0] = 0;                                                                                  \
    for (int s = 0; s < num_segments; s++) {                                                       \
        const int64_t n = descs[s] ? ends[s] - starts[s] : 0;                                      \
        first[s + 1] = first[s] + (n + LORA_BLOCK - 1) / LORA_BLOCK;                               \
    }                                                                                              \
    const int64_t blocks = first[num_segments];                                                    \
    _Pragma("omp parallel for schedule(static) if (blocks > 1)")                                   \
    for (int64_t b = 0; b < blocks; b++) {                                                         \
        int s = 0;                                                                                 \
        while (first[s + 1] <= b) s++;                                                             \
        const struct lora_desc *d = descs[s];                                                      \
        const int64_t i = starts[s] + (b - first[s]) * LORA_BLOCK;                                 \
        const int nb = ends[s] - i < LORA_BLOCK ? (int)(ends[s] - i) : LORA_BLOCK;                 \
        float t[LORA_BLOCK][LORA_MAX_RANK];                                                        \
        /* a short block repeats its first row: its extra sums are computed, never stored */        \
        SHRINK(x + i * x_stride, x_stride, nb, d, t);                                       \
        for (int p = 0; p < d->num_pieces; p++)                                                    \
            NAME##_expand(t, nb, &d->pieces[p], y + i * y_stride, y_stride);                       \
    }                                                                                              \
}

#if !HAVE_EXPAND32 /* never called: the generic loop runs instead */
#define expand32_f32(t, p, bt, c0, acc) ((void)0)
#define expand32_bf16(t, p, bt, c0, acc) ((void)0)
#endif
#define lora_apply_f32_expand32 expand32_f32
#define lora_apply_bf16_expand32 expand32_bf16
DEFINE_LORA(lora_apply_f32, float, ld_f32, st_f32, shrink_f32)
DEFINE_LORA(lora_apply_bf16, bf16, ld_bf16, st_bf16, shrink_bf16)

int lora_max_rank(void) { return LORA_MAX_RANK; }
