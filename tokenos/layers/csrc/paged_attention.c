/* Paged decode attention for CPUs: one query token per request, keys and values read in
 * place from the paged KV cache (no gather, no padding).
 *
 * Cache layout per layer (see tokenos/layers/attention.py): page b starts at element
 * b * page_stride; its K rows are [block_size, num_kv_heads, head_size], its V rows follow
 * at + block_size * num_kv_heads * head_size. Work is split over requests; a request walks its
 * tokens once for K (all heads: a token's row is contiguous) and once for V, with a two-pass
 * softmax in between. Dot products and axpys use AVX2 when the head size allows. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)h) << 16;
    return x.f;
}

/* Widen one head vector to float32 (a no-op copy avoided for float32 caches). */
static inline const float *row_f32(const float *src, float *buf, int d) { (void)buf; (void)d; return src; }
static inline const float *row_bf16(const uint16_t *src, float *buf, int d) {
#ifdef __AVX2__
    int i = 0;
    for (; i + 8 <= d; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
        _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(w));
    }
    for (; i < d; i++) buf[i] = bf16_to_f32(src[i]);
#else
    for (int i = 0; i < d; i++) buf[i] = bf16_to_f32(src[i]);
#endif
    return buf;
}

static inline float dot(const float *restrict a, const float *restrict b, int d) {
#ifdef __AVX2__
    if ((d & 15) == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        }
        __m256 s = _mm256_add_ps(s0, s1);
        __m128 lo = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        lo = _mm_hadd_ps(lo, lo);
        lo = _mm_hadd_ps(lo, lo);
        return _mm_cvtss_f32(lo);
    }
#endif
    float s = 0.f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *restrict y, float p, const float *restrict x, int d) {
#ifdef __AVX2__
    if ((d & 7) == 0) {
        __m256 vp = _mm256_set1_ps(p);
        for (int i = 0; i < d; i += 8)
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        return;
    }
#endif
    for (int i = 0; i < d; i++) y[i] += p * x[i];
}


/* Scores of up to 4 query heads against one key (the heads sharing a KV head): the key is
 * loaded once per 8 lanes and feeds every head's accumulator. */
static inline void dot_group(const float *restrict q, int64_t q_stride, int g, const float *restrict k,
                             int d, float scale, float *restrict out, int64_t out_stride) {
#ifdef __AVX2__
    if ((d & 7) == 0 && g <= 4) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int i = 0; i < d; i += 8) {
            __m256 kv = _mm256_loadu_ps(k + i);
            for (int h = 0; h < g; h++)
                acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * q_stride + i), kv, acc[h]);
        }
        for (int h = 0; h < g; h++) {
            __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc[h]), _mm256_extractf128_ps(acc[h], 1));
            lo = _mm_hadd_ps(lo, lo);
            lo = _mm_hadd_ps(lo, lo);
            out[h * out_stride] = _mm_cvtss_f32(lo) * scale;
        }
        return;
    }
#endif
    for (int h = 0; h < g; h++) out[h * out_stride] = dot(q + h * q_stride, k, d) * scale;
}

/* o_h += p_h * v for up to 4 heads sharing one value row, loading v once per 8 lanes. */
static inline void axpy_group(float *restrict o, int64_t o_stride, int g, const float *restrict p,
                              int64_t p_stride, const float *restrict v, int d) {
#ifdef __AVX2__
    if ((d & 7) == 0 && g <= 4) {
        __m256 ps[4];
        for (int h = 0; h < g; h++) ps[h] = _mm256_set1_ps(p[h * p_stride]);
        for (int i = 0; i < d; i += 8) {
            __m256 vv = _mm256_loadu_ps(v + i);
            for (int h = 0; h < g; h++) {
                float *oh = o + h * o_stride + i;
                _mm256_storeu_ps(oh, _mm256_fmadd_ps(ps[h], vv, _mm256_loadu_ps(oh)));
            }
        }
        return;
    }
#endif
    for (int h = 0; h < g; h++) axpy(o + h * o_stride, p[h * p_stride], v, d);
}

#define DEFINE_DECODE(NAME, T, ROW)                                                             \
void NAME(const float *q, const T *cache, int64_t page_stride, int block_size,                 \
          const int32_t *block_table, int max_blocks, const int32_t *seq_lens, int num_reqs,   \
          int num_heads, int num_kv_heads, int head_size, float scale, int window,             \
          float *out) {                                                                         \
    const int group = num_heads / num_kv_heads;                                                 \
    const int64_t row = (int64_t)num_kv_heads * head_size;                                      \
    const int64_t v_offset = (int64_t)block_size * row;                                         \
    int max_len = 1;                                                                            \
    for (int r = 0; r < num_reqs; r++) if (seq_lens[r] > max_len) max_len = seq_lens[r];       \
    _Pragma("omp parallel")                                                                     \
    {                                                                                           \
        float *scores = (float *)malloc(sizeof(float) * (size_t)num_heads * max_len);          \
        float *buf = (float *)malloc(sizeof(float) * (size_t)head_size);                       \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int r = 0; r < num_reqs; r++) {                                                    \
            const int len = seq_lens[r];                                                        \
            const int start = (window > 0 && len > window) ? len - window : 0;                  \
            const int n = len - start;                                                          \
            const int32_t *blocks = block_table + (int64_t)r * max_blocks;                      \
            const float *qr = q + (int64_t)r * num_heads * head_size;                           \
            for (int i = 0; i < n; i++) {                                                       \
                const int pos = start + i;                                                      \
                const T *k = cache + (int64_t)blocks[pos / block_size] * page_stride            \
                             + (int64_t)(pos % block_size) * row;                               \
                for (int kh = 0; kh < num_kv_heads; kh++) {                                     \
                    const float *kv = ROW(k + (int64_t)kh * head_size, buf, head_size);         \
                    for (int g0 = 0; g0 < group; g0 += 4) {                                     \
                        const int h = kh * group + g0;                                          \
                        const int gn = group - g0 < 4 ? group - g0 : 4;                         \
                        dot_group(qr + (int64_t)h * head_size, head_size, gn, kv, head_size,    \
                                  scale, scores + (int64_t)h * n + i, n);                       \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (int h = 0; h < num_heads; h++) {                                               \
                float *sh = scores + (int64_t)h * n;                                            \
                float m = -INFINITY;                                                            \
                for (int i = 0; i < n; i++) if (sh[i] > m) m = sh[i];                           \
                float sum = 0.f;                                                                \
                for (int i = 0; i < n; i++) { sh[i] = expf(sh[i] - m); sum += sh[i]; }           \
                const float inv = 1.f / sum;                                                    \
                for (int i = 0; i < n; i++) sh[i] *= inv;                                       \
            }                                                                                   \
            float *o = out + (int64_t)r * num_heads * head_size;                                \
            memset(o, 0, sizeof(float) * (size_t)num_heads * head_size);                       \
            for (int i = 0; i < n; i++) {                                                       \
                const int pos = start + i;                                                      \
                const T *v = cache + (int64_t)blocks[pos / block_size] * page_stride            \
                             + v_offset + (int64_t)(pos % block_size) * row;                    \
                for (int kh = 0; kh < num_kv_heads; kh++) {                                     \
                    const float *vv = ROW(v + (int64_t)kh * head_size, buf, head_size);         \
                    for (int g0 = 0; g0 < group; g0 += 4) {                                     \
                        const int h = kh * group + g0;                                          \
                        const int gn = group - g0 < 4 ? group - g0 : 4;                         \
                        axpy_group(o + (int64_t)h * head_size, head_size, gn,                   \
                                   scores + (int64_t)h * n + i, n, vv, head_size);              \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        free(scores); free(buf);                                                                \
    }                                                                                           \
}

DEFINE_DECODE(paged_decode_f32, float, row_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, row_bf16)
