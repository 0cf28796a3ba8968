/*
 * One Llama-style decoder layer of a decode-only step, in one call:
 *
 *   h = rms_norm(x + residual)            residual <- x + residual
 *   qkv = h Wqkv^T (+ b); rotary on q, k; this step's K, V into their page slots
 *   a = paged decode attention(q)         x <- rms_norm(a Wo^T + residual), residual <- the sum
 *   x = (silu(g) * u) Wdown^T             with [g, u] = x Wgate_up^T
 *
 * At decode sizes each of these is a few microseconds of arithmetic behind a Python call, a ctypes
 * conversion and a torch allocation; a layer's dozen of them cost about what its weights take to
 * read. Here the same kernels (step_ops.c, qlinear.c, paged_attention.c) run back to back from C, in
 * the order and with the roundings of the module path (tokenos/models/llama.py), so the result is
 * the same bit for bit: the module path stays the reference and the fallback.
 *
 * Weights are quantized (qlinear.c's packed layout; the caller checks its kernel exists for the
 * dtype), every token is one request's decode. x and residual are [n, hidden], updated in place;
 * `first` starts the residual stream (layer 0: residual = x). KV pages are the model's dtype, or 8-bit
 * (fp8 e4m3fn, int8) pages with per-layer scales that no later step changes: K and V written by
 * paged_attention.c's 8-bit write, the softmax scale times k_scale, the outputs times v_scale, as the
 * module path (tokenos/layers/attention.py) does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

typedef uint16_t bf16;

/* The kernels this layer runs, from the other translation units of the library. */
void rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *residual_out,
                  int64_t rows, int hidden, float eps);
void rms_norm_bf16(const bf16 *x, const bf16 *residual, const bf16 *weight, bf16 *out, bf16 *residual_out,
                   int64_t rows, int hidden, float eps);
void silu_and_mul_f32(const float *x, float *out, int64_t rows, int d);
void silu_and_mul_bf16(const bf16 *x, bf16 *out, int64_t rows, int d);
void rotary_f32_token(float *x, int heads, int head_dim, int half, const float *c, const float *s);
void rotary_bf16_token(bf16 *x, int heads, int head_dim, int half, const bf16 *c, const bf16 *s);
#define DECLARE_DECODE(NAME, T)                                                                    \
    void NAME(const float *q, const T *cache, int64_t page_stride, int block_size, const int32_t *block_table, \
              int max_blocks, const int32_t *seq_lens, int num_reqs, int num_heads, int num_kv_heads,    \
              int head_size, float scale, int window, float *out, float cap, const float *sinks,         \
              const int64_t *epochs);
DECLARE_DECODE(paged_decode_f32, float)
DECLARE_DECODE(paged_decode_bf16, bf16)
DECLARE_DECODE(paged_decode_fp8, uint8_t)
DECLARE_DECODE(paged_decode_int8, int8_t)
#define DECLARE_KV_WRITE(NAME, T)                                                                  \
    void NAME(const T *k, int64_t k_stride, const T *v, int64_t v_stride, int64_t n, int row, int8_t *flat, \
              const int64_t *rows, float sk, float sv);
DECLARE_KV_WRITE(kv_write_fp8_f32, float)
DECLARE_KV_WRITE(kv_write_fp8_bf16, bf16)
DECLARE_KV_WRITE(kv_write_int8_f32, float)
DECLARE_KV_WRITE(kv_write_int8_bf16, bf16)
void paged_prefill_bf16(const bf16 *q, int64_t q_stride, const void *cache, int kv_kind, int64_t page_stride,
                        int block_size, const int32_t *block_table, int max_blocks, const int32_t *chunks,
                        int num_chunks, int num_heads, int num_kv_heads, int head_size, float scale, int window,
                        bf16 *out, int64_t out_stride, float cap, const float *sinks, const int64_t *epochs);
int paged_prefill_supports(int num_heads, int num_kv_heads, int head_size);
int kernels_batch_invariant(void);
/* qlinear.c's entry points take its `qdesc`; only its address passes through here. */
void qgemm_f32_desc(const void *w, const float *x, int64_t M, int64_t xs, float *out, int64_t os);
void qgemm_bf16_desc(const void *w, const bf16 *x, int64_t M, int64_t xs, void *out, int64_t os, int out_f32);

/* A layer's weights, described once (tokenos/layers/fused_decode.py's LayerDesc). */
typedef struct {
    const void *qkv, *o, *gate_up, *down; /* qlinear.c qdesc addresses */
    const void *qkv_bias;                 /* [qkv width] in the dtype, or NULL */
    const void *ln1, *ln2;                /* RMSNorm weights [hidden] */
    void *kv_cache;                       /* this layer's pages [blocks, 2, block_size, kv_heads, head_dim] */
    int64_t page_stride;                  /* elements from one block to the next */
    float eps, scale;                     /* scale: the softmax scale, times k_scale on 8-bit pages */
    int32_t window, kv_kind;              /* kv_kind: KV_MODEL, KV_FP8 or KV_INT8 pages */
    float k_write, v_write;               /* 8-bit writes: fp8 k_scale / v_scale, int8 their reciprocals */
    float v_scale;                        /* 8-bit pages: the outputs' factor */
    int32_t _pad;
} layer_desc;

enum { KV_MODEL = 0, KV_FP8 = 1, KV_INT8 = 2 };

/* One step's shapes, indices and scratch, shared by every layer (fused_decode.py's StepDesc). */
typedef struct {
    int64_t n; /* decodes = tokens = requests */
    int32_t hidden, heads, kv_heads, head_dim, inter, rotary_dim, block_size, max_blocks;
    const int32_t *block_table; /* [n, max_blocks] */
    const int32_t *seq_lens;    /* [n], this token included */
    const int64_t *slots;       /* [n] block * block_size + offset of this token */
    const int64_t *epochs;      /* [num_blocks] page epochs for the packed-prefix cache, or NULL */
    const void *cos, *sin;      /* [n, rotary_dim / 2] in the dtype */
    void *h, *qkv, *attn, *gu, *act; /* [n, hidden], [n, qkv width], [n, heads * head_dim], [n, 2 inter], [n, inter] */
    float *qf, *of;                  /* float32 [n, heads * head_dim] */
} step_desc;

/* Decode attention over 8-bit pages (step and layer as decode_layer_* has them). */
static void decode_8bit(const layer_desc *L, const step_desc *S, const int8_t *cache) {
    const int n = (int)S->n, hd = S->head_dim;
    if (L->kv_kind == KV_FP8)
        paged_decode_fp8(S->qf, (const uint8_t *)cache, L->page_stride, S->block_size, S->block_table, S->max_blocks,
                         S->seq_lens, n, S->heads, S->kv_heads, hd, L->scale, L->window, S->of, 0.0f, NULL, S->epochs);
    else
        paged_decode_int8(S->qf, cache, L->page_stride, S->block_size, S->block_table, S->max_blocks, S->seq_lens, n,
                          S->heads, S->kv_heads, hd, L->scale, L->window, S->of, 0.0f, NULL, S->epochs);
}

/* Batch invariance (qlinear.c's kernels_batch_invariant): a step's tokens attend through the prefill
 * kernel, as the module path sends every query there (attention.py), so the fused and the module path
 * stay equal bit for bit and a token's attention does not depend on its step. Whether this step does
 * (bf16 with the prefill kernel; a float32 step keeps the decode kernel, invariant by its splits): */
static int invariant_attention_on_f32(const step_desc *S) { (void)S; return 0; }
static int invariant_attention_on_bf16(const step_desc *S) {
    return kernels_batch_invariant() && paged_prefill_supports(S->heads, S->kv_heads, S->head_dim);
}
/* The attention outputs into attn (only where invariant_attention_on_*). */
static void invariant_attention_f32(const layer_desc *L, const step_desc *S, float *qkv, float *attn) {
    (void)L, (void)S, (void)qkv, (void)attn;
}
static void invariant_attention_bf16(const layer_desc *L, const step_desc *S, bf16 *qkv, bf16 *attn) {
    const int n = (int)S->n, mb = S->max_blocks;
    const int64_t q_width = (int64_t)S->heads * S->head_dim, width = q_width + 2 * (int64_t)S->kv_heads * S->head_dim;
    /* A request's consecutive tokens (a decode and its drafts: the same pages, one position apart) are one
     * chunk, packed once; a query's arithmetic is the same in a chunk of one or of several. */
    int32_t *chunks = (int32_t *)malloc(sizeof(int32_t) * (3 + (size_t)mb) * (size_t)n), *table = chunks + 3 * n;
    int m = 0;
    for (int t = 0; t < n; t++) {
        const int32_t *row = S->block_table + (int64_t)t * mb;
        if (m > 0 && S->seq_lens[t] == S->seq_lens[t - 1] + 1
            && memcmp(row, table + (int64_t)(m - 1) * mb, sizeof(int32_t) * (size_t)mb) == 0) {
            chunks[3 * (m - 1) + 1]++;
            continue;
        }
        chunks[3 * m] = t, chunks[3 * m + 1] = 1, chunks[3 * m + 2] = S->seq_lens[t] - 1;
        memcpy(table + (int64_t)m * mb, row, sizeof(int32_t) * (size_t)mb);
        m++;
    }
    paged_prefill_bf16(qkv, width, L->kv_cache, L->kv_kind, L->page_stride, S->block_size, table, mb, chunks, m,
                       S->heads, S->kv_heads, S->head_dim, L->scale, L->window, attn, q_width, 0.0f, NULL,
                       S->epochs);
    free(chunks);
    if (L->kv_kind != KV_MODEL && L->v_scale != 1.0f) /* the module path's out.mul_(v_scale), in bf16 */
        for (int64_t j = 0; j < n * q_width; j++) attn[j] = f32_to_bf16(bf16_to_f32(attn[j]) * L->v_scale);
}

static inline float ld_f32(const float *p) { return *p; }
static inline float ld_bf16(const bf16 *p) { return bf16_to_f32(*p); }
static inline void st_f32(float *p, float f) { *p = f; }
static inline void st_bf16(bf16 *p, float f) { *p = f32_to_bf16(f); }

/* A row of n values as float32 (restrict, so the compiler vectorizes the widening). */
static void widen_f32(const float *restrict src, float *restrict dst, int64_t n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}
static void widen_bf16(const bf16 *restrict src, float *restrict dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* Tokens from which the per-token pass below is split over the threads. */
#define TOKENS_PARALLEL_MIN 8

static inline void qgemm_f32_call(const void *w, const float *x, int64_t M, int64_t xs, float *out, int64_t os) {
    qgemm_f32_desc(w, x, M, xs, out, os);
}
static inline void qgemm_bf16_call(const void *w, const bf16 *x, int64_t M, int64_t xs, bf16 *out, int64_t os) {
    qgemm_bf16_desc(w, x, M, xs, out, os, 0);
}

#define DEFINE_DECODE_LAYER(SUFFIX, T)                                                                   \
static void decode_layer_##SUFFIX(const layer_desc *L, const step_desc *S, T *x, T *residual, int first) {\
    const int64_t n = S->n, hidden = S->hidden, hd = S->head_dim;                                        \
    const int64_t q_width = (int64_t)S->heads * hd, kv_width = (int64_t)S->kv_heads * hd;                \
    const int64_t width = q_width + 2 * kv_width;                                                        \
    T *h = (T *)S->h, *qkv = (T *)S->qkv, *attn = (T *)S->attn, *gu = (T *)S->gu, *act = (T *)S->act;    \
    if (first) {                                                                                         \
        memcpy(residual, x, sizeof(T) * (size_t)(n * hidden));                                           \
        rms_norm_##SUFFIX(x, NULL, (const T *)L->ln1, h, NULL, n, (int)hidden, L->eps);                  \
    } else {                                                                                             \
        rms_norm_##SUFFIX(x, residual, (const T *)L->ln1, h, residual, n, (int)hidden, L->eps);          \
    }                                                                                                    \
    qgemm_##SUFFIX##_call(L->qkv, h, n, hidden, qkv, width);                                             \
    if (L->qkv_bias) { /* the module path's `out += bias`: one add, rounded */                          \
        const T *b = (const T *)L->qkv_bias;                                                             \
        for (int64_t t = 0; t < n; t++)                                                                  \
            for (int64_t j = 0; j < width; j++) st_##SUFFIX(qkv + t * width + j, ld_##SUFFIX(qkv + t * width + j) + ld_##SUFFIX(b + j)); \
    }                                                                                                    \
    /* Per token, in one pass: rotary on its q and k, its K and V rows into their page slots, its q      \
     * widened for the attention kernel. The qkv rows were just written by every thread (each its own    \
     * columns), so the threads share the rows here too rather than one thread pulling them all in.  */ \
    T *cache = (T *)L->kv_cache;                                                                         \
    const int invariant = invariant_attention_on_##SUFFIX(S);                                            \
    int8_t *bytes = (int8_t *)L->kv_cache;                                                               \
    const int64_t bs = S->block_size, half = S->rotary_dim / 2;                                          \
    _Pragma("omp parallel for schedule(static) if (n >= TOKENS_PARALLEL_MIN)")                           \
    for (int64_t t = 0; t < n; t++) {                                                                    \
        T *qt = qkv + t * width, *k = qt + q_width, *v = k + kv_width;                                   \
        const T *c = (const T *)S->cos + t * half, *sn = (const T *)S->sin + t * half;                   \
        rotary_##SUFFIX##_token(qt, S->heads, (int)hd, (int)half, c, sn);                                \
        rotary_##SUFFIX##_token(k, S->kv_heads, (int)hd, (int)half, c, sn);                              \
        const int64_t off = S->slots[t] % bs; /* K row at (block, 0, offset), V row at (block, 1, offset) */ \
        if (L->kv_kind == KV_MODEL) {                                                                    \
            T *page = cache + (S->slots[t] / bs) * L->page_stride;                                       \
            memcpy(page + off * kv_width, k, sizeof(T) * (size_t)kv_width);                              \
            memcpy(page + (bs + off) * kv_width, v, sizeof(T) * (size_t)kv_width);                       \
        } else { /* rows of the page seen as [2 * bs, kv_width] bytes */                                \
            const int64_t rows[2] = {off, bs + off};                                                     \
            int8_t *page = bytes + (S->slots[t] / bs) * L->page_stride;                                  \
            (L->kv_kind == KV_FP8 ? kv_write_fp8_##SUFFIX : kv_write_int8_##SUFFIX)(                     \
                k, 0, v, 0, 1, (int)kv_width, page, rows, L->k_write, L->v_write);                       \
        }                                                                                                \
        if (!invariant) widen_##SUFFIX(qt, S->qf + t * q_width, q_width); /* the decode kernel's q */    \
    }                                                                                                    \
    if (invariant) {                                                                                     \
        invariant_attention_##SUFFIX(L, S, qkv, attn);                                                   \
    } else {                                                                                             \
        if (L->kv_kind == KV_MODEL)                                                                      \
            paged_decode_##SUFFIX(S->qf, cache, L->page_stride, S->block_size, S->block_table,           \
                                  S->max_blocks, S->seq_lens, (int)n, S->heads, S->kv_heads, (int)hd,    \
                                  L->scale, L->window, S->of, 0.0f, NULL, S->epochs);                    \
        else                                                                                             \
            decode_8bit(L, S, bytes);                                                                    \
        if (L->kv_kind != KV_MODEL && L->v_scale != 1.0f) /* the module path's out.mul_(v_scale) */     \
            for (int64_t j = 0; j < n * q_width; j++) S->of[j] *= L->v_scale;                            \
        for (int64_t j = 0; j < n * q_width; j++) st_##SUFFIX(attn + j, S->of[j]);                       \
    }                                                                                                    \
    qgemm_##SUFFIX##_call(L->o, attn, n, q_width, h, hidden);                                            \
    rms_norm_##SUFFIX(h, residual, (const T *)L->ln2, h, residual, n, (int)hidden, L->eps);              \
    qgemm_##SUFFIX##_call(L->gate_up, h, n, hidden, gu, 2 * (int64_t)S->inter);                          \
    silu_and_mul_##SUFFIX(gu, act, n, S->inter);                                                         \
    qgemm_##SUFFIX##_call(L->down, act, n, S->inter, x, hidden);                                         \
}

DEFINE_DECODE_LAYER(f32, float)
DEFINE_DECODE_LAYER(bf16, bf16)

/* Every layer of a step in one call (layers[i] with the step of its KV-cache group, steps[i]): from
 * Python a call per layer cost about 15 us of ctypes and attribute lookups, 0.45 ms of a 7.6 ms
 * one-token step of a 30-layer model. */
#define DEFINE_DECODE_LAYERS(SUFFIX, T)                                                              \
void decode_layers_##SUFFIX(const layer_desc *const *layers, const step_desc *const *steps, int count, \
                            T *x, T *residual) {                                                     \
    for (int i = 0; i < count; i++) decode_layer_##SUFFIX(layers[i], steps[i], x, residual, i == 0);  \
}

DEFINE_DECODE_LAYERS(f32, float)
DEFINE_DECODE_LAYERS(bf16, bf16)
