/* Multi-LoRA: every adapter's delta over its contiguous segment of a step's tokens, in one call.
 *
 *   y[i, off_p : off_p + size_p] += sum_r t[i, r0_p + r] * bt_p[r, :]    for each piece p
 *   with t[i, :] = A x[i, :]                                              (A: [R, K], rows contiguous)
 *
 * A fused linear (q/k/v, gate/up) has one piece per adapted shard: its rank rows of t, its output
 * columns, its scaled B^T [rows, size] without the zeros a block-diagonal B^T would carry. In torch this
 * is two matmuls of a few tens of columns each, whose dispatch (20-80 us apiece on a small shape) is
 * most of the cost at decode sizes; here it is one pass per block of tokens, in float32, the result
 * rounded once into y. Blocks run in parallel; A and B^T stay in cache across a segment's tokens. */
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

typedef uint16_t bf16;

#define LORA_MAX_RANK 1536 /* the most t entries a linear may have: 3 shards of rank 512 */
#define LORA_TILE 16       /* output columns held in registers at once */

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

/* Tokens go in blocks of LORA_BLOCK: each row of A and of B^T is loaded once per block, not per token. */
#define LORA_BLOCK 4

#define DEFINE_LORA(NAME, T, LD, ST)                                                                \
static void NAME##_shrink(const T *x, int64_t x_stride, int nb, const struct lora_desc *d,        \
                          float t[LORA_BLOCK][LORA_MAX_RANK]) {                                    \
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
}                                                                                                  \
                                                                                                   \
static void NAME##_expand(float t[LORA_BLOCK][LORA_MAX_RANK], int nb, const struct lora_piece *p,  \
                          T *y, int64_t y_stride) {                                                \
    const T *bt = (const T *)p->bt;                                                                \
    T *out = y + p->offset;                                                                        \
    /* 16 columns at a time, the block's 4 accumulators in registers across every row of B^T */    \
    for (int64_t c0 = 0; c0 < p->size; c0 += LORA_TILE) {                                          \
        const int n = p->size - c0 < LORA_TILE ? (int)(p->size - c0) : LORA_TILE;                  \
        float a0[LORA_TILE] = {0}, a1[LORA_TILE] = {0}, a2[LORA_TILE] = {0}, a3[LORA_TILE] = {0}; \
        for (int r = 0; r < p->rows; r++) {                                                        \
            const T *row = bt + (int64_t)r * p->size + c0;                                         \
            const float k0 = t[0][p->r0 + r], k1 = t[1][p->r0 + r];                                \
            const float k2 = t[2][p->r0 + r], k3 = t[3][p->r0 + r];                                \
            if (n == LORA_TILE) {                                                                  \
                _Pragma("omp simd")                                                                \
                for (int c = 0; c < LORA_TILE; c++) {                                              \
                    const float b = LD(row, c);                                                    \
                    a0[c] += k0 * b, a1[c] += k1 * b, a2[c] += k2 * b, a3[c] += k3 * b;           \
                }                                                                                  \
            } else {                                                                               \
                for (int c = 0; c < n; c++) {                                                      \
                    const float b = LD(row, c);                                                    \
                    a0[c] += k0 * b, a1[c] += k1 * b, a2[c] += k2 * b, a3[c] += k3 * b;           \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        float *acc[LORA_BLOCK] = {a0, a1, a2, a3};                                                 \
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
        NAME##_shrink(x + i * x_stride, x_stride, nb, d, t);                                       \
        for (int p = 0; p < d->num_pieces; p++)                                                    \
            NAME##_expand(t, nb, &d->pieces[p], y + i * y_stride, y_stride);                       \
    }                                                                                              \
}

DEFINE_LORA(lora_apply_f32, float, ld_f32, st_f32)
DEFINE_LORA(lora_apply_bf16, bf16, ld_bf16, st_bf16)

int lora_max_rank(void) { return LORA_MAX_RANK; }
